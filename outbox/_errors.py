"""Errors of ``ledgerbox.outbox`` (the whole tree: :mod:`ledgerbox._core.errors`)."""

from __future__ import annotations

from ledgerbox._core.errors import LedgerboxError

__all__ = [
    "EnvelopeParseError",
    "EventValidationError",
    "FutureEventTimeError",
    "NaiveDatetimeError",
    "NonFiniteNumberError",
    "PayloadTooLargeError",
    "RecordTooLargeError",
    "UnroutedEventError",
]


class EventValidationError(LedgerboxError, ValueError):
    """An event cannot be written as given. Raised at write time; nothing was staged."""

    __module__ = "ledgerbox.outbox"


class NaiveDatetimeError(EventValidationError):
    """A datetime without ``tzinfo`` was found in the envelope or the payload.

    Attributes
    ----------
    path : str
        Where the value was found, e.g. ``"payload.created_at"``.
    """

    __module__ = "ledgerbox.outbox"

    def __init__(self, path: str) -> None:
        super().__init__(f"naive datetime at {path!r}: only timezone-aware datetimes are allowed")
        self.path = path


class FutureEventTimeError(EventValidationError):
    """The event time is further in the future than the writer accepts (``max_future_s``):
    Kafka would refuse the record's timestamp after the transaction committed.

    Attributes
    ----------
    occurred_at : datetime
        The refused event time.
    max_future_s : float
        The writer's limit, in seconds after its clock.
    """

    __module__ = "ledgerbox.outbox"

    def __init__(self, occurred_at: object, max_future_s: float) -> None:
        super().__init__(
            f"occurred_at {occurred_at} is more than {max_future_s:g} s in the future: "
            "pass the real event time, or build the OutboxWriter with a larger max_future_s"
        )
        self.occurred_at = occurred_at
        self.max_future_s = max_future_s


class NonFiniteNumberError(EventValidationError):
    """A NaN or +-Infinity was found in the payload: JSON has no such numbers (PostgreSQL's
    ``jsonb`` refuses them, pydantic would write ``null``), so the event is refused at write
    time instead of failing at flush.

    Attributes
    ----------
    path : str
        Where the value was found, e.g. ``"payload.items[2].price"``.
    """

    __module__ = "ledgerbox.outbox"

    def __init__(self, path: str, value: object) -> None:
        super().__init__(
            f"{value!r} at {path!r}: JSON has no NaN or Infinity; send a finite number, "
            "a string, or null"
        )
        self.path = path


class PayloadTooLargeError(EventValidationError):
    """The serialized payload is larger than the configured maximum.

    Attributes
    ----------
    size_bytes : int
        Size of the UTF-8 JSON payload in bytes.
    max_bytes : int
        The configured limit in bytes (default 1 MiB, Kafka's default ``max.message.bytes``).
    """

    __module__ = "ledgerbox.outbox"

    def __init__(self, size_bytes: int, max_bytes: int) -> None:
        super().__init__(f"payload is {size_bytes} bytes, above the limit of {max_bytes} bytes")
        self.size_bytes = size_bytes
        self.max_bytes = max_bytes


class RecordTooLargeError(PayloadTooLargeError):
    """The event's Kafka record (payload as the relay sends it, key and headers) would be
    larger than ``OutboxWriter.max_record_bytes``: the relay would dead-letter it.

    Attributes
    ----------
    size_bytes : int
        Estimated size of the record in bytes (Kafka's own estimate of a record batch
        holding it; the payload rendered as PostgreSQL's ``jsonb`` prints it).
    max_bytes : int
        ``max_record_bytes``.
    """

    __module__ = "ledgerbox.outbox"

    def __init__(self, size_bytes: int, max_bytes: int) -> None:
        EventValidationError.__init__(
            self,
            f"the event's Kafka record would be {size_bytes} bytes (payload, key and headers),"
            f" above max_record_bytes {max_bytes}, so the relay would dead-letter it: make the"
            " payload smaller, or raise the writer's max_record_bytes together with the"
            " relays' --max-request-bytes and the topic's max.message.bytes",
        )
        self.size_bytes = size_bytes
        self.max_bytes = max_bytes


class UnroutedEventError(EventValidationError):
    """No topic is configured for the event type nor for its aggregate type."""

    __module__ = "ledgerbox.outbox"

    def __init__(self, event_type: str, aggregate_type: str) -> None:
        super().__init__(
            f"no topic route for event type {event_type!r} nor aggregate type {aggregate_type!r}; "
            "add one to TopicRouter or give it a default topic"
        )
        self.event_type = event_type
        self.aggregate_type = aggregate_type


class EventIdConflictError(EventValidationError):
    """The event's id is stored already, under ANOTHER idempotency key.

    Event ids derive from idempotency keys (``uuid5`` of the key), so this only happens
    when a caller passes its own ``event_id`` and reuses it for a different business
    identity; nothing is written (``OutboxWriter.stage_once``; docs/outbox.md,
    "Idempotency")."""

    __module__ = "ledgerbox.outbox"

    def __init__(self, event_id: object, idempotency_key: str) -> None:
        super().__init__(
            f"event id {event_id} is already stored under another idempotency key than "
            f"{idempotency_key!r}: give each business identity its own event id (or let "
            "ledgerbox derive it from the idempotency key)"
        )
        self.event_id = event_id
        self.idempotency_key = idempotency_key


class EnvelopeParseError(LedgerboxError, ValueError):
    """A Kafka record could not be read as a ledgerbox event (bad bytes, headers or fields)."""

    __module__ = "ledgerbox.outbox"
