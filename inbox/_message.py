"""One message through the inbox, in its own transaction (docs/inbox.md, "Per message").

Steps for one record:

1. parse the envelope (failure: dead-letter at once);
2. Redis fast path, a hint only (Redis down: skipped): with the "in progress" marker on (the
   default), claim it; the Redis store refuses a done event in the same call, and a refused
   claim then asks the "done" key (duplicate) or waits for the other claimant at most the
   marker's TTL. Without the marker: ask the "done" key;
3. optional per-aggregate lock (fencing token);
4. ONE database transaction: insert the inbox row (conflict: duplicate, skip the handler),
   run the handler with the session, commit;
5. only then: release the lock, "done" in Redis (our marker is then left to expire, else it
   is deleted); the caller marks the offset committable.

Whose fault is it (docs/guarantees.md): a fault of the environment (database away, schema
missing, privilege, read-only...) stops the partition here, retried with backoff and without
bound, health ``down`` with its cause, and never counts as an attempt of the message;
transient failures rerun the whole transaction with backoff up to ``max_attempts``;
permanent ones and exhausted retries are dead-lettered (:mod:`ledgerbox.inbox._deadletterer`).
An event whose row is DEAD_LETTERED is final: acknowledged without running its handler (C17).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from ledgerbox._core.faults import Fault
from ledgerbox.inbox._context import HandlerContext
from ledgerbox.inbox._deadletter import replay_target
from ledgerbox.inbox._deadletterer import DeadLetterer, stall_cause
from ledgerbox.inbox._deps import PipelineDeps
from ledgerbox.inbox._errors import (
    FencedWriteError,
    LockBusyError,
    UnhandledEventError,
    VersionConflictError,
)
from ledgerbox.inbox._handlers import Registered
from ledgerbox.inbox._metrics import UNHANDLED
from ledgerbox.inbox._policy import Outcome, classify, delivery_outcome, should_retry
from ledgerbox.inbox._record import (
    Abandon,
    Parsed,
    Record,
    parse_record,
    record_timestamp_ms,
    sleep_unless_abandoned,
)
from ledgerbox.inbox._redis import LockLease, new_token
from ledgerbox.inbox._spans import consumer_span, set_outcome
from ledgerbox.inbox._store import ClaimResult
from ledgerbox.outbox import EnvelopeParseError, EventEnvelope

__all__ = ["MessagePipeline"]

_log = logging.getLogger("ledgerbox.inbox")

#: Distinct event types per consumer with their own ``ledgerbox_inbox_unhandled_total``
#: series; further types share the label ``"_other"`` (event types come from the records, so
#: a flood of odd types must not grow the metric without bound).
MAX_UNHANDLED_TYPES = 100


class MessagePipeline:
    """The per-message path of one consumer.

    Parameters
    ----------
    deps : PipelineDeps
        The consumer's dependencies.
    dead_letterer : DeadLetterer
        Takes the records that cannot be applied.
    """

    def __init__(self, deps: PipelineDeps, dead_letterer: DeadLetterer) -> None:
        self.deps = deps
        self.metrics = deps.metrics
        self.dead_letterer = dead_letterer
        self._retry_on = tuple(deps.config.retry_on)
        self._dead_letter_on = tuple(deps.config.dead_letter_on)
        self._unhandled: dict[str, Any] = {}  # event type -> its counter child

    async def process(
        self, record: Record, abandon: Callable[[], bool], parsed: Parsed | None = None
    ) -> Outcome:
        """Run the whole pipeline for one record, except the Kafka offset commit.

        ``parsed`` is the record's :func:`inbox._record.parse_record` result when the caller
        already has it. Returns the record's :class:`inbox.Outcome`.
        """
        deps = self.deps
        target = replay_target(record.headers)
        if target is not None and target != deps.group_id:
            # An operator replayed this record for another group (docs/operations.md): this
            # group applied the event already or dead-lettered it itself (final for it).
            _log.debug(
                "record %s[%d]@%d is a replay for group %s: acknowledged without running",
                record.topic,
                record.partition,
                record.offset,
                target,
            )
            return Outcome.IGNORED
        if parsed is None:
            parsed = parse_record(record)
        if isinstance(parsed, EnvelopeParseError):
            return await self.dead_letterer.dead_letter_once(record, None, parsed, abandon)
        with consumer_span(deps.group_id, record, parsed) as span:
            outcome = await self._process_event(record, parsed, abandon)
            set_outcome(span, outcome)
            return outcome

    async def _process_event(
        self, record: Record, event: EventEnvelope, abandon: Callable[[], bool]
    ) -> Outcome:
        # Steps 2-5 for a parsed event (inside its consumer span, if spans are on).
        deps = self.deps
        registered = deps.handlers.get(event.event_type)
        if registered is None:
            return await self._unhandled_event(record, event, abandon)
        owner: str | None = None
        marked_done = False
        # Redis before the database only where a duplicate or a concurrent worker is
        # likely (inbox._hints.HintPolicy); elsewhere the database claim is the only check
        # and "done" is written in the background.
        consult = deps.dedup is not None and deps.hint_policy.consult(
            record.topic, record.partition, record.offset
        )
        try:
            if consult:
                hint = await self._redis_fast_path(event, abandon)
                if hint is Outcome.DUPLICATE:
                    return Outcome.DUPLICATE
                owner = hint if isinstance(hint, str) else None
            outcome = await self._with_retries(registered, event, record, abandon)
            if outcome is Outcome.APPLIED or outcome is Outcome.DUPLICATE:
                marked_done = await self.after_commit(
                    record, event, outcome, background=not consult
                )
            return outcome
        except Abandon:
            return Outcome.ABANDONED
        finally:
            # Once "done" is recorded our marker is moot (a claimant refused by it asks
            # is_done and stops); otherwise it must go, so that nobody waits for its TTL.
            dedup = deps.dedup
            if owner is not None and not marked_done and dedup is not None:
                group, event_id, mine = deps.group_id, event.event_id, owner
                await deps.gate.call(lambda: dedup.unclaim(group, event_id, mine), None)

    async def _redis_fast_path(
        self, event: EventEnvelope, abandon: Callable[[], bool]
    ) -> str | Outcome | None:
        # Steps 2 and 3: DUPLICATE if a "done" key says so, else our "in progress" marker's
        # owner token (None: no marker). The marker only saves a concurrent worker a blocked
        # transaction; after its TTL (or our wait) the database decides, so a crashed
        # claimant never hides an event (C11). The claim comes first: the Redis store
        # refuses a done event in the same round trip, so a new event costs one Redis call.
        deps = self.deps
        dedup, ttl_ms = deps.dedup, deps.config.in_progress_ttl_ms
        assert dedup is not None
        group, event_id = deps.group_id, event.event_id
        if ttl_ms is None:
            if await deps.gate.call(lambda: dedup.is_done(group, event_id), False):
                self.metrics.duplicates_redis.inc()
                return Outcome.DUPLICATE
            return None
        owner = new_token()
        deadline = time.monotonic() + ttl_ms / 1000
        delay_s = 0.01
        while True:
            if await deps.gate.call(lambda: dedup.claim(group, event_id, owner, ttl_ms), True):
                return owner
            if await deps.gate.call(lambda: dedup.is_done(group, event_id), False):
                self.metrics.duplicates_redis.inc()
                return Outcome.DUPLICATE
            if abandon():
                raise Abandon()
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 0.2)

    async def _unhandled_event(
        self, record: Record, event: EventEnvelope, abandon: Callable[[], bool]
    ) -> Outcome:
        # ConsumerConfig.on_unhandled: counted and warned once per type, then ignored,
        # dead-lettered, or the partition stops until a handler is registered.
        deps = self.deps
        event_type = event.event_type
        counter = self._unhandled.get(event_type)
        if counter is None and len(self._unhandled) >= MAX_UNHANDLED_TYPES:
            counter = self._unhandled.get("_other")  # types past the cap: not remembered
            if counter is None:
                counter = UNHANDLED.labels(deps.group_id, "_other")
                self._unhandled["_other"] = counter
                _log.warning(
                    "consumer group %s has seen %d event types without a handler; further "
                    "ones are counted as event_type='_other' and not logged",
                    deps.group_id,
                    MAX_UNHANDLED_TYPES,
                )
        if counter is None:
            counter = UNHANDLED.labels(deps.group_id, event_type)
            self._unhandled[event_type] = counter
            _log.warning(
                "consumer group %s has no handler for event type %r (event %s at %s[%d]@%d): "
                "on_unhandled=%r; register one with @consumer.handler(%r)",
                deps.group_id,
                event_type,
                event.event_id,
                record.topic,
                record.partition,
                record.offset,
                deps.config.on_unhandled,
                event_type,
            )
        counter.inc()
        mode = deps.config.on_unhandled
        if mode == "ignore":
            return Outcome.IGNORED
        if mode == "dead_letter":
            error = UnhandledEventError(event_type)
            return await self.dead_letterer.dead_letter_once(record, event, error, abandon)
        key = (record.topic, record.partition)
        deps.health.fault(
            key,
            f"partition {record.topic}[{record.partition}] stopped at offset {record.offset}: "
            f"no handler registered for event type {event_type!r} (on_unhandled='fail'): "
            "register one, or set on_unhandled to 'ignore' or 'dead_letter'",
        )
        try:
            retry = 0
            while deps.handlers.get(event_type) is None:
                retry += 1
                await sleep_unless_abandoned(deps.config.backoff.ceiling_s(min(retry, 30)), abandon)
        except Abandon:
            deps.health.clear(key, resolved=False)
            return Outcome.ABANDONED
        deps.health.clear(key)
        return await self._process_event(record, event, abandon)

    async def _with_retries(
        self,
        registered: Registered,
        event: EventEnvelope,
        record: Record,
        abandon: Callable[[], bool],
    ) -> Outcome:
        # ``attempt`` counts every try (ctx.attempt); ``charged`` only those that failed for
        # the message itself: a fault of the environment never brings an event closer to the
        # dead-letter topic.
        deps = self.deps
        attempt = charged = stalls = 0
        key = (record.topic, record.partition)
        resolved = False
        try:
            while True:
                attempt += 1
                try:
                    outcome = await self._attempt(registered, event, record, attempt, abandon)
                    resolved = True
                    return outcome
                except Abandon:
                    raise
                except Exception as exc:
                    kind = classify(
                        exc,
                        inbox_constraint=deps.store.pk_constraint,
                        retry_on=self._retry_on,
                        dead_letter_on=self._dead_letter_on,
                    )
                    if kind is Fault.DUPLICATE:
                        self.metrics.duplicates_db.inc()
                        resolved = True
                        return Outcome.DUPLICATE
                    if kind is Fault.ENVIRONMENT:
                        stalls += 1
                        deps.health.fault(key, stall_cause(record, exc))
                        delay_s = deps.config.backoff.delay_s(min(stalls, 30))
                        await sleep_unless_abandoned(delay_s, abandon)
                        continue
                    charged += 1
                    if not should_retry(kind, charged, deps.config.max_attempts):
                        resolved = True  # past the fault; the dead-letterer reports its own
                        return await self.dead_letterer.dead_letter(
                            record, event, exc, charged, abandon
                        )
                    self.metrics.retries.inc()
                    if isinstance(exc, VersionConflictError | FencedWriteError):
                        self.metrics.conflicts.inc()
                    _log.warning(
                        "event %s (%s, key %s) attempt %d failed (%s), retrying: %r",
                        event.event_id,
                        event.event_type,
                        event.partition_key,
                        charged,
                        kind.value,
                        exc,
                    )
                    delay_s = deps.config.backoff.delay_s(min(charged, 30))
                    await sleep_unless_abandoned(delay_s, abandon)
        finally:
            if stalls:
                deps.health.clear(key, resolved=resolved)

    async def _attempt(
        self,
        registered: Registered,
        event: EventEnvelope,
        record: Record,
        attempt: int,
        abandon: Callable[[], bool],
    ) -> Outcome:
        deps = self.deps
        lease = await self._acquire_lock(event, abandon)
        renewer: asyncio.Task[None] | None = None
        try:
            tx = deps.open_tx(registered.is_async)
            ctx: HandlerContext[Any] = HandlerContext(
                session=tx.session,
                group_id=deps.group_id,
                attempt=attempt,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                timestamp_ms=record_timestamp_ms(record),
                fencing_token=lease.fencing_token if lease else None,
                batch=(event,),
            )
            if lease is not None:
                renewer = asyncio.create_task(self._renew(lease, ctx))
            started = time.perf_counter()
            try:
                if deps.hooks.after_begin is not None:
                    await deps.hooks.after_begin(ctx)
                claimed = await deps.store.claim(tx, event.event_id, event.event_type, record)
                if claimed is not ClaimResult.FINAL:
                    await tx.call(registered.fn, ctx, event)
                    await tx.commit()
                    outcome = Outcome.APPLIED
                else:
                    found = await deps.store.statuses(tx, [event.event_id])
                    outcome = delivery_outcome(found.get(event.event_id))
                    if outcome is Outcome.APPLIED:  # the row vanished meanwhile (purged)
                        outcome = Outcome.DUPLICATE
            finally:
                await tx.aclose()
            self.metrics.handler_duration.observe(time.perf_counter() - started)
        finally:
            if renewer is not None:
                renewer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await renewer
            if lease is not None and deps.lock is not None:
                lock = deps.lock
                await deps.gate.call(lambda: lock.release(lease), False)
        if outcome is Outcome.APPLIED:
            self.metrics.processed.inc()
            self.metrics.observe_latency(event.occurred_at)
            if claimed is ClaimResult.REPLAY:
                self.metrics.replayed.inc()
        elif outcome is Outcome.ALREADY_DEAD_LETTERED:
            self.metrics.duplicates_dead_lettered.inc()
        else:
            self.metrics.duplicates_db.inc()
        return outcome

    async def after_commit(
        self, record: Record, event: EventEnvelope, outcome: Outcome, *, background: bool
    ) -> bool:
        """Step 5 for one event whose effect is committed (``APPLIED``, or ``DUPLICATE``
        found by the database): the hooks, then "done" in Redis, awaited, or handed to the
        background writer when ``background`` (no "in progress" marker of ours waits for
        it). True if "done" was recorded (awaited).
        """
        deps = self.deps
        if outcome is Outcome.APPLIED and deps.hooks.after_db_commit is not None:
            await deps.hooks.after_db_commit([event.event_id])
        if deps.hooks.after_commit is not None:
            await deps.hooks.after_commit(record, outcome)
        dedup = deps.dedup
        if dedup is None:
            return False
        if background and deps.hints is not None:
            deps.hints.add([event.event_id])
            return False
        group, event_id, ttl_s = deps.group_id, event.event_id, deps.config.dedup_ttl_s

        async def mark() -> bool:
            await dedup.mark_done(group, event_id, ttl_s)
            return True

        return await deps.gate.call(mark, False)

    async def _acquire_lock(
        self, event: EventEnvelope, abandon: Callable[[], bool]
    ) -> LockLease | None:
        deps = self.deps
        lock = deps.lock
        if lock is None:
            return None
        name = f"{deps.group_id}:{event.aggregate_type}:{event.aggregate_id}"
        ttl_ms = deps.config.lock_ttl_ms
        deadline = time.monotonic() + deps.config.effective_lock_wait_ms / 1000
        delay_s = 0.005
        contended = False
        while True:
            if not deps.gate.usable():
                return None
            lease = await deps.gate.call(lambda: lock.acquire(name, ttl_ms), None)
            if lease is not None:
                self.metrics.lock_acquired.inc()
                return lease
            if deps.gate.degraded:
                return None
            if not contended:  # once per acquisition that found the lock taken
                contended = True
                self.metrics.lock_contended.inc()
            if time.monotonic() >= deadline:
                raise LockBusyError(f"aggregate lock {name!r} stayed taken")
            await sleep_unless_abandoned(delay_s, abandon)
            delay_s = min(delay_s * 2, 0.1)

    async def _renew(self, lease: LockLease, ctx: HandlerContext[Any]) -> None:
        deps = self.deps
        lock, ttl_ms = deps.lock, deps.config.lock_ttl_ms
        assert lock is not None
        while True:
            await asyncio.sleep(ttl_ms / 3000)
            owned = await deps.gate.call(lambda: lock.renew(lease, ttl_ms), True)
            if not owned:
                ctx.lock_lost = True
                self.metrics.lock_expired.inc()
                _log.warning("aggregate lock %s lost while its handler ran", lease.name)
                return
