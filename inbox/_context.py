"""What a handler receives besides the event."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ledgerbox.outbox import EventEnvelope

__all__ = ["HandlerContext"]

S = TypeVar("S", Session, AsyncSession)


@dataclass
class HandlerContext(Generic[S]):
    """The open transaction and delivery facts of one handler attempt.

    Attributes
    ----------
    session : AsyncSession | Session
        The session whose transaction holds the inbox row; ``AsyncSession`` for async
        handlers, ``Session`` for sync ones. Write your business rows (and stage outbox events
        with ``OutboxWriter.stage(ctx.session, ...)``) here; the consumer commits. Do not
        commit or roll back yourself: raise to roll back.
    group_id : str
        The consumer group.
    attempt : int
        1 for the first attempt, 2 for the first retry, ...
    topic, partition, offset : str, int, int
        Where the record came from.
    timestamp_ms : int | None
        The Kafka record's timestamp, in ms since the epoch: the event time the relay set
        (``occurred_at``), or the broker's append time on a topic with
        ``message.timestamp.type=LogAppendTime``; ``None`` when the record has none.
    fencing_token : int | None
        Token of the per-aggregate lock held for this attempt (grows with every acquisition
        of that aggregate's lock); ``None`` when locking is off or Redis is unreachable.
        Guard writes with :func:`inbox.fenced_update` (``WHERE fence < :token``).
    batch : tuple[EventEnvelope, ...]
        The events whose handlers run in this transaction, in the order they run, this one
        among them: ``(event,)`` on the per-message path; in a batch up to
        ``batch_max_records`` events (any registered types whose handlers are all async or
        all sync; several partitions' with ``batch_across_partitions``), only those the
        inbox claimed for this transaction: no second copy, nothing applied or dead-lettered
        before.
        For reading ahead: the first handler of a batch can read the rows of all of them in
        one statement (``WHERE id = ANY(:ids)``) and keep them in ``session.info`` with the
        transaction (``session.get_transaction()``; the consumer opens a new session per
        transaction, a caller of your own may not), the next ones use them, each
        writing only for its own event, with its optimistic version (G5): a row another
        transaction changed since the read is then a version conflict, the batch rolls back
        and its events run again with a fresh read (in the end one per transaction, each
        with ``batch == (event,)``; docs/inbox.md, "Reading ahead for a batch"). The
        example services do this.
    """

    session: S
    group_id: str
    attempt: int
    topic: str
    partition: int
    offset: int
    fencing_token: int | None = None
    lock_lost: bool = field(default=False)
    """True once a renewal found the lock taken by someone else (writes should be fenced)."""
    timestamp_ms: int | None = None
    """The Kafka record's timestamp in ms since the epoch (see the class docstring)."""
    batch: tuple[EventEnvelope, ...] = field(default=(), repr=False, compare=False)
    """The events whose handlers run in this transaction (see the class docstring)."""
