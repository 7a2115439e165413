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

if __name__ != "ledgerbox.outbox":  # the repository folder is importable from its root too
    raise ImportError(f"import ledgerbox.outbox, not {__name__} (one import package: ledgerbox)")


from typing import TYPE_CHECKING

from ledgerbox._core.lazy import lazy_exports

if TYPE_CHECKING:
    from ledgerbox._core.names import DEFAULT_SHARD_COUNT
    from ledgerbox.outbox._envelope import EventEnvelope, idempotency_key
    from ledgerbox.outbox._errors import (
        EnvelopeParseError,
        EventIdConflictError,
        EventValidationError,
        FutureEventTimeError,
        NaiveDatetimeError,
        NonFiniteNumberError,
        PayloadTooLargeError,
        RecordTooLargeError,
        UnroutedEventError,
    )
    from ledgerbox.outbox._routing import TopicRouter
    from ledgerbox.outbox._table import EventStatus, OutboxTable, shard_of
    from ledgerbox.outbox._wire import envelope_from_kafka, kafka_headers, timestamp_ms
    from ledgerbox.outbox._writer import (
        DEFAULT_MAX_PAYLOAD_BYTES,
        DEFAULT_MAX_RECORD_BYTES,
        OutboxWriter,
        Staged,
        envelope_from_row,
    )

__all__ = [
    "DEFAULT_MAX_FUTURE_S",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "DEFAULT_MAX_RECORD_BYTES",
    "DEFAULT_SHARD_COUNT",
    "EnvelopeParseError",
    "EventEnvelope",
    "EventIdConflictError",
    "EventStatus",
    "EventValidationError",
    "FutureEventTimeError",
    "NaiveDatetimeError",
    "NonFiniteNumberError",
    "OutboxTable",
    "OutboxWriter",
    "PayloadTooLargeError",
    "RecordTooLargeError",
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
            "DEFAULT_MAX_FUTURE_S": "ledgerbox.outbox._writer",
            "DEFAULT_MAX_PAYLOAD_BYTES": "ledgerbox.outbox._writer",
            "DEFAULT_MAX_RECORD_BYTES": "ledgerbox.outbox._writer",
            "DEFAULT_SHARD_COUNT": "ledgerbox._core.names",
            "EnvelopeParseError": "ledgerbox.outbox._errors",
            "EventIdConflictError": "ledgerbox.outbox._errors",
            "EventEnvelope": "ledgerbox.outbox._envelope",
            "EventStatus": "ledgerbox.outbox._table",
            "EventValidationError": "ledgerbox.outbox._errors",
            "FutureEventTimeError": "ledgerbox.outbox._errors",
            "NaiveDatetimeError": "ledgerbox.outbox._errors",
            "NonFiniteNumberError": "ledgerbox.outbox._errors",
            "OutboxTable": "ledgerbox.outbox._table",
            "OutboxWriter": "ledgerbox.outbox._writer",
            "PayloadTooLargeError": "ledgerbox.outbox._errors",
            "RecordTooLargeError": "ledgerbox.outbox._errors",
            "Staged": "ledgerbox.outbox._writer",
            "TopicRouter": "ledgerbox.outbox._routing",
            "UnroutedEventError": "ledgerbox.outbox._errors",
            "envelope_from_kafka": "ledgerbox.outbox._wire",
            "envelope_from_row": "ledgerbox.outbox._writer",
            "idempotency_key": "ledgerbox.outbox._envelope",
            "kafka_headers": "ledgerbox.outbox._wire",
            "shard_of": "ledgerbox.outbox._table",
            "timestamp_ms": "ledgerbox.outbox._wire",
        },
    )
