"""The error tree of ledgerbox: one root, every public error below it.

::

    ledgerbox.LedgerboxError
    ├── ledgerbox.ConfigurationError        a setting or name is invalid (also ValueError)
    ├── ledgerbox.outbox
    │   ├── EventValidationError            an event cannot be written (also ValueError)
    │   │   ├── NaiveDatetimeError          a datetime without tzinfo in envelope or payload
    │   │   ├── PayloadTooLargeError        serialized payload above ``max_payload_bytes``
    │   │   └── UnroutedEventError          no topic route for the event/aggregate type
    │   ├── EnvelopeParseError              a Kafka record is not a ledgerbox event
    │   └── DuplicateEventError             an idempotency key was already written
    ├── ledgerbox.relay
    │   └── RelayError                      the relay could not do something
    │       └── StoreError                  a database call of the relay failed
    └── ledgerbox.inbox
        └── InboxError                      any inbox failure
            ├── VersionConflictError        optimistic version check matched no row (G5)
            ├── FencedWriteError            a fenced write was refused: a newer holder wrote
            ├── LockBusyError               the per-aggregate lock stayed taken
            ├── RedisUnavailableError       Redis did not answer; the DB path carries on (G6)
            └── DeadLetterError             the dead-letter topic refused a record (retried)

Driver errors (psycopg, SQLAlchemy, aiokafka, redis) are translated into these only at the
seams (the relay store, the inbox store and transaction, the Redis edges, the Kafka edges),
classified from ONE table (:mod:`ledgerbox._core.faults`) by SQLSTATE or error class, never by
message text. Every exception reports its public import path (``__module__``).
"""

from __future__ import annotations

__all__ = ["ConfigurationError", "LedgerboxError"]


class LedgerboxError(Exception):
    """Root of every error raised by ledgerbox (``outbox``, ``relay``, ``inbox``)."""

    __module__ = "ledgerbox"


class ConfigurationError(LedgerboxError, ValueError):
    """A configuration value is invalid (e.g. a table name that is not a SQL identifier)."""

    __module__ = "ledgerbox"
