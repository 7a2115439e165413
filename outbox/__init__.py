"""ledgerbox ``outbox``: write events in the same transaction as your business rows.

Example
-------
>>> writer = OutboxWriter(TopicRouter(default="orders.events"), source="/order-service")
>>> with Session(engine) as session, session.begin():          # doctest: +SKIP
...     session.add(order)
...     writer.stage(session, writer.event(
...         event_type="OrderPlaced", aggregate_type="order", aggregate_id=order.id,
...         payload={"order_id": order.id, "amount": order.amount},
...         idempotency_key=idempotency_key("order", customer_id, request_key)))

If the transaction rolls back, so too is the event. The relay publishes committed events.
"""

from outbox._envelope import EventEnvelope, idempotency_key
from outbox._errors import (
    ConfigurationError,
    DuplicateEventError,
    EnvelopeParseError,
    EventValidationError,
    LedgerboxError,
    NaiveDatetimeError,
    PayloadTooLargeError,
    UnroutedEventError,
)
from outbox._routing import TopicRouter
from outbox._table import DEFAULT_SHARD_COUNT, EventStatus, OutboxTable, shard_of
from outbox._wire import envelope_from_kafka, kafka_headers, timestamp_ms
from outbox._writer import DEFAULT_MAX_PAYLOAD_BYTES, OutboxWriter, Staged, envelope_from_row

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "DEFAULT_SHARD_COUNT",
    "ConfigurationError",
    "DuplicateEventError",
    "EnvelopeParseError",
    "EventEnvelope",
    "EventStatus",
    "EventValidationError",
    "LedgerboxError",
    "NaiveDatetimeError",
    "OutboxTable",
    "OutboxWriter",
    "PayloadTooLargeError",
    "Staged",
    "TopicRouter",
    "UnroutedEventError",
    "envelope_from_kafka",
    "envelope_from_row",
    "idempotency_key",
    "kafka_headers",
    "shard_of",
    "timestamp_ms",
]
