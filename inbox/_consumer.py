"""The inbox consumer: Kafka records in, one committed effect per (group, event id) out.

This module holds the public :class:`InboxConsumer` (registration, resources, retention, the
Kafka loop). The steps for one record are in :mod:`inbox._message`, several records of a
partition in one transaction in :mod:`inbox._batch`, poison records in
:mod:`inbox._deadletterer`, the Kafka side (partition workers, offsets) in :mod:`inbox._runner`.
The consumer builds what the steps use once, as a :class:`inbox._deps.PipelineDeps`; no step
sees the consumer itself.

Offsets are committed only for records that finished (applied, duplicate, ignored) or were
dead-lettered. Partitions run concurrently (one task each), records of one partition strictly
in order.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Literal

from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from ledgerbox.inbox._batch import BatchPipeline
from ledgerbox.inbox._config import ConsumerConfig
from ledgerbox.inbox._deadletter import DeadLetterPublisher, KafkaDeadLetterPublisher
from ledgerbox.inbox._deadletterer import DeadLetterer
from ledgerbox.inbox._deps import PipelineDeps
from ledgerbox.inbox._gate import RedisGate
from ledgerbox.inbox._handlers import ConsumerHooks, Handler, Registered
from ledgerbox.inbox._message import MessagePipeline
from ledgerbox.inbox._metrics import GroupMetrics
from ledgerbox.inbox._policy import Outcome
from ledgerbox.inbox._record import Record, never
from ledgerbox.inbox._redis import (
    AggregateLock,
    DedupStore,
    RedisAggregateLock,
    RedisDedupStore,
    redis_client,
)
from ledgerbox.inbox._runner import KafkaRunner
from ledgerbox.inbox._store import InboxStore
from ledgerbox.inbox._table import InboxTable
from ledgerbox.inbox._tx import AsyncTx, SyncTx, Tx

__all__ = ["ConsumerHooks", "Handler", "InboxConsumer", "Record"]

Health = Literal["ok", "degraded"]


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

    The collaborators (``store``, ``dedup``, ``lock``, ``dead_letters``, ``gate``, ``hooks``)
    are fixed when the consumer is built: its steps receive them once.

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
        self._handlers: dict[str, Registered] = {}
        self._stop_requested = False
        self._runner: KafkaRunner | None = None
        self._deps = PipelineDeps(
            config=config,
            group_id=config.group_id,
            store=self.store,
            handlers=types.MappingProxyType(self._handlers),
            dedup=dedup,
            lock=lock,
            gate=self.gate,
            dead_letters=self.dead_letters,
            metrics=GroupMetrics(config.group_id),
            hooks=self.hooks,
            open_tx=self._open_tx,
        )
        self._messages = MessagePipeline(self._deps, DeadLetterer(self._deps))
        self._batches = BatchPipeline(self._deps, self._messages)

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
        self._handlers[event_type] = Registered(fn, inspect.iscoroutinefunction(fn))

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

    def _open_tx(self, is_async: bool) -> Tx:
        # A new session per transaction: it only borrows a pooled connection.
        return AsyncTx(self.async_engine) if is_async else SyncTx(self.engine)

    async def aclose(self) -> None:
        """Release engines, producer and Redis connections this consumer created."""
        await self.dead_letters.aclose()
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

    # -- records ------------------------------------------------------------------------

    async def process_record(
        self, record: Record, *, abandon: Callable[[], bool] | None = None
    ) -> Outcome:
        """Run the whole pipeline for one record, except the Kafka offset commit.

        Parse, Redis hint, optional lock, then ONE transaction holding the inbox row and the
        handler's writes; "done" in Redis only after the commit (docs/guarantees.md, G4 and G6).
        Transient errors are retried with backoff, permanent ones and exhausted retries are
        dead-lettered.

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
        return await self._messages.process(record, abandon or never)

    async def process_batch(
        self, records: Sequence[Record], *, abandon: Callable[[], bool] | None = None
    ) -> list[Outcome]:
        """Run the pipeline for consecutive records of ONE partition, in order.

        Runs of up to ``batch_max_records`` parseable records whose handlers are of one kind
        (async or sync) are applied in one transaction: one inbox insert for all of them, the
        handlers of the newly inserted events in offset order, one commit. Any error rolls
        the whole run back and its records go through :meth:`process_record` one by one
        (retries, dead-lettering). Guarantees are those of :meth:`process_record`.

        Returns
        -------
        list[Outcome]
            One outcome per record, in order; it stops after the first ``ABANDONED``.
        """
        return await self._batches.process(records, abandon or never)

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
        from ledgerbox._core.errors import ConfigurationError

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
        runner = KafkaRunner(self._deps, self.process_batch)
        self._runner = runner
        if self._stop_requested:
            runner.stop()
        try:
            await runner.run()
        finally:
            self._runner = None
            await self.aclose()
