"""This relay's membership and shard leases: heartbeat, acquire, renew, drain, release.

Every outbox row carries ``shard = crc32(partition_key) % shard_count`` (written by the
producer, see ``outbox.shard_of``). A relay publishes only shards it holds a lease on
(``<outbox>_relay_lease``: shard, owner, fence, expires_at); one owner per shard at a time
means events of one key are sent by one relay, one batch after the other, in id order (G3).

Heartbeat (every ``heartbeat_interval_s``, its own connection; times are the DATABASE's
``now()``, never a relay's clock):

1. upsert the member row (``<outbox>_relay_member``), count live members; fair share =
   ``ceil(shard_count / live)``;
2. renew own leases under their fences; a shard not renewed is LOST and no longer published;
3. below the fair share: acquire free or expired shards (``fence + 1``; ``FOR UPDATE SKIP
   LOCKED`` in a subselect so two relays never take the same one);
4. above it: drain the extras (not claimed any more) and release them once no batch in
   flight holds them.

Each lease also has a local monotonic deadline (send time of the last successful renewal +
ttl - margin, kept by the pure :class:`~ledgerbox.relay._policy.LeaseBook`): when it passes
without renewal (database unreachable) the shard is no longer published, so a relay cut off
from the database never competes with the relay that took its shard over. Lease row ``-1``
elects the maintenance leader (cleanup of published rows, pending gauges).

A relay holds no shard while it cannot publish (docs/relay.md, "Health"): it is not a member
(no member row, so it lowers nobody's fair share) and acquires nothing until its producer runs
and Kafka answers; when Kafka has been unreachable for longer than ``lease_ttl_s`` it drains
every data shard (released as soon as no batch of it is in flight), so a healthy relay takes
them over. A wrong Kafka address therefore strands no event.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ledgerbox._core.stop import StopSignal
from ledgerbox.relay import _metrics as m
from ledgerbox.relay._config import RelayConfig
from ledgerbox.relay._errors import StoreError
from ledgerbox.relay._health import RelayHealth
from ledgerbox.relay._policy import LEADER_SHARD, LeaseBook, fair_share
from ledgerbox.relay._store import RelayStore

__all__ = ["LeaseDeps", "Leases"]

log = logging.getLogger("ledgerbox.relay")


@dataclass(frozen=True, slots=True)
class LeaseDeps:
    """What :class:`Leases` uses.

    Attributes
    ----------
    config : RelayConfig
        ``shard_count``, ``lease_ttl_s``, ``heartbeat_interval_s``.
    store : RelayStore
        The lease connection (role ``"lease"``).
    clock : Callable[[], float]
        Monotonic clock in seconds (local lease deadlines).
    stop : StopSignal
    busy_shards : Callable[[], set[int]]
        Shards with a batch in flight or being marked (a drained shard waits for them).
    on_acquired : Callable[[], None]
        Called when new shards were acquired (the lanes claim at once).
    can_publish : Callable[[], bool]
        True while the producer runs and Kafka answers; only then are shards acquired.
    kafka_down_for_s : Callable[[], float]
        Seconds Kafka has not answered (0 while it does); above ``lease_ttl_s`` every data
        shard is drained and released.
    health : RelayHealth
        Told when the lease statements fail and work again (part ``"leases"``).
    """

    config: RelayConfig
    store: RelayStore
    clock: Callable[[], float]
    stop: StopSignal
    busy_shards: Callable[[], set[int]]
    on_acquired: Callable[[], None]
    can_publish: Callable[[], bool]
    kafka_down_for_s: Callable[[], float]
    health: RelayHealth


class Leases:
    """The shard and leader leases this relay holds, kept in step with the lease table.

    Parameters
    ----------
    deps : LeaseDeps
    """

    def __init__(self, deps: LeaseDeps) -> None:
        self._deps = deps
        cfg = deps.config
        margin_s = min(cfg.lease_ttl_s / 2, max(cfg.heartbeat_interval_s, cfg.lease_ttl_s * 0.2))
        self._book = LeaseBook(cfg.lease_ttl_s, margin_s)
        self._rows_ready = False
        self._member = False

    # -- what the lanes and the leader read ------------------------------------------------

    def usable(self) -> list[int]:
        """Data shards this relay may publish now: held, not draining, deadline not passed."""
        return self._book.usable(self._deps.clock())

    def fence(self, shard: int) -> int:
        """The fence ``shard`` is held under (``KeyError`` if it is not held)."""
        return self._book.fence(shard)

    def is_leader(self) -> bool:
        """True while this relay holds the maintenance-leader lease (deadline not passed)."""
        return self._book.is_leader(self._deps.clock())

    # -- heartbeat -------------------------------------------------------------------------

    async def heartbeat_once(self) -> None:
        """Steps 1-4 of the module docstring, then release drained shards no batch holds.

        Raises
        ------
        StoreError
            A lease statement failed (the shards not renewed expire locally).
        """
        deps = self._deps
        cfg, store, clock, book = deps.config, deps.store, deps.clock, self._book
        ttl = cfg.lease_ttl_s
        if not self._rows_ready:
            await store.ensure_leases(cfg.shard_count)
            self._rows_ready = True
        publishing = deps.can_publish()
        if publishing:
            live = await store.heartbeat(ttl)
            self._member = True
        elif self._member:
            # Not a member while it cannot publish: the others' fair share grows to cover it.
            await store.leave()
            self._member = False
        sent_at = clock()
        renewed = await store.renew_shards(book.held(), ttl)
        lost = book.renewed(renewed, sent_at)
        if lost:
            m.LEASE_CHANGES.labels(change="lost").inc(len(lost))
            log.warning("lost shard leases %s", lost, extra={"shards": lost})
        if publishing:
            want, drain = book.plan(fair_share(cfg.shard_count, live))
            if drain:
                log.info("draining shards %s (fair share, %d live relays)", drain, live)
        else:
            want, drain = 0, []
            if deps.kafka_down_for_s() > ttl:
                drain = book.plan(0)[1]
                if drain:
                    log.warning(
                        "Kafka unreachable for %.0f s (over lease_ttl_s): releasing shards %s "
                        "to relays that can publish",
                        deps.kafka_down_for_s(),
                        drain,
                        extra={"shards": drain},
                    )
        if want:
            sent_at = clock()
            grants = await store.acquire_shards(want, ttl, lo=0, hi=cfg.shard_count - 1)
            new = book.granted(grants, sent_at)
            if new:
                m.LEASE_CHANGES.labels(change="acquired").inc(len(new))
                log.info("acquired shards %s", new, extra={"shards": new})
                self._deps.on_acquired()
        if not book.is_leader(clock()):
            sent_at = clock()
            grants = await store.acquire_shards(1, ttl, lo=LEADER_SHARD, hi=LEADER_SHARD)
            if grants:
                book.granted(grants, sent_at)
                m.LEASE_CHANGES.labels(change="leader").inc()
                log.info("became maintenance leader")
        await self.release_drained()
        m.OWNED_SHARDS.set(len(book.data_shards()))

    async def run(self) -> None:
        """Heartbeat every ``heartbeat_interval_s`` until stopped; never raises on database
        errors (logged, counted as ``retries_total{stage="heartbeat"}``)."""
        attempt = 0
        stop, health = self._deps.stop, self._deps.health
        while not stop.is_set():
            try:
                await self.heartbeat_once()
                attempt = 0
                health.up("leases")
            except StoreError as exc:
                attempt += 1
                m.RETRIES.labels(stage="heartbeat").inc()
                health.down("leases", str(exc))
                log.debug("heartbeat failed: %s", exc, extra={"attempt": attempt})
            await stop.sleep(self._deps.config.heartbeat_interval_s)

    async def release_drained(self) -> None:
        """Release the drained shards that no batch has in flight or being marked.

        Raises
        ------
        StoreError
            The release failed (the shards are forgotten locally and expire in the table).
        """
        busy = self._deps.busy_shards()
        free = [s for s in self._book.draining() if s not in busy]
        if not free:
            return
        held = [(s, self._book.fence(s)) for s in free]
        self._book.drop(free)
        m.LEASE_CHANGES.labels(change="released").inc(len(free))
        await self._deps.store.release_shards(held)

    async def release_all(self) -> None:
        """On shutdown: forget every lease, release them and the member row in the table
        (best effort: a failure leaves them to expire after ``lease_ttl_s``)."""
        held = self._book.held()
        m.LEASE_CHANGES.labels(change="released").inc(len(self._book.data_shards()))
        self._book.expire_all()
        m.OWNED_SHARDS.set(0)
        with contextlib.suppress(StoreError):
            await self._deps.store.release_shards(held)
        with contextlib.suppress(StoreError):
            await self._deps.store.leave()
        self._member = False
