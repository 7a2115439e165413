"""Errors of ``ledgerbox.inbox`` (the whole tree: :mod:`ledgerbox._core.errors`).

Driver errors are translated only at the seams: the database's in the transaction adapter
(:mod:`ledgerbox.inbox._tx`, as :class:`ledgerbox.DatabaseError`), Redis's in
:mod:`ledgerbox.inbox._redis`, Kafka's in :mod:`ledgerbox.inbox._deadletter`; retry
classification (:func:`ledgerbox.inbox._policy.classify`) reads only those types.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ledgerbox._core.errors import BrokerError, LedgerboxError

__all__ = [
    "DeadLetterError",
    "FencedWriteError",
    "InboxError",
    "LockBusyError",
    "RedisUnavailableError",
    "StartupError",
    "UnhandledEventError",
    "VersionConflictError",
]


class InboxError(LedgerboxError):
    """Root of the errors raised by the inbox consumer and its helpers."""

    __module__ = "ledgerbox.inbox"


class VersionConflictError(InboxError):
    """An optimistic ``UPDATE ... WHERE version = :expected`` matched no row.

    The row changed (or vanished) since it was read. The consumer rolls back and reruns the
    handler in a fresh transaction, which reads the new version and decides again (C06).

    Attributes
    ----------
    table : str
        Name of the table.
    key : dict
        The key columns and values of the row.
    expected_version : int
        The version the caller expected.
    """

    __module__ = "ledgerbox.inbox"

    def __init__(self, table: str, key: Mapping[str, Any], expected_version: int) -> None:
        super().__init__(
            f"{table} row {dict(key)!r} is no longer at version {expected_version} "
            "(changed or deleted concurrently)"
        )
        self.table = table
        self.key = dict(key)
        self.expected_version = expected_version


class FencedWriteError(InboxError):
    """A fenced ``UPDATE ... WHERE fence < :token`` matched no row: a newer lock holder wrote.

    Attributes
    ----------
    table : str
        Name of the table.
    key : dict
        The key columns and values of the row.
    fencing_token : int
        The (stale) token of the caller.
    """

    __module__ = "ledgerbox.inbox"

    def __init__(self, table: str, key: Mapping[str, Any], fencing_token: int) -> None:
        super().__init__(
            f"{table} row {dict(key)!r} was written under a fencing token newer than "
            f"{fencing_token}; this writer lost its lock"
        )
        self.table = table
        self.key = dict(key)
        self.fencing_token = fencing_token


class LockBusyError(InboxError):
    """The per-aggregate lock was held by another worker for the whole wait (retried)."""

    __module__ = "ledgerbox.inbox"


class RedisUnavailableError(InboxError):
    """Redis did not answer in time or refused the command. Never fatal: the DB is the truth."""

    __module__ = "ledgerbox.inbox"


class DeadLetterError(InboxError, BrokerError):
    """The dead-letter record could not be written to Kafka (``fault``, ``kind``: see
    :class:`ledgerbox.BrokerError`); the offset is not committed and the send is retried."""

    __module__ = "ledgerbox.inbox"


class UnhandledEventError(InboxError):
    """No handler is registered for an event's type (``ConsumerConfig.on_unhandled``):
    the reason a record is dead-lettered under ``on_unhandled="dead_letter"``, and the
    cause of health ``down`` under ``on_unhandled="fail"``.

    Attributes
    ----------
    event_type : str
        The type that has no handler.
    """

    __module__ = "ledgerbox.inbox"

    def __init__(self, event_type: str) -> None:
        super().__init__(f"no handler registered for event type {event_type!r}")
        self.event_type = event_type


class StartupError(InboxError):
    """A consumer cannot start for a reason that waiting will not fix (invalid settings,
    credentials refused). The message is one line: the cause and the fix. Faults that may
    pass by themselves (an unreachable database or broker, a table not yet migrated) never
    raise this: :meth:`ledgerbox.inbox.InboxConsumer.run` waits for them (health ``down``).
    """

    __module__ = "ledgerbox.inbox"
