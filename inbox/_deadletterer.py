"""Dead-lettering a poison record (G7): the dead-letter topic first, then the inbox row.

A record is a poison record when it cannot be parsed, when its handler fails permanently,
when its failures exhausted ``max_attempts`` (docs/inbox.md, "Errors and retries") or, with
``on_unhandled="dead_letter"``, when its type has no handler. Its offset may move only once
the dead-letter topic has stored it and its inbox row says DEAD_LETTERED, so both steps are
retried until they succeed or the record is abandoned; a fault of the environment on the
way (broker away, inbox table missing, read-only database) is reported as health ``down``
and never lets the offset move. A DEAD_LETTERED row is final: a redelivery or a copy of the
event is acknowledged without a second dead-letter record (C17). The record layout is
:mod:`inbox._deadletter`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ledgerbox._core.faults import Fault
from ledgerbox.inbox._deadletter import dead_letter_headers
from ledgerbox.inbox._deps import PipelineDeps
from ledgerbox.inbox._policy import Outcome, classify
from ledgerbox.inbox._record import (
    Abandon,
    Record,
    await_unless_abandoned,
    record_identity,
    sleep_unless_abandoned,
)
from ledgerbox.inbox._table import InboxStatus
from ledgerbox.inbox._tx import Tx
from ledgerbox.outbox import EventEnvelope

__all__ = ["DeadLetterer", "stall_cause"]

T = TypeVar("T")
_log = logging.getLogger("ledgerbox.inbox")

#: Transient failures of the inbox update after the dead-letter send are retried this often
#: before the row is given up (the dead-letter record exists; only finality is lost).
MAX_TRANSIENT_RETRIES = 1000


def stall_cause(record: Record, error: BaseException) -> str:
    """The one-line cause of health ``down`` for a partition stopped at ``record``."""
    text = str(error).strip().splitlines()
    detail = text[0] if text else type(error).__name__
    if getattr(error, "sqlstate", None) == "55P03":  # lock_not_available (lock_timeout)
        detail += (
            " (the lock_timeout ran out: another transaction holds a lock this one needs -"
            " a session 'idle in transaction', a migration, another consumer's slow handler;"
            " retried until it is released)"
        )
    return (
        f"partition {record.topic}[{record.partition}] stopped at offset {record.offset}: {detail}"
    )


class DeadLetterer:
    """Dead-letters the poison records of one consumer: dead-letter topic first, then the
    inbox row marked DEAD_LETTERED with the reason.

    Parameters
    ----------
    deps : PipelineDeps
        Uses ``config`` (topic, backoff), ``dead_letters``, ``store``, ``open_tx``,
        ``metrics``, ``health``.
    """

    def __init__(self, deps: PipelineDeps) -> None:
        self.deps = deps

    async def dead_letter_once(
        self,
        record: Record,
        event: EventEnvelope | None,
        error: BaseException,
        abandon: Callable[[], bool],
    ) -> Outcome:
        """:meth:`dead_letter` for a record that never reached a claim (unparseable, no
        handler), unless its event already has a final inbox row: ``ALREADY_DEAD_LETTERED``
        (or ``DUPLICATE`` for a DONE row) without a second dead-letter record.

        A record without a readable event id cannot be recognised and is dead-lettered
        again when it is redelivered. Costs one read of the inbox, on this path only.
        """
        event_id, _type = record_identity(record, event)
        if event_id is not None:
            try:
                found = await self._until_done(
                    record, lambda tx: self.deps.store.statuses(tx, [event_id]), abandon
                )
            except Abandon:
                return Outcome.ABANDONED
            status = None if found is None else found.get(event_id)
            if status is InboxStatus.DEAD_LETTERED:
                self.deps.metrics.duplicates_dead_lettered.inc()
                return Outcome.ALREADY_DEAD_LETTERED
            if status is InboxStatus.DONE:
                self.deps.metrics.duplicates_db.inc()
                return Outcome.DUPLICATE
        return await self.dead_letter(record, event, error, 1, abandon)

    async def dead_letter(
        self,
        record: Record,
        event: EventEnvelope | None,
        error: BaseException,
        attempts: int,
        abandon: Callable[[], bool],
    ) -> Outcome:
        """Publish ``record`` (original bytes and headers, plus the error) to its dead-letter
        topic, retrying until it is stored, then record the failure in the inbox.

        Returns ``DEAD_LETTERED``, or ``ABANDONED`` if ``abandon()`` turned True while a step
        was retried, or while the send was in flight and it did not finish within
        ``stop_timeout_s`` (a broker away): the offset must not move before the dead-letter
        topic has the record and the inbox row says so.
        """
        deps = self.deps
        topic = deps.config.dead_letter_topic_for(record.topic)
        headers = dead_letter_headers(
            list(record.headers or ()),
            error=error,
            attempts=attempts,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            group=deps.group_id,
        )
        key = (record.topic, record.partition)
        retry = 0
        try:
            while True:
                try:
                    # Bounded once the record is abandoned (stop, revoke): a send to a
                    # broker that is away would wait out its request timeout.
                    await await_unless_abandoned(
                        deps.dead_letters.publish(topic, record.key, record.value, headers),
                        abandon,
                        deps.config.stop_timeout_s,
                    )
                    break
                except Abandon:
                    if retry:
                        deps.health.clear(key, resolved=False)
                    raise
                except Exception as exc:  # the offset must not move before the DLQ has it
                    retry += 1
                    deps.health.fault(key, stall_cause(record, exc))
                    delay_s = deps.config.backoff.delay_s(min(retry, 30))
                    try:
                        await sleep_unless_abandoned(delay_s, abandon)
                    except Abandon:
                        deps.health.clear(key, resolved=False)
                        raise
            if retry:
                deps.health.clear(key)
            event_id, event_type = record_identity(record, event)
            if event_id is not None:
                await self._record_failure(record, event_id, event_type, error, attempts, abandon)
        except Abandon:
            return Outcome.ABANDONED
        deps.metrics.dead_lettered.inc()
        _log.error(
            "record %s[%d]@%d (event %s) dead-lettered to %s after %d attempt(s): %s: %s",
            record.topic,
            record.partition,
            record.offset,
            event.event_id if event else "?",
            topic,
            attempts,
            type(error).__name__,
            error,
        )
        return Outcome.DEAD_LETTERED

    async def _record_failure(
        self,
        record: Record,
        event_id: uuid.UUID,
        event_type: str | None,
        error: BaseException,
        attempts: int,
        abandon: Callable[[], bool],
    ) -> None:
        message = f"{type(error).__name__}: {error}"

        async def mark(tx: Tx) -> bool:
            await self.deps.store.record_failure(
                tx, event_id, event_type, record, message, attempts
            )
            await tx.commit()
            return True

        done = await self._until_done(record, mark, abandon)
        if done is None:
            _log.error("could not mark event %s dead-lettered in the inbox", event_id)

    async def _until_done(
        self, record: Record, step: Callable[[Tx], Awaitable[T]], abandon: Callable[[], bool]
    ) -> T | None:
        # One inbox statement in its own transaction, retried: without bound (and health
        # down) for a fault of the environment, MAX_TRANSIENT_RETRIES times for a transient
        # one. None: a fault of the message itself (logged), nothing more to try.
        deps = self.deps
        key = (record.topic, record.partition)
        stalls = transient = 0
        resolved = False
        try:
            while True:
                tx = deps.open_tx(True)
                try:
                    result = await step(tx)
                    resolved = True
                    return result
                except Exception as exc:
                    kind = classify(exc)
                    if kind is Fault.ENVIRONMENT:
                        stalls += 1
                        deps.health.fault(key, stall_cause(record, exc))
                    elif kind is Fault.TRANSIENT and transient < MAX_TRANSIENT_RETRIES:
                        transient += 1
                    else:
                        _log.error(
                            "inbox update for record %s[%d]@%d failed for good: %r",
                            record.topic,
                            record.partition,
                            record.offset,
                            exc,
                        )
                        resolved = True
                        return None
                    delay_s = deps.config.backoff.delay_s(min(stalls + transient, 30))
                    await sleep_unless_abandoned(delay_s, abandon)
                finally:
                    await tx.aclose()
        finally:
            if stalls:
                deps.health.clear(key, resolved=resolved)
