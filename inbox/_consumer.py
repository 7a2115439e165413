"""The inbox consumer: Kafka records in, one committed effect per (group, event id) out.

This module holds the public :class:`InboxConsumer` (registration, resources, retention, the
Kafka loop). The steps for one record are in :mod:`inbox._message`, several records (of one
partition, or of several lent to one batch) in one transaction in :mod:`inbox._batch`,
poison records in :mod:`inbox._deadletterer`, the Kafka side (partition workers, offsets) in
:mod:`inbox._runner`. The consumer builds what the steps use once, as a
:class:`inbox._deps.PipelineDeps`; no step sees the consumer itself.

Offsets are committed only for records that finished (applied, duplicate, ignored) or were
dead-lettered. Partitions run concurrently (one task each), records of one partition strictly
in order. A fault of the environment stops a partition without blaming its record (health
``down``, :mod:`inbox._health`); :meth:`InboxConsumer.run` waits for the startup checks
(:mod:`inbox._checks`) before it consumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
import time
import types
import uuid
from collections.abc import Callable, Sequence

import sqlalchemy as sa
from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from ledgerbox._core.database_url import connect_args, database_label, sqlalchemy_url
from ledgerbox._core.durations import check_duration
from ledgerbox._core.errors import ConfigurationError, DatabaseError
from ledgerbox._core.event_loop import loop_name
from ledgerbox._core.faults import PermanentVerdict
from ledgerbox._core.redis_url import redis_label
from ledgerbox._core.stop import StopSignal
from ledgerbox.inbox._batch import BatchPipeline
from ledgerbox.inbox._checks import CheckResult, check_consumer
from ledgerbox.inbox._config import ConsumerConfig
from ledgerbox.inbox._deadletter import DeadLetterPublisher, KafkaDeadLetterPublisher
from ledgerbox.inbox._deadletterer import DeadLetterer
from ledgerbox.inbox._deps import PipelineDeps
from ledgerbox.inbox._errors import StartupError
from ledgerbox.inbox._gate import RedisGate
from ledgerbox.inbox._handlers import ConsumerHooks, Handler, Registered
from ledgerbox.inbox._health import ConsumerHealth, Health
from ledgerbox.inbox._hints import DoneHintWriter, HintPolicy
from ledgerbox.inbox._message import MessagePipeline
from ledgerbox.inbox._metrics import GroupMetrics
from ledgerbox.inbox._offsets import redelivery_bounds
from ledgerbox.inbox._policy import Outcome
from ledgerbox.inbox._record import Abandon, Record, never, sleep_unless_abandoned
from ledgerbox.inbox._redis import (
    AggregateLock,
    DedupStore,
    RedisAggregateLock,
    RedisDedupStore,
    redis_client,
)
from ledgerbox.inbox._runner import CLIENT_STOP_MIN_S, KafkaRunner
from ledgerbox.inbox._store import InboxStore
from ledgerbox.inbox._table import InboxTable
from ledgerbox.inbox._tx import AsyncTx, SyncTx, Tx, discard_on_environment_faults

__all__ = ["ConsumerHooks", "Handler", "InboxConsumer", "Record"]

_log = logging.getLogger("ledgerbox.inbox")

#: Longest wait between two startup checks while one fails, in seconds.
STARTUP_RETRY_MAX_S = 5.0


#: The identity of an inbox (InboxConsumer._bind_hints): the cluster's system identifier,
#: its current timeline (a promoted standby, a point-in-time restore: a new one), the
#: database's OID, the inbox table's OID (``:inbox``, resolved as the consumer's own
#: statements resolve it). Every role may call these functions.
INBOX_IDENTITY = sa.text(
    "SELECT s.system_identifier::text AS sysid,"
    " substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) AS timeline,"
    " d.oid::text AS db, to_regclass(:inbox)::oid::text AS inbox"
    " FROM pg_control_system() AS s, pg_database AS d WHERE d.datname = current_database()"
)


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
        Default: Kafka with ``config.kafka_settings`` (the consumer's cluster and login).
    engine, async_engine : Engine | None, AsyncEngine | None
        Database engines; default: built from ``config.database_url``. The consumer's own
        engines discard a connection whose statement failed for a fault of the environment
        (``inbox._tx.discard_on_environment_faults``); call that on engines you pass in for
        the same recovery after a read-only spell.
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
            client = redis_client(
                config.redis_url, timeout_s=config.redis_timeout_s, ca_file=config.redis_ssl_cafile
            )
        self._redis_client = client
        if dedup is None and client is not None:
            # Scoped to this inbox at the start of run (_bind_hints): before, no hint.
            dedup = RedisDedupStore(client, config.redis_key_prefix, scoped=True)
        if lock is None and client is not None and config.lock_aggregates:
            lock = RedisAggregateLock(client, config.redis_key_prefix)
        self.dedup = dedup
        self.lock = lock
        self.dead_letters = dead_letters or KafkaDeadLetterPublisher(config.kafka_settings)
        self.gate = RedisGate(config.group_id, config.redis_probe_interval_s)
        self._health = ConsumerHealth(config.group_id, self.gate)
        self.hooks = hooks or ConsumerHooks()
        self._engine = engine
        self._async_engine = async_engine
        self._owns_engines = (engine is None, async_engine is None)
        self._handlers: dict[str, Registered] = {}
        self._stop_requested = False
        self._runner: KafkaRunner | None = None
        # The last run's grace for what waits on Kafka at its stop (None: never ran).
        self._kafka_grace: StopSignal | None = None
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
            health=self._health,
            hooks=self.hooks,
            open_tx=self._open_tx,
            hint_policy=HintPolicy(),
            hints=(
                None
                if dedup is None
                else DoneHintWriter(dedup, self.gate, config.group_id, config.dedup_ttl_s)
            ),
        )
        self._messages = MessagePipeline(self._deps, DeadLetterer(self._deps))
        self._batches = BatchPipeline(self._deps, self._messages)

    # -- registration -------------------------------------------------------------------

    def handler(self, event_type: str) -> Callable[[Handler], Handler]:
        """Decorator registering ``fn(ctx, event)`` for ``event_type``.

        Async functions get an ``AsyncSession``; plain functions get a sync ``Session`` and
        run in a worker thread. Events without a handler: ``config.on_unhandled``.
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
            self._async_engine = create_async_engine(
                sqlalchemy_url(self.config.database_url),
                connect_args=connect_args(self.config.database_url),
            )
            discard_on_environment_faults(self._async_engine.sync_engine)
        return self._async_engine

    @property
    def engine(self) -> Engine:
        """The sync engine for sync handlers (built on first use)."""
        if self._engine is None:
            self._engine = create_engine(
                sqlalchemy_url(self.config.database_url),
                connect_args=connect_args(self.config.database_url),
            )
            discard_on_environment_faults(self._engine)
        return self._engine

    def _open_tx(self, is_async: bool) -> Tx:
        # A new session per transaction: it only borrows a pooled connection.
        return AsyncTx(self.async_engine) if is_async else SyncTx(self.engine)

    async def aclose(self) -> None:
        """Release engines, producer and Redis connections this consumer created (after
        the "done" hints still waiting were sent, for at most 2 s).

        The dead-letter producer's close flushes what it still holds, which waits on Kafka:
        after a run, at most what is left of that stop's ``stop_timeout_s`` (and
        :data:`~ledgerbox.inbox._runner.CLIENT_STOP_MIN_S`, 1 s, at least), else at most
        ``stop_timeout_s``; past that it is left unclosed with one WARNING (the process is
        exiting; a record it did not deliver was not acknowledged either)."""
        if self._deps.hints is not None:
            await self._deps.hints.flush()
        await self._close_dead_letters()
        if self._redis_client is not None:
            with contextlib.suppress(Exception):
                await self._redis_client.aclose()
        if self._owns_engines[1] and self._async_engine is not None:
            await self._async_engine.dispose()
            self._async_engine = None
        if self._owns_engines[0] and self._engine is not None:
            self._engine.dispose()
            self._engine = None

    async def _close_dead_letters(self) -> None:
        grace, bound_s = self._kafka_grace, self.config.stop_timeout_s
        if grace is not None:
            bound_s = max(min(grace.left_s(), bound_s), CLIENT_STOP_MIN_S)
        try:
            await asyncio.wait_for(self.dead_letters.aclose(), bound_s)
        except TimeoutError:
            _log.warning(
                "dead-letter producer not closed within stop_timeout_s (Kafka does not "
                "answer): left unclosed"
            )

    def health(self) -> Health:
        """``"down"`` while a fault of the environment stops progress (a partition, the
        startup checks or the Kafka connection; :attr:`health_cause` says why), else
        ``"degraded"`` while Redis is unreachable (the DB path carries on), else ``"ok"``.

        Exported as the gauge ``ledgerbox_inbox_health{group}`` (0 / 1 / 2); each change is
        logged once.
        """
        return self._health.state

    @property
    def health_cause(self) -> str | None:
        """One line naming why :meth:`health` is ``"down"`` and how to fix it (the oldest
        fault still in force), or ``None`` when it is not down."""
        return self._health.cause

    # -- records ------------------------------------------------------------------------

    async def process_record(
        self, record: Record, *, abandon: Callable[[], bool] | None = None
    ) -> Outcome:
        """Run the whole pipeline for one record, except the Kafka offset commit.

        Parse, Redis hint, optional lock, then ONE transaction holding the inbox row and the
        handler's writes; "done" in Redis only after the commit (docs/guarantees.md, G4 and G6).
        Faults of the environment are retried without bound (health ``down`` meanwhile),
        transient and undeclared errors up to ``max_attempts``; permanent ones and exhausted
        retries are dead-lettered (docs/inbox.md, "Errors and retries").

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
            ``APPLIED``, ``DUPLICATE``, ``DEAD_LETTERED``, ``ALREADY_DEAD_LETTERED`` (a
            redelivery or copy of a dead-lettered event: final), ``IGNORED`` or
            ``ABANDONED``.
        """
        await self._hints_bound()
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

        For callers that drive their own Kafka loop (and tests). :meth:`run` does not call
        it: its partition workers call the same pipeline with batches that may span
        partitions (``batch_across_partitions``), so overriding this method does not change
        what :meth:`run` does (the handlers are the extension point).

        Returns
        -------
        list[Outcome]
            One outcome per record, in order; it stops after the first ``ABANDONED``.
        """
        await self._hints_bound()
        return await self._batches.process(records, abandon or never)

    # -- retention ------------------------------------------------------------------------

    async def purge(self, older_than_s: float | None = None, *, batch_size: int = 1000) -> int:
        """Delete this group's inbox rows that can no longer catch a redelivery, in short
        batches (G8, C18).

        A row goes only when (a) it was first seen more than ``older_than_s`` ago and (b) its
        record is below the group's committed offset of its partition, read from Kafka now
        (with ``auto_offset_reset="earliest"`` also below the partition's log-start offset:
        a group whose offsets were lost rereads the whole log). A partition without a
        committed offset, a row of a topic this consumer no longer reads and a row without
        an offset are kept (docs/inbox.md, "Retention").

        Parameters
        ----------
        older_than_s : float | None
            Age limit in seconds; ``None``: ``config.retention_s``. Must not be shorter than
            ``config.retention_s``: a younger row may still catch a copy of its event.
        batch_size : int
            Rows per transaction.

        Returns
        -------
        int
            Rows deleted.

        Raises
        ------
        ledgerbox.ConfigurationError
            If ``older_than_s`` is inside the dedup window, or not a finite number of seconds
            of at most 10 years (``setting="older_than_s"``).
        ledgerbox.BrokerError
            If Kafka cannot say the committed offsets (nothing is deleted).
        ledgerbox.DatabaseError
            If a delete failed (the batches before it stay deleted).
        """
        age_s = self.config.retention_s if older_than_s is None else older_than_s
        check_duration(age_s, "older_than_s")  # inf, nan, 1e300: no interval PostgreSQL holds
        if age_s < self.config.retention_s:
            raise ConfigurationError(
                f"purge older_than_s={age_s:g} is inside the dedup window "
                f"retention_s={self.config.retention_s:g}: give at least that"
            )
        bounds = await redelivery_bounds(self.config)
        total = 0
        while True:
            deleted = await self.store.purge_batch(self.async_engine, age_s, bounds, batch_size)
            total += deleted
            if deleted < batch_size:
                return total

    async def request_replay(self, event_ids: Sequence[uuid.UUID]) -> int:
        """Ask for dead-lettered events to run again: their DEAD_LETTERED inbox rows become
        REPLAY_REQUESTED, and the next delivery of each runs its handler (the operator's
        replay hook; docs/inbox.md, "A dead-lettered event is final").

        This does not deliver anything: the replay command re-publishes the records (or
        moves the group's offset back). Returns how many rows were marked (rows in any
        other state are left alone).

        Raises
        ------
        ledgerbox.DatabaseError
            If the update failed (nothing was marked).
        """
        return await self.store.request_replay(self.async_engine, list(event_ids))

    # -- the Kafka loop -------------------------------------------------------------------

    def stop(self) -> None:
        """Ask :meth:`run` to finish: in-flight records complete, offsets are committed and
        the group is left; those Kafka steps get ``config.stop_timeout_s`` (seconds) in all,
        after which offsets not committed are simply delivered again after a restart
        (docs/operations.md, "Stopping a daemon")."""
        self._stop_requested = True
        if self._runner is not None:
            self._runner.stop()

    async def run(self) -> None:
        """Consume until :meth:`stop`. Offsets commit only for finished records.

        First the startup checks (:func:`inbox._checks.check_consumer`): while one fails for
        a reason that may pass (database or Kafka unreachable, inbox table missing, no
        privilege, read-only), health is ``down`` with the cause and the check is retried
        with backoff (at most :data:`STARTUP_RETRY_MAX_S` apart), one log line per change.
        Partitions are then processed concurrently, each strictly in order; on a rebalance
        the revoked partitions' in-flight records finish and their offsets commit before
        the partitions are given up. Resources this consumer created are released at the
        end.

        Raises
        ------
        StartupError
            When the database or Kafka refused the credentials (waiting cannot fix it).
        """
        self._kafka_grace = None  # not the grace an earlier run spent
        started = False
        try:
            await self._until_ready()
            if self._stop_requested:
                return
            runner = KafkaRunner(self._deps, self._batches.process)
            self._runner, self._kafka_grace = runner, runner.kafka_grace
            _log.info("%s", self._start_line())
            started = True
            if self._stop_requested:
                runner.stop()
            await runner.run()
        finally:
            self._runner = None
            await self.aclose()
        if started:
            _log.info("consumer group %s stopped", self.config.group_id)

    def _start_line(self) -> str:
        """The one INFO line a consumer starts with (after its startup checks passed): what
        it consumes and where it writes, without a secret, so whoever is on call sees in the
        log which database, cluster and Redis this process uses."""
        config = self.config
        if config.redis_url is None:
            redis = "none (the inbox table alone de-duplicates)"
        else:
            locks = "aggregate locks on" if config.lock_aggregates else "aggregate locks off"
            redis = f"{redis_label(config.redis_url)} (hints, {locks})"
        return (
            f"consumer group {config.group_id} starting: topics {', '.join(config.topics)}, "
            f"database {database_label(config.database_url)}, "
            f"kafka {config.kafka_settings.describe()}, redis {redis}, event loop {loop_name()}"
        )

    async def _bind_hints(self) -> str | None:
        """Scope the Redis hint keys this consumer built to its inbox (RedisDedupStore):
        the system identifier of the PostgreSQL cluster, its timeline, the OIDs of the
        database and of the inbox table, as a short digest (INBOX_IDENTITY). Another
        deployment sharing Redis and the group name, a database restored into a new cluster
        or to a point in time, a promoted standby (at the consumer's next start), an inbox
        table dropped and created again: each gets other keys, so no "done" hint of another
        inbox is believed. A physical copy started on its own keeps all of it: it needs its
        own ``redis_key_prefix`` (docs/inbox.md, "Whose hints they are"). Returns the
        cause, one line, when the database did not answer the query or refused it; None
        when bound (or nothing to bind)."""
        dedup = self.dedup
        if not isinstance(dedup, RedisDedupStore) or not dedup.scoped:
            return None
        try:
            async with self.async_engine.connect() as conn:
                row = (
                    await conn.execute(INBOX_IDENTITY, {"inbox": self.table.qualified_name})
                ).one()
        except Exception as exc:
            error = DatabaseError.translate(exc, "connect")
            if error is None:
                raise
            return f"the inbox's identity could not be read (Redis hints): {error}"
        if row.inbox is None:
            name = self.table.qualified_name
            return f"inbox table {name!r} does not exist: run ledgerbox migrate"
        identity = f"{row.sysid}:{row.timeline}:{row.db}:{row.inbox}"
        dedup.bind(hashlib.blake2b(identity.encode(), digest_size=8).hexdigest())
        return None

    async def _hints_bound(self) -> None:
        # Callers driving their own loop (process_record / process_batch without run): bind
        # the hints on first use; while the database does not answer they stay off.
        dedup = self.dedup
        if isinstance(dedup, RedisDedupStore) and dedup.scoped and dedup.scope is None:
            await self._bind_hints()

    async def _until_ready(self) -> None:
        retry = 0
        confirm = PermanentVerdict()  # a restarting server looks like a refused login once
        try:
            while not self._stop_requested:
                result = await check_consumer(self.config, check_redis=False)
                if result.state != "down" and (cause := await self._bind_hints()) is not None:
                    result = CheckResult("down", cause)
                if result.state != "down":
                    self._health.clear("startup")
                    return
                if result.permanent:
                    if not result.recheck or confirm.holds(True, time.monotonic()):
                        raise StartupError(result.cause)
                    delay_s = confirm.window_s  # one more look, quietly: the exit says it
                else:
                    confirm.holds(False, time.monotonic())
                    self._health.fault("startup", result.cause or "startup check failed")
                    retry += 1
                    delay_s = min(self.config.backoff.ceiling_s(retry), STARTUP_RETRY_MAX_S)
                await sleep_unless_abandoned(delay_s, lambda: self._stop_requested)
        except Abandon:
            pass
        self._health.clear("startup", resolved=False)  # stopped while waiting
