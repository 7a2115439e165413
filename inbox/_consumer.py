"""The inbox consumer: Kafka records in, one committed effect per (group, event id) out.

Steps for one record (DESIGN.md section 4):

1. parse the envelope (failure: dead-letter at once);
2. Redis "done" key? duplicate (a hint only; Redis down: skip this step);
3. optional Redis "in progress" marker and per-aggregate lock (fencing token);
4. ONE database transaction: insert the inbox row (conflict: duplicate, skip the handler),
   run the handler with the session, commit;
5. only then: "done" in Redis, release the lock, and mark the offset committable.

Offsets are committed only for records that reached step 5 or were dead-lettered. Partitions
run concurrently (one task each), records of one partition strictly in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from inbox._config import ConsumerConfig
from inbox._context import HandlerContext
from inbox._deadletter import DeadLetterPublisher, KafkaDeadLetterPublisher, dead_letter_headers
from inbox._errors import FencedWriteError, LockBusyError, VersionConflictError
from inbox._gate import RedisGate
from inbox._metrics import (
    CONFLICTS,
    DEAD_LETTERED,
    DUPLICATES,
    HANDLER_DURATION,
    PROCESSED,
    RETRIES,
)
from inbox._policy import ErrorClass, Outcome, classify, should_retry
from inbox._redis import (
    AggregateLock,
    DedupStore,
    LockLease,
    RedisAggregateLock,
    RedisDedupStore,
    new_token,
    redis_client,
)
from inbox._store import InboxStore
from inbox._table import InboxTable
from inbox._tx import AsyncTx, SyncTx, Tx
from outbox import EnvelopeParseError, EventEnvelope, envelope_from_kafka

if TYPE_CHECKING:
    from inbox._runner import KafkaRunner

__all__ = ["ConsumerHooks", "Handler", "InboxConsumer", "Record"]

_log = logging.getLogger("inbox")

#: Test-only: when set to a file path, the consumer creates that file right after a handler's
#: database commit and then stalls before anything else (Redis "done", offset commit), so a
#: test can kill it exactly between the DB commit and the offset commit.
STALL_AFTER_COMMIT_ENV = "LEDGERBOX_INBOX_TEST_STALL_AFTER_COMMIT"

Handler = Callable[[HandlerContext[Any], EventEnvelope], Awaitable[None] | None]
Health = Literal["ok", "degraded"]


class Record(Protocol):
    """What the consumer reads from a Kafka record (``aiokafka.ConsumerRecord`` fits)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes]]: ...


@dataclass
class ConsumerHooks:
    """Test-only hooks (fault injection). Production code leaves them unset.

    Attributes
    ----------
    after_begin : Callable[[HandlerContext], Awaitable[None]] | None
        Called with the open transaction before the inbox row is inserted (e.g. a barrier
        between two workers, C05).
    after_commit : Callable[[Record, Outcome], Awaitable[None]] | None
        Called after the database transaction and before Redis and the offset.
    """

    after_begin: Callable[[HandlerContext[Any]], Awaitable[None]] | None = None
    after_commit: Callable[[Any, Outcome], Awaitable[None]] | None = None


@dataclass(frozen=True)
class _Registered:
    fn: Handler
    is_async: bool


class _Abandon(Exception):
    """The partition was revoked or the consumer stopped while a message waited to retry."""


class InboxConsumer:
    """Runs handlers for Kafka events, applying each event's effect at most once per group (G4).

    Parameters
    ----------
    config : ConsumerConfig
        Settings.
    dedup : DedupStore | None
        Redis fast-path store; default: :class:`inbox.RedisDedupStore` on ``config.redis_url``
        (none when it is ``None``).
    lock : AggregateLock | None
        Per-aggregate lock; default: on ``config.redis_url`` when ``lock_aggregates``.
    dead_letters : DeadLetterPublisher | None
        Default: Kafka on ``config.kafka_bootstrap_servers``.
    engine, async_engine : Engine | None, AsyncEngine | None
        Database engines; default: built from ``config.database_url``.
    hooks : ConsumerHooks | None
        Test-only fault injection.

    Guarantee: a handler's writes commit in the same transaction as the inbox row of its
    event, so for one group and event id at most one effect ever commits, whatever the
    redeliveries, crashes, rebalances or Redis outages.
    """

    def __init__(
        self,
        config: ConsumerConfig,
        *,
        dedup: DedupStore | None = None,
        lock: AggregateLock | None = None,
        dead_letters: DeadLetterPublisher | None = None,
        engine: Engine | None = None,
        async_engine: AsyncEngine | None = None,
        hooks: ConsumerHooks | None = None,
    ) -> None:
        self.config = config
        self.group_id = config.group_id
        self.table = InboxTable(config.inbox_table, schema=config.schema)
        self.store = InboxStore(self.table, config.group_id)
        client = None
        wants_lock = config.lock_aggregates and lock is None
        if config.redis_url is not None and (dedup is None or wants_lock):
            client = redis_client(config.redis_url, timeout_s=config.redis_timeout_s)
        self._redis_client = client
        if dedup is None and client is not None:
            dedup = RedisDedupStore(client, config.redis_key_prefix)
        if lock is None and client is not None and config.lock_aggregates:
            lock = RedisAggregateLock(client, config.redis_key_prefix)
        self.dedup = dedup
        self.lock = lock
        self.dead_letters = dead_letters or KafkaDeadLetterPublisher(config.kafka_bootstrap_servers)
        self.gate = RedisGate(config.group_id, config.redis_probe_interval_s)
        self.hooks = hooks or ConsumerHooks()
        self._engine = engine
        self._async_engine = async_engine
        self._owns_engines = (engine is None, async_engine is None)
        self._handlers: dict[str, _Registered] = {}
        self._stop_requested = False
        self._runner: KafkaRunner | None = None
        self._stall_path = os.environ.get(STALL_AFTER_COMMIT_ENV) or None

    # -- registration -------------------------------------------------------------------

    def handler(self, event_type: str) -> Callable[[Handler], Handler]:
        """Decorator registering ``fn(ctx, event)`` for ``event_type``.

        Async functions get an ``AsyncSession``; plain functions get a sync ``Session`` and
        run in a worker thread. Events without a handler are acknowledged and ignored.
        """

        def register(fn: Handler) -> Handler:
            self.register(event_type, fn)
            return fn

        return register

    def register(self, event_type: str, fn: Handler) -> None:
        """Register ``fn`` for ``event_type`` (see :meth:`handler`)."""
        if event_type in self._handlers:
            raise ValueError(f"a handler for {event_type!r} is already registered")
        self._handlers[event_type] = _Registered(fn, inspect.iscoroutinefunction(fn))

    # -- resources ------------------------------------------------------------------------

    @property
    def async_engine(self) -> AsyncEngine:
        """The async engine (built on first use)."""
        if self._async_engine is None:
            self._async_engine = create_async_engine(self.config.database_url)
        return self._async_engine

    @property
    def engine(self) -> Engine:
        """The sync engine for sync handlers (built on first use)."""
        if self._engine is None:
            self._engine = create_engine(self.config.database_url)
        return self._engine

    def _open_tx(self, registered: _Registered | None) -> Tx:
        if registered is None or registered.is_async:
            return AsyncTx(self.async_engine)
        return SyncTx(self.engine)

    async def aclose(self) -> None:
        """Release engines, producer and Redis connections this consumer created."""
        await self.dead_letters.close()
        if self._redis_client is not None:
            with contextlib.suppress(Exception):
                await self._redis_client.aclose()
        if self._owns_engines[1] and self._async_engine is not None:
            await self._async_engine.dispose()
            self._async_engine = None
        if self._owns_engines[0] and self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def health(self) -> Health:
        """``"degraded"`` while Redis is unreachable (the DB path carries on), else ``"ok"``."""
        return "degraded" if self.gate.degraded else "ok"

    # -- one record -----------------------------------------------------------------------

    async def process_record(
        self, record: Record, *, abandon: Callable[[], bool] | None = None
    ) -> Outcome:
        """Run the whole pipeline for one record, except the Kafka offset commit.

        Parameters
        ----------
        record : Record
            An ``aiokafka.ConsumerRecord`` or :class:`inbox.testing.FakeRecord`.
        abandon : Callable[[], bool] | None
            Polled while waiting to retry; when it returns True the record is given up
            (``Outcome.ABANDONED``: its offset must not be committed).

        Returns
        -------
        Outcome
            ``APPLIED``, ``DUPLICATE``, ``DEAD_LETTERED``, ``IGNORED`` or ``ABANDONED``.
        """
        should_abandon = abandon or (lambda: False)
        try:
            event = envelope_from_kafka(
                record.topic, record.key, record.value, list(record.headers or ())
            )
        except EnvelopeParseError as exc:
            return await self._dead_letter(record, None, exc, 1, should_abandon)
        registered = self._handlers.get(event.event_type)
        if registered is None:
            _log.debug("no handler for %s, event %s ignored", event.event_type, event.event_id)
            return Outcome.IGNORED
        dedup = self.dedup
        if dedup is not None and await self.gate.call(
            lambda: dedup.is_done(self.group_id, event.event_id), False
        ):
            DUPLICATES.labels(self.group_id, "redis").inc()
            return Outcome.DUPLICATE
        owner: str | Outcome | None = None
        try:
            owner = await self._claim_in_progress(event, should_abandon)
            if owner is Outcome.DUPLICATE:
                return Outcome.DUPLICATE
            return await self._with_retries(registered, event, record, should_abandon)
        except _Abandon:
            return Outcome.ABANDONED
        finally:
            if isinstance(owner, str) and dedup is not None:
                mine, group = owner, self.group_id
                await self.gate.call(lambda: dedup.unclaim(group, event.event_id, mine), None)

    async def _claim_in_progress(
        self, event: EventEnvelope, abandon: Callable[[], bool]
    ) -> str | Outcome | None:
        # The marker only saves a concurrent worker a blocked transaction; after its TTL (or
        # our wait) the database decides, so a crashed claimant never hides an event (C11).
        dedup, ttl_ms = self.dedup, self.config.in_progress_ttl_ms
        if dedup is None or ttl_ms is None:
            return None
        owner = new_token()
        deadline = time.monotonic() + ttl_ms / 1000
        delay_s = 0.01
        group, event_id = self.group_id, event.event_id
        while True:
            if await self.gate.call(lambda: dedup.claim(group, event_id, owner, ttl_ms), True):
                return owner
            if await self.gate.call(lambda: dedup.is_done(self.group_id, event.event_id), False):
                DUPLICATES.labels(self.group_id, "redis").inc()
                return Outcome.DUPLICATE
            if abandon():
                raise _Abandon()
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 0.2)

    async def _with_retries(
        self,
        registered: _Registered,
        event: EventEnvelope,
        record: Record,
        abandon: Callable[[], bool],
    ) -> Outcome:
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._attempt(registered, event, record, attempt, abandon)
            except _Abandon:
                raise
            except Exception as exc:
                kind = classify(exc, inbox_constraint=self.store.pk_constraint)
                if kind is ErrorClass.DUPLICATE:
                    DUPLICATES.labels(self.group_id, "db").inc()
                    await self._after_commit(record, event, Outcome.DUPLICATE)
                    return Outcome.DUPLICATE
                if not should_retry(kind, attempt, self.config.max_attempts):
                    return await self._dead_letter(record, event, exc, attempt, abandon)
                RETRIES.labels(self.group_id).inc()
                if isinstance(exc, VersionConflictError | FencedWriteError):
                    CONFLICTS.labels(self.group_id).inc()
                _log.warning(
                    "event %s (%s, key %s) attempt %d failed (%s), retrying: %r",
                    event.event_id,
                    event.event_type,
                    event.partition_key,
                    attempt,
                    kind.value,
                    exc,
                )
                await self._sleep(self.config.backoff.delay_s(min(attempt, 30)), abandon)

    async def _sleep(self, delay_s: float, abandon: Callable[[], bool]) -> None:
        deadline = time.monotonic() + delay_s
        while True:
            if abandon():
                raise _Abandon()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(left, 0.05))

    async def _attempt(
        self,
        registered: _Registered,
        event: EventEnvelope,
        record: Record,
        attempt: int,
        abandon: Callable[[], bool],
    ) -> Outcome:
        lease = await self._acquire_lock(event, abandon)
        renewer: asyncio.Task[None] | None = None
        try:
            tx = self._open_tx(registered)
            ctx: HandlerContext[Any] = HandlerContext(
                session=tx.session,
                group_id=self.group_id,
                attempt=attempt,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                fencing_token=lease.fencing_token if lease else None,
            )
            if lease is not None:
                renewer = asyncio.create_task(self._renew(lease, ctx))
            started = time.perf_counter()
            try:
                if self.hooks.after_begin is not None:
                    await self.hooks.after_begin(ctx)
                claimed = await self.store.claim(tx, event.event_id, event.event_type, record)
                if claimed:
                    await tx.call(registered.fn, ctx, event)
                    await tx.commit()
            finally:
                await tx.close()
            HANDLER_DURATION.labels(self.group_id).observe(time.perf_counter() - started)
        finally:
            if renewer is not None:
                renewer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await renewer
            if lease is not None and self.lock is not None:
                lock = self.lock
                await self.gate.call(lambda: lock.release(lease), False)
        if claimed:
            PROCESSED.labels(self.group_id).inc()
            outcome = Outcome.APPLIED
        else:
            DUPLICATES.labels(self.group_id, "db").inc()
            outcome = Outcome.DUPLICATE
        await self._after_commit(record, event, outcome)
        return outcome

    async def _stall_if_asked(self, event_id: uuid.UUID) -> None:
        if self._stall_path is not None:
            path, line = self._stall_path, f"{event_id}\n"
            await asyncio.to_thread(lambda: open(path, "a").write(line))  # noqa: SIM115
            await asyncio.Event().wait()  # until the test kills this process

    async def _after_commit(self, record: Record, event: EventEnvelope, outcome: Outcome) -> None:
        if outcome is Outcome.APPLIED:
            await self._stall_if_asked(event.event_id)
        if self.hooks.after_commit is not None:
            await self.hooks.after_commit(record, outcome)
        dedup = self.dedup
        if dedup is not None:
            group, event_id, ttl_s = self.group_id, event.event_id, self.config.dedup_ttl_s
            await self.gate.call(lambda: dedup.mark_done(group, event_id, ttl_s), None)

    async def _acquire_lock(
        self, event: EventEnvelope, abandon: Callable[[], bool]
    ) -> LockLease | None:
        lock = self.lock
        if lock is None:
            return None
        name = f"{self.group_id}:{event.aggregate_type}:{event.aggregate_id}"
        ttl_ms = self.config.lock_ttl_ms
        deadline = time.monotonic() + self.config.effective_lock_wait_ms / 1000
        delay_s = 0.005
        while True:
            if not self.gate.usable():
                return None
            lease = await self.gate.call(lambda: lock.acquire(name, ttl_ms), None)
            if lease is not None or self.gate.degraded:
                return lease
            if time.monotonic() >= deadline:
                raise LockBusyError(f"aggregate lock {name!r} stayed taken")
            await self._sleep(delay_s, abandon)
            delay_s = min(delay_s * 2, 0.1)

    async def _renew(self, lease: LockLease, ctx: HandlerContext[Any]) -> None:
        lock, ttl_ms = self.lock, self.config.lock_ttl_ms
        assert lock is not None
        while True:
            await asyncio.sleep(ttl_ms / 3000)
            owned = await self.gate.call(lambda: lock.renew(lease, ttl_ms), True)
            if not owned:
                ctx.lock_lost = True
                _log.warning("aggregate lock %s lost while its handler ran", lease.name)
                return

    async def _dead_letter(
        self,
        record: Record,
        event: EventEnvelope | None,
        error: BaseException,
        attempts: int,
        abandon: Callable[[], bool],
    ) -> Outcome:
        topic = self.config.dead_letter_topic_for(record.topic)
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
                    await self.dead_letters.publish(topic, record.key, record.value, headers)
                    break
                except Exception as exc:  # the offset must not move before the DLQ has it
                    retry += 1
                    _log.warning("dead-letter send to %s failed, retrying: %r", topic, exc)
                    await self._sleep(self.config.backoff.delay_s(min(retry, 30)), abandon)
            event_id, event_type = _identity(record, event)
            if event_id is not None:
                await self._record_failure(record, event_id, event_type, error, attempts, abandon)
        except _Abandon:
            return Outcome.ABANDONED
        DEAD_LETTERED.labels(self.group_id).inc()
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
        retry = 0
        while True:
            tx = self._open_tx(None)
            try:
                await self.store.record_failure(tx, event_id, event_type, record, message, attempts)
                await tx.commit()
                return
            except Exception as exc:
                retry += 1
                if classify(exc) is ErrorClass.PERMANENT or retry >= 1000:
                    _log.error("could not mark event %s FAILED in the inbox: %r", event_id, exc)
                    return
                await self._sleep(self.config.backoff.delay_s(min(retry, 30)), abandon)
            finally:
                await tx.close()

    # -- several records of one partition in one transaction -------------------------------

    async def process_batch(
        self, records: Sequence[Record], *, abandon: Callable[[], bool] | None = None
    ) -> list[Outcome]:
        """Run the pipeline for consecutive records of ONE partition, in order.

        Runs of up to ``batch_max_records`` parseable records whose handlers are of one kind
        (async or sync) are applied in one transaction: one multi-row inbox insert, the
        handlers of the newly inserted events in offset order, one commit. Any error rolls
        the whole run back and its records go through :meth:`process_record` one by one
        (retries, dead-lettering). Guarantees are those of :meth:`process_record`.

        Returns
        -------
        list[Outcome]
            One outcome per record, in order; it stops after the first ``ABANDONED``.
        """
        should_abandon = abandon or (lambda: False)
        outcomes: list[Outcome] = []
        i = 0
        while i < len(records):
            if should_abandon():  # revoked or stopping: the rest is the next owner's
                outcomes.append(Outcome.ABANDONED)
                return outcomes
            j, events, registered = self._batchable_run(records, i)
            run: list[Outcome] | None = None
            if j - i >= 2 and registered is not None:
                run = await self._apply_batch(records[i:j], events, registered)
            if run is None:
                j = max(j, i + 1)
                for record in records[i:j]:
                    if should_abandon():
                        outcomes.append(Outcome.ABANDONED)
                        return outcomes
                    outcome = await self.process_record(record, abandon=should_abandon)
                    outcomes.append(outcome)
                    if outcome is Outcome.ABANDONED:
                        return outcomes
            else:
                outcomes.extend(run)
            i = j
        return outcomes

    def _batchable_run(
        self, records: Sequence[Record], start: int
    ) -> tuple[int, list[EventEnvelope], _Registered | None]:
        limit = 1 if self.lock is not None else self.config.batch_max_records
        events: list[EventEnvelope] = []
        kind: _Registered | None = None
        end = start
        while end < len(records) and end - start < limit:
            record = records[end]
            try:
                event = envelope_from_kafka(
                    record.topic, record.key, record.value, list(record.headers or ())
                )
            except EnvelopeParseError:
                break
            registered = self._handlers.get(event.event_type)
            if registered is None or (kind is not None and registered.is_async != kind.is_async):
                break
            kind = kind or registered
            events.append(event)
            end += 1
        return end, events, kind

    async def _apply_batch(
        self, records: Sequence[Record], events: list[EventEnvelope], kind: _Registered
    ) -> list[Outcome] | None:
        group = self.group_id
        dedup = self.dedup
        ids = [e.event_id for e in events]
        done: set[uuid.UUID] = set()
        if dedup is not None:
            done = await self.gate.call(lambda: dedup.done_among(group, ids), set())
        outcomes: list[Outcome] = [Outcome.DUPLICATE] * len(events)
        todo: list[tuple[int, EventEnvelope, Record]] = []
        seen: set[uuid.UUID] = set()
        for k, (record, event) in enumerate(zip(records, events, strict=True)):
            if event.event_id in done:
                DUPLICATES.labels(group, "redis").inc()
            elif event.event_id in seen:
                DUPLICATES.labels(group, "db").inc()  # a second copy within this batch
            else:
                seen.add(event.event_id)
                todo.append((k, event, record))
        if not todo:
            return outcomes
        tx = self._open_tx(kind)
        started = time.perf_counter()
        try:
            claimed = await self.store.claim_many(
                tx, [(e.event_id, e.event_type, r) for _k, e, r in todo]
            )
            for k, event, record in todo:
                if event.event_id not in claimed:
                    continue
                ctx: HandlerContext[Any] = HandlerContext(
                    session=tx.session,
                    group_id=group,
                    attempt=1,
                    topic=record.topic,
                    partition=record.partition,
                    offset=record.offset,
                )
                if self.hooks.after_begin is not None:
                    await self.hooks.after_begin(ctx)
                await tx.call(self._handlers[event.event_type].fn, ctx, event)
                outcomes[k] = Outcome.APPLIED
            await tx.commit()
        except Exception as exc:
            _log.info(
                "batch of %d records rolled back, reprocessing one by one: %r", len(todo), exc
            )
            return None
        finally:
            await tx.close()
        elapsed_s = time.perf_counter() - started
        applied = [events[k].event_id for k, _e, _r in todo if outcomes[k] is Outcome.APPLIED]
        for _ in applied:
            HANDLER_DURATION.labels(group).observe(elapsed_s / len(todo))
        PROCESSED.labels(group).inc(len(applied))
        DUPLICATES.labels(group, "db").inc(len(todo) - len(applied))
        if applied:
            await self._stall_if_asked(applied[0])
        if self.hooks.after_commit is not None:
            for record, outcome in zip(records, outcomes, strict=True):
                await self.hooks.after_commit(record, outcome)
        if dedup is not None:
            ttl_s = self.config.dedup_ttl_s
            await self.gate.call(lambda: dedup.mark_done_many(group, ids, ttl_s), None)
        return outcomes

    # -- retention ------------------------------------------------------------------------

    async def purge(self, older_than_s: float | None = None, *, batch_size: int = 1000) -> int:
        """Delete this group's inbox rows older than the dedup window, in short batches (G8).

        Parameters
        ----------
        older_than_s : float | None
            Age limit in seconds; ``None``: ``config.retention_s``. Must not be shorter than
            ``config.retention_s``: a younger row may still catch a redelivery.
        batch_size : int
            Rows per transaction.

        Returns
        -------
        int
            Rows deleted.
        """
        from outbox import ConfigurationError

        age_s = self.config.retention_s if older_than_s is None else older_than_s
        if age_s < self.config.retention_s:
            raise ConfigurationError(
                f"purge older_than_s={age_s:g} is inside the dedup window "
                f"retention_s={self.config.retention_s:g}"
            )
        total = 0
        while True:
            deleted = await self.store.purge_batch(self.async_engine, age_s, batch_size)
            total += deleted
            if deleted < batch_size:
                return total

    # -- the Kafka loop -------------------------------------------------------------------

    def stop(self) -> None:
        """Ask :meth:`run` to finish: in-flight records complete, offsets are committed."""
        self._stop_requested = True
        if self._runner is not None:
            self._runner.stop()

    async def run(self) -> None:
        """Consume until :meth:`stop`. Offsets commit only for finished records.

        Partitions are processed concurrently, each strictly in order; on a rebalance the
        revoked partitions' in-flight records finish and their offsets commit before the
        partitions are given up. Resources this consumer created are released at the end.
        """
        from inbox._runner import KafkaRunner

        runner = KafkaRunner(self)
        self._runner = runner
        if self._stop_requested:
            runner.stop()
        try:
            await runner.run()
        finally:
            self._runner = None
            await self.aclose()


def _identity(record: Record, event: EventEnvelope | None) -> tuple[uuid.UUID | None, str | None]:
    # An unparseable record may still carry a readable CloudEvents id: record its failure.
    if event is not None:
        return event.event_id, event.event_type
    found = dict(record.headers or ())
    try:
        event_id = uuid.UUID(found["ce_id"].decode())
    except (KeyError, ValueError, UnicodeDecodeError):
        return None, None
    event_type = found.get("ce_type")
    return event_id, event_type.decode("utf-8", "replace") if event_type else None
