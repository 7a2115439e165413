"""Pure policy of the inbox: retry classification and inbox row state transitions.

No clock, no I/O: everything here is a function of its arguments.
"""

from __future__ import annotations

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
    "delivery_outcome",
    "should_retry",
]


class Outcome(enum.Enum):
    """What happened to one record. Every outcome except ``ABANDONED`` lets the offset move."""

    APPLIED = "applied"  # the handler's effect committed with the inbox row
    DUPLICATE = "duplicate"  # already applied for this group (Redis hint or DB inbox)
    DEAD_LETTERED = "dead_lettered"  # on the dead-letter topic, inbox row DEAD_LETTERED
    IGNORED = "ignored"  # no handler for this event type: acknowledged, nothing written
    #: a redelivery or copy of a dead-lettered event: acknowledged, handler not run (C17)
    ALREADY_DEAD_LETTERED = "already_dead_lettered"
    ABANDONED = "abandoned"  # the partition was revoked or the consumer stopped mid-retry


def classify(
    exc: BaseException,
    *,
    inbox_constraint: str | None = None,
    retry_on: tuple[type[BaseException], ...] = (),
    dead_letter_on: tuple[type[BaseException], ...] = (),
) -> Fault:
    """Whose fault a failed attempt is, from the library's own error types (the seams
    translated every driver error; ``ledgerbox._core.faults`` holds the one table) and the
    exception types the user declared (docs/inbox.md, "Errors and retries").

    The order of the rules is the rule of docs/guarantees.md, "Whose fault is it": a fault
    of the environment is never the event's, whatever the user declared.

    1. An unparseable record: ``MESSAGE``.
    2. A database or Kafka error of the environment, Redis or the network away:
       ``ENVIRONMENT``; a unique violation of the inbox key: ``DUPLICATE``.
    3. Serialization failures, deadlocks, version conflicts, fenced writes, busy locks:
       ``TRANSIENT`` (concurrency, never the event's fault either).
    4. A type the user declared decides for database errors of the data (a constraint, an
       invalid value: ``MESSAGE`` unless declared in ``retry_on``) and for every other
       exception: ``dead_letter_on``: ``MESSAGE``, ``retry_on``: ``TRANSIENT``. It is
       matched on the exception, then on what it wraps and its causes (a driver error the
       seam translated is still found by its driver class); the declared class closest to
       the concrete class of one of them wins.
    5. Anything else (timeouts, an unknown handler exception): ``TRANSIENT``, so that it is
       retried up to ``max_attempts`` before it is dead-lettered.

    Parameters
    ----------
    exc : BaseException
        What the attempt raised (handler, inbox insert or commit).
    inbox_constraint : str | None
        Name of the inbox primary key constraint. A unique violation on it means a
        concurrent worker committed the same event first (C05): ``DUPLICATE``. A unique
        violation of any other constraint is the message's fault: ``MESSAGE``.
    retry_on, dead_letter_on : tuple[type[BaseException], ...]
        ``ConsumerConfig.retry_on`` / ``ConsumerConfig.dead_letter_on``.

    Returns
    -------
    Fault
        ``ENVIRONMENT`` (retried without bound, partition stopped, health ``down``),
        ``TRANSIENT`` (retried up to ``max_attempts``), ``DUPLICATE`` or ``MESSAGE``
        (dead-letter now).
    """
    if isinstance(exc, EnvelopeParseError):
        return Fault.MESSAGE
    if isinstance(exc, DatabaseError | BrokerError):
        if exc.fault is Fault.DUPLICATE:
            is_inbox = isinstance(exc, DatabaseError) and exc.constraint == inbox_constraint
            if is_inbox and inbox_constraint:
                return Fault.DUPLICATE
            return _declared(exc, retry_on, dead_letter_on) or Fault.MESSAGE
        if exc.fault is Fault.MESSAGE:
            return _declared(exc, retry_on, dead_letter_on) or Fault.MESSAGE
        return exc.fault  # ENVIRONMENT or TRANSIENT: never the user's to change
    if isinstance(exc, RedisUnavailableError | ConnectionError):
        return Fault.ENVIRONMENT
    if isinstance(exc, VersionConflictError | FencedWriteError | LockBusyError):
        return Fault.TRANSIENT  # concurrency, never the event's fault
    # Timeouts and any exception nobody declared: a bounded number of retries, then the
    # dead-letter topic.
    return _declared(exc, retry_on, dead_letter_on) or Fault.TRANSIENT


def _declared(
    exc: BaseException,
    retry_on: tuple[type[BaseException], ...],
    dead_letter_on: tuple[type[BaseException], ...],
) -> Fault | None:
    # The exception, what it wraps (SQLAlchemy's ``orig``) and its causes are all matched:
    # a driver error the seam translated is still found by its driver class. The declared
    # class closest to the concrete class of any of them (its index in that MRO) wins; on a
    # tie the outer exception wins.
    if not retry_on and not dead_letter_on:
        return None
    best: tuple[int, Fault] | None = None
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        item = todo.pop(0)
        if id(item) in seen:
            continue
        seen.add(id(item))
        for depth, cls in enumerate(type(item).__mro__):
            if best is not None and depth >= best[0]:
                break
            if cls in dead_letter_on:
                best = (depth, Fault.MESSAGE)
            elif cls in retry_on:
                best = (depth, Fault.TRANSIENT)
        orig = getattr(item, "orig", None)
        if isinstance(orig, BaseException):
            todo.append(orig)
        if item.__cause__ is not None:
            todo.append(item.__cause__)
    return None if best is None else best[1]


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
#: committed is never undone nor re-run. DEAD_LETTERED is final for the consumer: a
#: redelivery or a copy of the event is acknowledged without running the handler (C17); only
#: an operator's replay request (:meth:`inbox._store.InboxStore.request_replay`) moves it to
#: REPLAY_REQUESTED, which the next delivery takes over (DONE when it succeeds,
#: DEAD_LETTERED again when it fails again).
_TRANSITIONS: frozenset[tuple[InboxStatus | None, InboxStatus]] = frozenset(
    {
        (None, InboxStatus.DONE),
        (None, InboxStatus.DEAD_LETTERED),
        (InboxStatus.DEAD_LETTERED, InboxStatus.REPLAY_REQUESTED),
        (InboxStatus.REPLAY_REQUESTED, InboxStatus.DONE),
        (InboxStatus.REPLAY_REQUESTED, InboxStatus.DEAD_LETTERED),
    }
)


def check_transition(current: InboxStatus | None, target: InboxStatus) -> bool:
    """True if an inbox row may go from ``current`` (``None``: absent) to ``target``.

    The store's SQL encodes the same table (the claim takes over only a REPLAY_REQUESTED
    row, a failure overwrites only a REPLAY_REQUESTED row, a replay request moves only a
    DEAD_LETTERED one); a unit test keeps the two in step.
    """
    return (current, target) in _TRANSITIONS


def delivery_outcome(existing: InboxStatus | None) -> Outcome:
    """What a delivery of an event does when its claim found the row in ``existing`` state
    (``None``: the claim inserted or took over the row, the handler runs).

    DONE: ``DUPLICATE``. DEAD_LETTERED: ``ALREADY_DEAD_LETTERED`` (final, C17). A row that
    vanished between the claim and the look-up (purged) counts as ``DUPLICATE``: its claim
    conflicted, so its effect or its dead-lettering had committed.
    """
    if existing is None:
        return Outcome.APPLIED
    if existing is InboxStatus.DEAD_LETTERED:
        return Outcome.ALREADY_DEAD_LETTERED
    return Outcome.DUPLICATE
