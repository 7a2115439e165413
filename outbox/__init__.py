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

Names are imported on first use (PEP 562): ``import outbox`` is cheap, and a process that
needs only light parts (the relay daemon) never loads SQLAlchemy or pydantic.
"""

from typing import TYPE_CHECKING

from outbox._lazy import lazy_exports

if TYPE_CHECKING:
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
    from outbox._names import DEFAULT_SHARD_COUNT
    from outbox._routing import TopicRouter
    from outbox._table import EventStatus, OutboxTable, shard_of
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

if not TYPE_CHECKING:  # type checkers see the imports above, so typos stay errors
    __getattr__, __dir__ = lazy_exports(
        __name__,
        globals(),
        {
            "ConfigurationError": "outbox._errors",
            "DEFAULT_MAX_PAYLOAD_BYTES": "outbox._writer",
            "DEFAULT_SHARD_COUNT": "outbox._names",
            "DuplicateEventError": "outbox._errors",
            "EnvelopeParseError": "outbox._errors",
            "EventEnvelope": "outbox._envelope",
            "EventStatus": "outbox._table",
            "EventValidationError": "outbox._errors",
            "LedgerboxError": "outbox._errors",
            "NaiveDatetimeError": "outbox._errors",
            "OutboxTable": "outbox._table",
            "OutboxWriter": "outbox._writer",
            "PayloadTooLargeError": "outbox._errors",
            "Staged": "outbox._writer",
            "TopicRouter": "outbox._routing",
            "UnroutedEventError": "outbox._errors",
            "envelope_from_kafka": "outbox._wire",
            "envelope_from_row": "outbox._writer",
            "idempotency_key": "outbox._envelope",
            "kafka_headers": "outbox._wire",
            "shard_of": "outbox._table",
            "timestamp_ms": "outbox._wire",
        },
    )
