"""Pure policy of the inbox: retry classification and inbox row state transitions.

No clock, no I/O: everything here is a function of its arguments.
"""

from __future__ import annotations

import asyncio
import enum

from ledgerbox._core.errors import BrokerError, DatabaseError
from ledgerbox._core.faults import Fault
from ledgerbox.inbox._errors import (
    FencedWriteError,
    LockBusyError,
    RedisUnavailableError,
    VersionConflictError,
)
from ledgerbox.inbox._table import InboxStatus
from ledgerbox.outbox import EnvelopeParseError

__all__ = [
    "Fault",
    "Outcome",
    "check_transition",
    "classify",
    "should_retry",
]


class Outcome(enum.Enum):
    """What happened to one record. Every outcome except ``ABANDONED`` lets the offset move."""

    APPLIED = "applied"  # the handler's effect committed with the inbox row
    DUPLICATE = "duplicate"  # already applied for this group (Redis hint or DB inbox)
    DEAD_LETTERED = "dead_lettered"  # on the dead-letter topic, inbox row DEAD_LETTERED
    IGNORED = "ignored"  # no handler for this event type: acknowledged, nothing written
    ABANDONED = "abandoned"  # the partition was revoked or the consumer stopped mid-retry


def classify(exc: BaseException, *, inbox_constraint: str | None = None) -> Fault:
    """Whose fault a failed attempt is, from the library's own error types (the seams
    translated every driver error; ``ledgerbox._core.faults`` holds the one table).

    Parameters
    ----------
    exc : BaseException
        What the attempt raised (handler, inbox insert or commit).
    inbox_constraint : str | None
        Name of the inbox primary key constraint. A unique violation on it means a
        concurrent worker committed the same event first (C05): ``DUPLICATE``. A unique
        violation of any other constraint is the message's fault: ``MESSAGE``.

    Returns
    -------
    Fault
        ``ENVIRONMENT`` (retried without bound: the database or Kafka is away or
        misconfigured), ``TRANSIENT`` (retried up to ``max_attempts``: serialization
        failures, deadlocks, version conflicts, fenced writes, busy locks, timeouts),
        ``DUPLICATE`` or ``MESSAGE`` (dead-letter now: unparseable, bad data, a constraint).
    """
    if isinstance(exc, EnvelopeParseError):
        return Fault.MESSAGE
    if isinstance(exc, VersionConflictError | FencedWriteError | LockBusyError):
        return Fault.TRANSIENT
    if isinstance(exc, DatabaseError | BrokerError):
        if exc.fault is Fault.DUPLICATE:
            is_inbox = isinstance(exc, DatabaseError) and exc.constraint == inbox_constraint
            return Fault.DUPLICATE if is_inbox and inbox_constraint else Fault.MESSAGE
        return exc.fault
    if isinstance(exc, RedisUnavailableError | ConnectionError):
        return Fault.ENVIRONMENT
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return Fault.TRANSIENT
    return Fault.MESSAGE


def should_retry(fault: Fault, attempt: int, max_attempts: int) -> bool:
    """True if attempt number ``attempt`` (1-based) failed with a fault worth another try.

    ``ENVIRONMENT`` is always retried: a database outage or a schema not yet migrated must
    not dead-letter the messages that arrive during it. ``TRANSIENT`` is retried while
    ``attempt < max_attempts``.
    """
    if fault is Fault.ENVIRONMENT:
        return True
    return fault is Fault.TRANSIENT and attempt < max_attempts


#: Allowed inbox row transitions. ``None`` is "no row". DONE is final: an effect that
#: committed is never undone nor re-run. DEAD_LETTERED may become DONE when a dead-lettered event
#: is replayed and succeeds.
_TRANSITIONS: frozenset[tuple[InboxStatus | None, InboxStatus]] = frozenset(
    {
        (None, InboxStatus.DONE),
        (None, InboxStatus.DEAD_LETTERED),
        (InboxStatus.DEAD_LETTERED, InboxStatus.DONE),
        (InboxStatus.DEAD_LETTERED, InboxStatus.DEAD_LETTERED),
    }
)


def check_transition(current: InboxStatus | None, target: InboxStatus) -> bool:
    """True if an inbox row may go from ``current`` (``None``: absent) to ``target``.

    The store's SQL encodes the same table (``ON CONFLICT ... WHERE status = DEAD_LETTERED``); a
    unit test keeps the two in step.
    """
    return (current, target) in _TRANSITIONS
