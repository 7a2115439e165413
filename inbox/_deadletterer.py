"""Dead-lettering a poison record (G7): the dead-letter topic first, then the inbox row.

A record is a poison record when it cannot be parsed, when its handler fails permanently or
when its transient failures exhausted ``max_attempts`` (docs/inbox.md, "Errors and retries").
Its offset may move only once the dead-letter topic has stored it, so the send is retried
until it succeeds or the record is abandoned. The record layout is :mod:`inbox._deadletter`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from ledgerbox._core.faults import Fault
from ledgerbox.inbox._deadletter import dead_letter_headers
from ledgerbox.inbox._deps import PipelineDeps
from ledgerbox.inbox._policy import Outcome, classify
from ledgerbox.inbox._record import Abandon, Record, record_identity, sleep_unless_abandoned
from ledgerbox.outbox import EventEnvelope

__all__ = ["DeadLetterer"]

_log = logging.getLogger("ledgerbox.inbox")


class DeadLetterer:
    """Dead-letters the poison records of one consumer: dead-letter topic first, then the
    inbox row marked DEAD_LETTERED with the reason.

    Parameters
    ----------
    deps : PipelineDeps
        Uses ``config`` (topic, backoff), ``dead_letters``, ``store``, ``open_tx``, ``metrics``.
    """

    def __init__(self, deps: PipelineDeps) -> None:
        self.deps = deps

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

        Returns ``DEAD_LETTERED``, or ``ABANDONED`` if ``abandon()`` turned True while a send
        was retried: the offset must not move before the dead-letter topic has the record.
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
        )
        retry = 0
        try:
            while True:
                try:
                    await deps.dead_letters.publish(topic, record.key, record.value, headers)
                    break
                except Exception as exc:  # the offset must not move before the DLQ has it
                    retry += 1
                    _log.warning("dead-letter send to %s failed, retrying: %r", topic, exc)
                    delay_s = deps.config.backoff.delay_s(min(retry, 30))
                    await sleep_unless_abandoned(delay_s, abandon)
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
        deps = self.deps
        message = f"{type(error).__name__}: {error}"
        retry = 0
        while True:
            tx = deps.open_tx(True)
            try:
                await deps.store.record_failure(tx, event_id, event_type, record, message, attempts)
                await tx.commit()
                return
            except Exception as exc:
                retry += 1
                if classify(exc) is Fault.MESSAGE or retry >= 1000:
                    _log.error(
                        "could not mark event %s dead-lettered in the inbox: %r", event_id, exc
                    )
                    return
                delay_s = deps.config.backoff.delay_s(min(retry, 30))
                await sleep_unless_abandoned(delay_s, abandon)
            finally:
                await tx.aclose()
