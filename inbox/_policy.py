"""Pure policy of the inbox: retry classification and inbox row state transitions.

No clock, no I/O: everything here is a function of its arguments (STYLE.md rule 4).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterator

from ledgerbox.inbox._errors import FencedWriteError, LockBusyError, VersionConflictError
from ledgerbox.inbox._table import InboxStatus
from ledgerbox.outbox import EnvelopeParseError

__all__ = [
    "ErrorClass",
    "Outcome",
    "check_transition",
    "classify",
    "should_retry",
]

#: SQLSTATEs worth a retry in a fresh transaction (PostgreSQL docs, Appendix A).
#: 40001 serialization_failure and 40P01 deadlock_detected are the documented "retry the
#: transaction" cases; 55P03 lock_not_available (lock_timeout); 57014 query_canceled
#: (statement_timeout).
TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "55P03", "57014"})
#: The server is gone or refusing work (57P01..57P03 shutdown, 53300 too many connections,
#: class 08 connection exceptions): no message is at fault, so these never dead-letter.
UNAVAILABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300"})
UNAVAILABLE_SQLSTATE_CLASSES = frozenset({"08"})
UNIQUE_VIOLATION = "23505"


class ErrorClass(enum.Enum):
    """How the consumer treats a failed attempt."""

    TRANSIENT = "transient"  # roll back, back off, rerun in a fresh transaction (bounded)
    UNAVAILABLE = "unavailable"  # the database is unreachable: back off and retry, unbounded
    PERMANENT = "permanent"  # roll back, dead-letter at once
    DUPLICATE = "duplicate"  # roll back, the event's effect already committed: acknowledge


class Outcome(enum.Enum):
    """What happened to one record. Every outcome except ``ABANDONED`` lets the offset move."""

    APPLIED = "applied"  # the handler's effect committed with the inbox row
    DUPLICATE = "duplicate"  # already applied for this group (Redis hint or DB inbox)
    DEAD_LETTERED = "dead_lettered"  # parked on the dead-letter topic, inbox row FAILED
    IGNORED = "ignored"  # no handler for this event type: acknowledged, nothing written
    ABANDONED = "abandoned"  # the partition was revoked or the consumer stopped mid-retry


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        orig = getattr(current, "orig", None)  # sqlalchemy.exc.DBAPIError wraps the driver's
        if isinstance(orig, BaseException) and id(orig) not in seen:
            yield from _chain(orig)
        current = current.__cause__ or current.__context__


def sqlstate_of(exc: BaseException) -> str | None:
    """The first SQLSTATE found on ``exc`` or on the errors it wraps, else ``None``."""
    for item in _chain(exc):
        state = getattr(item, "sqlstate", None)
        if isinstance(state, str) and state:
            return state
    return None


def classify(exc: BaseException, *, inbox_constraint: str | None = None) -> ErrorClass:
    """Classify a failed attempt by exception class and SQLSTATE, never by message text.

    Parameters
    ----------
    exc : BaseException
        What the attempt raised (handler, inbox insert or commit).
    inbox_constraint : str | None
        Name of the inbox primary key constraint. A unique violation (23505) on it means a
        concurrent worker committed the same event first (C05): ``DUPLICATE``. A 23505 on any
        other constraint (or without a name) is a business error: ``PERMANENT``.

    Returns
    -------
    ErrorClass
        ``UNAVAILABLE`` for a lost or refused database connection (SQLSTATE class 08,
        57P01-57P03, 53300, driver connection errors, ``ConnectionError``); ``TRANSIENT`` for
        timeouts, serialization failures (40001), deadlocks (40P01), lock and statement
        timeouts, version conflicts, fenced writes and busy locks; ``DUPLICATE`` for a 23505
        on the inbox key; ``PERMANENT`` otherwise (bad payloads, bugs, other constraint
        violations).
    """
    for item in _chain(exc):
        if isinstance(item, EnvelopeParseError):
            return ErrorClass.PERMANENT
        if isinstance(item, VersionConflictError | FencedWriteError | LockBusyError):
            return ErrorClass.TRANSIENT
        state = getattr(item, "sqlstate", None)
        if isinstance(state, str) and state:
            if state == UNIQUE_VIOLATION:
                diag = getattr(item, "diag", None)
                name = getattr(diag, "constraint_name", None)
                if name is not None and name == inbox_constraint:
                    return ErrorClass.DUPLICATE
                return ErrorClass.PERMANENT
            if state in UNAVAILABLE_SQLSTATES or state[:2] in UNAVAILABLE_SQLSTATE_CLASSES:
                return ErrorClass.UNAVAILABLE
            if state in TRANSIENT_SQLSTATES:
                return ErrorClass.TRANSIENT
            return ErrorClass.PERMANENT
        if _is_disconnect(item) or isinstance(item, ConnectionError):
            return ErrorClass.UNAVAILABLE
        if isinstance(item, TimeoutError | asyncio.TimeoutError):
            return ErrorClass.TRANSIENT
    return ErrorClass.PERMANENT


def _is_disconnect(exc: BaseException) -> bool:
    # SQLAlchemy marks errors that invalidated the connection; psycopg's OperationalError
    # without a SQLSTATE is a client-side connection failure.
    if getattr(exc, "connection_invalidated", False):
        return True
    cls_names = {c.__name__ for c in type(exc).__mro__}
    module = type(exc).__module__
    return module.startswith("psycopg") and "OperationalError" in cls_names


def should_retry(error_class: ErrorClass, attempt: int, max_attempts: int) -> bool:
    """True if attempt number ``attempt`` (1-based) failed with a class worth another try.

    ``UNAVAILABLE`` is always retried: a database outage must not dead-letter the messages
    that arrive during it. ``TRANSIENT`` is retried while ``attempt < max_attempts``.
    """
    if error_class is ErrorClass.UNAVAILABLE:
        return True
    return error_class is ErrorClass.TRANSIENT and attempt < max_attempts


#: Allowed inbox row transitions. ``None`` is "no row". DONE is final: an effect that
#: committed is never undone nor re-run. FAILED may become DONE when a dead-lettered event
#: is replayed and succeeds.
_TRANSITIONS: frozenset[tuple[InboxStatus | None, InboxStatus]] = frozenset(
    {
        (None, InboxStatus.DONE),
        (None, InboxStatus.FAILED),
        (InboxStatus.FAILED, InboxStatus.DONE),
        (InboxStatus.FAILED, InboxStatus.FAILED),
    }
)


def check_transition(current: InboxStatus | None, target: InboxStatus) -> bool:
    """True if an inbox row may go from ``current`` (``None``: absent) to ``target``.

    The store's SQL encodes the same table (``ON CONFLICT ... WHERE status = FAILED``); a
    unit test keeps the two in step.
    """
    return (current, target) in _TRANSITIONS
