"""The error tree of ledgerbox: one root, every public error below it.

::

    LedgerboxError
    ├── ConfigurationError            bad table/schema name, bad setting
    ├── EventValidationError          (also ValueError) an event cannot be written
    │   ├── NaiveDatetimeError        a datetime without tzinfo in the envelope or payload
    │   ├── PayloadTooLargeError      serialized payload above ``max_payload_bytes``
    │   └── UnroutedEventError        no topic route for the event type / aggregate type
    ├── EnvelopeParseError            (also ValueError) a Kafka record is not a ledgerbox event
    ├── DuplicateEventError           an idempotency key was already written (see ``is_duplicate``)
    ├── relay.RelayError              defined in ``relay``
    └── inbox.InboxError              defined in ``inbox``

Driver errors (psycopg, aiokafka, redis) are translated into these only at the storage and
broker seams, classified by SQLSTATE or error class, never by message text.
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "DuplicateEventError",
    "EnvelopeParseError",
    "EventValidationError",
    "LedgerboxError",
    "NaiveDatetimeError",
    "PayloadTooLargeError",
    "UnroutedEventError",
]


class LedgerboxError(Exception):
    """Root of every error raised by ledgerbox (``outbox``, ``relay``, ``inbox``)."""

    __module__ = "outbox"


class ConfigurationError(LedgerboxError, ValueError):
    """A configuration value is invalid (e.g. a table name that is not a SQL identifier)."""

    __module__ = "outbox"


class EventValidationError(LedgerboxError, ValueError):
    """An event cannot be written as given. Raised at write time; nothing was staged."""

    __module__ = "outbox"


class NaiveDatetimeError(EventValidationError):
    """A datetime without ``tzinfo`` was found in the envelope or the payload.

    Attributes
    ----------
    path : str
        Where the value was found, e.g. ``"payload.created_at"``.
    """

    __module__ = "outbox"

    def __init__(self, path: str) -> None:
        super().__init__(f"naive datetime at {path!r}: only timezone-aware datetimes are allowed")
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

    __module__ = "outbox"

    def __init__(self, size_bytes: int, max_bytes: int) -> None:
        super().__init__(f"payload is {size_bytes} bytes, above the limit of {max_bytes} bytes")
        self.size_bytes = size_bytes
        self.max_bytes = max_bytes


class UnroutedEventError(EventValidationError):
    """No topic is configured for the event type nor for its aggregate type."""

    __module__ = "outbox"

    def __init__(self, event_type: str, aggregate_type: str) -> None:
        super().__init__(
            f"no topic route for event type {event_type!r} nor aggregate type {aggregate_type!r}; "
            "add one to TopicRouter or give it a default topic"
        )
        self.event_type = event_type
        self.aggregate_type = aggregate_type


class EnvelopeParseError(LedgerboxError, ValueError):
    """A Kafka record could not be read as a ledgerbox event (bad bytes, headers or fields)."""

    __module__ = "outbox"


class DuplicateEventError(LedgerboxError):
    """An outbox row with this idempotency key already exists (SQLSTATE 23505 on its constraint).

    Attributes
    ----------
    idempotency_key : str | None
        The duplicated key when it is known, else ``None``.
    """

    __module__ = "outbox"

    def __init__(self, idempotency_key: str | None) -> None:
        super().__init__(f"an event with idempotency key {idempotency_key!r} was already written")
        self.idempotency_key = idempotency_key
