"""The relay daemon: publish committed outbox events to Kafka, in per-key commit order.

Read design: a transaction-snapshot cursor per leased shard
----------------------------------------------------------
Every outbox row carries ``shard = crc32(partition_key) % shard_count`` and the id of the
transaction that wrote it (``txid``). A relay publishes only the shards it holds a lease on,
one owner per shard at a time (:mod:`ledgerbox.relay._leases`: heartbeat, fair share,
fences, local deadlines, the maintenance leader). Each shard's cursor, kept in its lease
row, is a pair of snapshots and a last id (PgQ's snapshot-diff cursor): a claim returns the
rows whose transaction committed after the cursor's ``lo`` snapshot and up to its ``hi``
(the claim's own snapshot), per shard in id order, never a row of a transaction still in
flight and never skipping one that commits late (C01: it is in a later range). The lanes
(:mod:`ledgerbox.relay._lane`: claim -> publish -> persist pipelines with prefetch and
background persist, dead-lettering and isolation of refused records) keep the cursor of the
next claim in memory and persist it, once per batch and under the fence, after Kafka
confirmed what it passes. Nothing is written per published row.

Lanes: the batches run in up to ``config.lanes`` concurrent pipelines, lane ``i`` claiming
the usable shards with ``shard % lanes == i``; a shard maps to exactly one lane, so rows of
one shard (and key) are handed to the one shared producer (:mod:`ledgerbox.relay._producer`)
by one pipeline, one batch after the other, in id order (G3). The count follows the load
(:mod:`ledgerbox.relay._scaler`) and changes only between batches, after every running
lane's batch is confirmed and persisted (:meth:`Relay._run_lanes`). The leader cleans up
published rows (:mod:`ledgerbox.relay._maintenance`); ``LISTEN`` wakes the lanes
(:mod:`ledgerbox.relay._wakeup`), whose claims are paced (:mod:`ledgerbox.relay._pacing`).
This module wires them: :class:`Relay`.

Why not watermill's cursor (``txid < xmin(now)``): it publishes nothing while any older
transaction holding an id is open, and orders by transaction id, which is not commit order.
The snapshot cursor's failure mode, a cursor ahead of the database after a restore into
another cluster, is guarded: the relay refuses such a shard loudly (sticky, ``relay check``
names it) until ``ledgerbox relay rebase`` re-seats it (docs/relay.md, "Restore and
rebase").

Failures: Kafka errors are classified by class (``relay._policy``). Transient ones leave the
rows to be read again (resent with the same key and event id) and back off exponentially
with jitter (the producer is recreated after repeated failures); permanent ones dead-letter
the row (``status = 2``, ``last_error``). With ``on_dead_letter="hold"`` later events of
that partition key are held (``status = 3``) until an operator replays or discards the dead
one, then they follow it in id order; with ``"skip"`` they are published. A failed persist
after a successful send is retried with backoff; if the process dies meanwhile the rows are
sent again (duplicates carry the same event id, consumers drop them, G4). Database errors
back off and reconnect; the daemon never exits on them.

Known limits: a record already handed to the producer when its lease is lost can still land
after the new owner's copy (bounded by ``request_timeout_ms``); if a send of an earlier event
of a key times out while a later event of the key (in a later producer batch) is confirmed,
the earlier one is sent again after it. Consumers keep per-aggregate order with the version
check (G5). A broker-side permanent reject cannot recall a later event of the same key that
was already in flight in the same batch; "hold" applies to everything not yet sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from ledgerbox._core.backoff import Backoff
from ledgerbox._core.stop import StopSignal
from ledgerbox.relay import _metrics as m
from ledgerbox.relay._config import RelayConfig
from ledgerbox.relay._cursor import CursorBook
from ledgerbox.relay._gate import GateStore, WakeGate, WakeGateDeps
from ledgerbox.relay._health import HealthReport, RelayHealth
from ledgerbox.relay._hooks import RelayHooks
from ledgerbox.relay._lane import Lane, LaneDeps
from ledgerbox.relay._leases import LeaseDeps, Leases
from ledgerbox.relay._maintenance import Maintenance, MaintenanceDeps
from ledgerbox.relay._pgstore import pg_store_factory
from ledgerbox.relay._producer import SharedProducer
from ledgerbox.relay._publisher import KafkaPublisher, Publisher
from ledgerbox.relay._scaler import LaneScaler
from ledgerbox.relay._store import StoreFactory
from ledgerbox.relay._wakeup import WakeUp, WakeUpDeps

__all__ = ["Relay"]

log = logging.getLogger("ledgerbox.relay")


class Relay:
    """Publishes committed outbox events to Kafka (at least once, per-key commit order).

    Parameters
    ----------
    config : RelayConfig
    publisher : Publisher | None
        The broker client; default :class:`~ledgerbox.relay.KafkaPublisher` built from
        ``config``. Tests pass :class:`ledgerbox.relay.testing.InMemoryPublisher`.
    store_factory : Callable[[str], RelayStore] | None
        Builds the store of each role: ``"main"``/``"mark"`` (claims and persists of one
        lane) or ``"main<i>"``/``"mark<i>"`` (lane ``i`` of several), ``"lease"``,
        ``"maint"``, ``"listen"``, ``"gate"`` (the wake gate's lock, used only if the
        store has the gate's methods: :class:`~ledgerbox.relay._gate.GateStore`).
        Default: a PostgreSQL store per role (own connection). Tests pass
        ``InMemoryRelayStore(...).factory(...)`` or a wrapper that injects faults.
    hooks : RelayHooks | None
        Test-only fault-injection hooks (default: none).
    clock : Callable[[], float]
        Monotonic clock in seconds (lease deadlines, lane scaling, cleanup interval).

    Examples
    --------
    >>> relay = Relay(RelayConfig(database_url=url, kafka_bootstrap_servers="127.0.0.1:9092"))
    >>> await relay.run()          # doctest: +SKIP  (until relay.stop())
    """

    def __init__(
        self,
        config: RelayConfig,
        *,
        publisher: Publisher | None = None,
        store_factory: StoreFactory | None = None,
        hooks: RelayHooks | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.relay_id = config.member_id
        stores = store_factory or pg_store_factory(config)
        hooks = hooks or RelayHooks()
        self._stop = StopSignal(config.stop_timeout_s)
        self._clock = clock
        self._health = RelayHealth(config.member_id, clock)
        backoff = Backoff(base_s=0.1, max_s=config.backoff_max_s)
        self._producer = SharedProducer(
            publisher
            or KafkaPublisher(
                config.kafka_settings,
                compression=config.compression,
                linger_ms=config.linger_ms,
                max_batch_bytes=config.producer_batch_bytes,
                request_timeout_ms=config.request_timeout_ms,
                max_request_bytes=config.max_request_bytes,
            ),
            backoff=backoff,
            stop=self._stop,
            hooks=hooks,
            health=self._health,
        )
        self._lease_store = stores("lease")
        self._maint_store = stores("maint")
        self._listen_store = stores("listen")
        self._leases = Leases(
            LeaseDeps(
                config=config,
                store=self._lease_store,
                clock=clock,
                stop=self._stop,
                busy_shards=self._busy_shards,
                on_acquired=self._wake_all,
                can_publish=self._producer.can_publish,
                kafka_down_for_s=self._producer.down_for_s,
                health=self._health,
            )
        )
        self._maintenance = Maintenance(
            MaintenanceDeps(
                config=config,
                store=self._maint_store,
                is_leader=self._leases.is_leader,
                owned_shards=self._leases.usable,
                clock=clock,
                stop=self._stop,
            )
        )
        gate_store = stores("gate")
        self._gate = WakeGate(
            WakeGateDeps(
                store=gate_store if isinstance(gate_store, GateStore) else None,
                rate=self._rate,
                wake_all=self._wake_all,
                poll_interval_s=config.poll_interval_s,
                backoff=backoff,
                stop=self._stop,
                clock=clock,
                listening=lambda: self._wakeup.listening,
            )
        )
        self._idle = asyncio.Event()
        self._wakeup = WakeUp(
            WakeUpDeps(
                store=self._listen_store,
                wake_all=self._wake_all,
                backoff=backoff,
                stop=self._stop,
                idle=self._idle,
                clock=clock,
                on_notification=self._gate.on_notification,
                on_lost=self._gate.on_listen_lost,
            )
        )
        # Adaptive lanes (run()): ``_active`` lanes run, shards split by ``shard % _active``.
        self._scaler = LaneScaler(config.lanes, config.batch_size)
        self._active = 1
        self._wanted = 1
        self._regroup = asyncio.Event()
        lane_deps = LaneDeps(
            config=config,
            leases=self._leases,
            producer=self._producer,
            backoff=backoff,
            stop=self._stop,
            regroup=self._regroup,
            hooks=hooks,
            on_claimed=self._observe_claim,
            health=self._health,
            on_idle=self._idle.set,
            cursors=CursorBook(),
            clock=clock,
            idle_wait_s=self._gate.idle_wait_s,
        )
        one = config.lanes == 1
        self._lanes = [
            Lane(
                i,
                stores("main" if one else f"main{i}"),
                stores("mark" if one else f"mark{i}"),
                lane_deps,
            )
            for i in range(config.lanes)
        ]

    # -- public API ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until :meth:`stop` is called; then release the batch in flight, flush the
        producer, release the leases and the member row. Never raises on database or Kafka
        errors (it backs off and retries). From :meth:`stop` on, waiting for Kafka
        (confirmations, flush) takes at most ``config.stop_timeout_s`` seconds: what Kafka
        has not confirmed by then is not persisted and is sent again by the next run
        (docs/operations.md, "Stopping a daemon")."""
        tasks = [
            asyncio.create_task(self._leases.run(), name="relay-heartbeat"),
            asyncio.create_task(self._wakeup.run(), name="relay-listen"),
            asyncio.create_task(self._gate.run(), name="relay-gate"),
            asyncio.create_task(self._maintenance.run(), name="relay-maintenance"),
        ]
        try:
            await self._run_lanes()
        except asyncio.CancelledError:
            # Cancelled (not stopped): abandon a persist still retrying; its rows are sent
            # again later with the same event ids.
            for lane in self._lanes:
                lane.cancel()
            raise
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self.aclose()

    async def run_once(self) -> int:
        """One cycle: heartbeat (membership and leases), then one claim/publish/persist per
        lane (the lanes one after the other, all ``config.lanes`` of them).

        Returns
        -------
        int
            Number of events confirmed by Kafka whose cursors were persisted in this cycle
            (all lanes).

        Raises
        ------
        StoreError
            A database call failed (``run`` retries instead).
        """
        # The producer first: a relay acquires shards only while it can publish.
        if not await self._producer.ensure():
            await self._leases.heartbeat_once()
            return 0
        await self._leases.heartbeat_once()
        total = 0
        self._active = len(self._lanes)
        for lane in self._lanes:
            _, published = await lane.publish_batch(self._active)
            total += published
        return total

    def stop(self) -> None:
        """Ask :meth:`run` to finish (safe to call from a signal handler in the loop)."""
        self._stop.set()
        self._wake_all()

    async def aclose(self) -> None:
        """Release leases and the member row, flush and stop the producer, disconnect."""
        self._stop.set()  # a persist still retrying gives up after its third attempt
        for lane in self._lanes:
            with contextlib.suppress(asyncio.CancelledError):
                await lane.finish()
        await self._leases.release_all()
        await self._producer.stop()
        await self._gate.aclose()
        stores = [self._lease_store, self._maint_store, self._listen_store]
        for lane in self._lanes:
            stores += lane.stores
        for store in stores:
            await store.aclose()

    async def __aenter__(self) -> Relay:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def owned_shards(self) -> list[int]:
        """Data shards this relay may publish now (for tests and status)."""
        return self._leases.usable()

    @property
    def active_lanes(self) -> int:
        """Pipelines running now in :meth:`run`: ``config.lanes`` while claims come back full
        (a backlog), 1 once the relay keeps up (lowest latency and database load)."""
        return self._active

    def is_leader(self) -> bool:
        """True while this relay holds the maintenance-leader lease."""
        return self._leases.is_leader()

    def health(self) -> HealthReport:
        """``ok``, or ``down`` with the cause (Kafka or the database does not answer, the
        tables are missing, a grant is revoked...). Also the gauge ``ledgerbox_relay_up``;
        each change of state is logged once."""
        return self._health.report()

    async def cleanup_once(self) -> int:
        """Delete published rows older than ``retention_s`` in bounded batches (leader only;
        returns 0 when this relay is not the leader), after recording a cleanup tick when
        one is due. Returns the number deleted.

        Raises
        ------
        StoreError
            A ``DELETE`` failed.
        """
        return await self._maintenance.cleanup_once()

    # -- wiring ----------------------------------------------------------------------------

    def _rate(self) -> float:
        # The running lanes' event rates (their claims' moving averages), summed.
        return sum(lane.rate for lane in self._lanes[: self._active])

    def _wake_all(self) -> None:
        for lane in self._lanes:
            lane.wake.set()

    def _busy_shards(self) -> set[int]:
        busy: set[int] = set()
        for lane in self._lanes:
            busy |= lane.busy_shards()
        return busy

    def _observe_claim(self, claimed: int) -> None:
        wanted = self._scaler.lanes_for(claimed, running=self._active, now=self._clock())
        if wanted != self._active and not self._regroup.is_set():
            self._wanted = wanted
            self._regroup.set()
            self._wake_all()

    async def _run_lanes(self) -> None:
        """Run the active lanes until stopped. When the load asks for another lane count, the
        lanes finish their batch (confirmed, persisted, prefetch dropped) and stop, then the new
        count starts: a shard moves to another lane only between batches, never with a batch
        in flight (G3). The first unexpected error stops the other lanes and is raised."""
        while not self._stop.is_set():
            self._active = self._wanted
            m.ACTIVE_LANES.set(self._active)
            self._regroup.clear()
            tasks = [
                asyncio.create_task(lane.run(self._active), name=f"relay-lane-{lane.index}")
                for lane in self._lanes[: self._active]
            ]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            failed = [
                t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None
            ]
            if failed:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise failed[0].exception()  # type: ignore[misc]
            if self._wanted < self._active:
                # Caught up: the lanes that stop release their database connections.
                kept = {id(s) for lane in self._lanes[: self._wanted] for s in lane.stores}
                for lane in self._lanes[self._wanted : self._active]:
                    for store in lane.stores:
                        if id(store) not in kept:  # (a factory may share one store)
                            await store.aclose()
            if self._wanted != self._active and not self._stop.is_set():
                log.info(
                    "lanes %d -> %d (%s)",
                    self._active,
                    self._wanted,
                    "backlog" if self._wanted > self._active else "caught up",
                )
