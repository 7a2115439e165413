"""Maintenance: every relay's gauges of its own shards, and the leader's work (the gauges of
the whole table, the cleanup of published rows).

Every relay, every few seconds, reads the rows not yet published in the shards IT holds into
``ledgerbox_relay_owned_pending_events`` and ``..._owned_oldest_pending_age_seconds``: a relay
whose shards do not drain shows it in its own metrics. Only the relay holding lease row ``-1``
(the leader, see :mod:`ledgerbox.relay._leases`) also reads the pending count and the age of
the oldest pending row of the whole table into the gauges; every ``cleanup_interval_s`` it
records a tick (the oldest running transaction now: rows below it were written before now)
and deletes published rows created more than ``retention_s`` ago, ``cleanup_batch_size`` rows
per ``DELETE`` with ``cleanup_pause_s`` between them: rows below every shard's cursor and
below the newest tick older than the retention, found by index whatever the history. Row
locks only (``FOR UPDATE SKIP LOCKED``), never a pending, held or dead-lettered row (C14;
docs/relay.md, "Cleanup").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ledgerbox._core.stop import StopSignal
from ledgerbox.relay import _metrics as m
from ledgerbox.relay._config import RelayConfig
from ledgerbox.relay._errors import StoreError
from ledgerbox.relay._store import STRAY_COUNT_CAP, RelayStore

__all__ = ["STATS_INTERVAL_S", "Maintenance", "MaintenanceDeps", "stray_cause"]

log = logging.getLogger("ledgerbox.relay")

#: Pause between two rounds of the leader's maintenance (gauges, cleanup when due), seconds.
STATS_INTERVAL_S = 5.0


def stray_cause(stray: int, shard_count: int) -> str:
    """One line: ``stray`` events (RelayStats.stray) wait where no relay looks, and the fix."""
    many = f"{stray}+" if stray >= STRAY_COUNT_CAP else str(stray)
    return (
        f"{many} events wait in shards outside 0-{shard_count - 1}, which no relay with"
        f" shard_count {shard_count} publishes: the writers' OutboxTable(shard_count=...) is"
        " larger; give every relay the writers' value (--shard-count,"
        " LEDGERBOX_RELAY_SHARD_COUNT) and restart them"
    )


@dataclass(frozen=True, slots=True)
class MaintenanceDeps:
    """What :class:`Maintenance` uses.

    Attributes
    ----------
    config : RelayConfig
        ``shard_count``, ``retention_s``, ``cleanup_interval_s``, ``cleanup_batch_size``,
        ``cleanup_pause_s``.
    store : RelayStore
        The maintenance connection (role ``"maint"``).
    is_leader : Callable[[], bool]
        True while this relay holds the leader lease.
    owned_shards : Callable[[], list[int]]
        The data shards this relay holds now.
    clock : Callable[[], float]
        Monotonic clock in seconds (when the cleanup is due).
    stop : StopSignal
    """

    config: RelayConfig
    store: RelayStore
    is_leader: Callable[[], bool]
    owned_shards: Callable[[], list[int]]
    clock: Callable[[], float]
    stop: StopSignal


class Maintenance:
    """The leader-only loop: gauges every :data:`STATS_INTERVAL_S`, cleanup when due.

    Parameters
    ----------
    deps : MaintenanceDeps
    """

    def __init__(self, deps: MaintenanceDeps) -> None:
        self._deps = deps
        self._last_cleanup = -float("inf")
        self._stray = 0  # the last stray count logged

    async def run(self) -> None:
        """Until stopped; never raises on database errors (logged, counted as
        ``retries_total{stage="maintenance"}``)."""
        deps = self._deps
        attempt = 0
        while not deps.stop.is_set():
            try:
                await self.owned_round()
                if deps.is_leader():
                    await self._round()
                attempt = 0
            except StoreError as exc:
                attempt += 1
                m.RETRIES.labels(stage="maintenance").inc()
                log.debug("maintenance failed: %s", exc, extra={"attempt": attempt})
            await deps.stop.sleep(STATS_INTERVAL_S)

    async def owned_round(self) -> None:
        """Read the rows waiting in this relay's own shards into its gauges.

        Raises
        ------
        StoreError
            The count failed (the gauges keep their last values).
        """
        pending, age = await self._deps.store.owned_stats(self._deps.owned_shards())
        m.OWNED_PENDING_EVENTS.set(pending)
        m.OWNED_OLDEST_PENDING_AGE.set(age or 0.0)

    async def _round(self) -> None:
        deps = self._deps
        stats = await deps.store.stats(deps.config.shard_count)
        m.PENDING_EVENTS.set(stats.pending)
        m.OLDEST_PENDING_AGE.set(stats.oldest_pending_age_s or 0.0)
        m.DEAD_LETTERED_EVENTS.set(stats.dead_lettered)
        m.HELD_EVENTS.set(stats.held)
        m.STRAY_EVENTS.set(stats.stray)
        if stats.stray and not self._stray:
            log.error("%s", stray_cause(stats.stray, deps.config.shard_count))
        elif self._stray and not stats.stray:
            log.warning("no event waits outside shards 0-%d any more", deps.config.shard_count - 1)
        self._stray = stats.stray
        now = deps.clock()
        if now - self._last_cleanup >= deps.config.cleanup_interval_s:
            self._last_cleanup = now
            deleted = await self.cleanup_once()
            if deleted:
                log.info("cleanup deleted %d published rows", deleted)

    async def cleanup_once(self) -> int:
        """Record a cleanup tick (when due), delete published rows older than ``retention_s``
        in bounded batches, then expired member rows (leader only: 0 when this relay is not
        the leader). Returns the number of outbox rows deleted.

        Raises
        ------
        StoreError
            A ``DELETE`` failed (the rows left are deleted by a later round).
        """
        deps = self._deps
        cfg = deps.config
        if not deps.is_leader():
            return 0
        await deps.store.record_tick(cfg.cleanup_interval_s / 2, cfg.retention_s)
        total = 0
        while not deps.stop.is_set() and deps.is_leader():
            n = await deps.store.cleanup_published(cfg.retention_s, cfg.cleanup_batch_size)
            total += n
            if n < cfg.cleanup_batch_size:
                break
            await deps.stop.sleep(cfg.cleanup_pause_s)
        await deps.store.cleanup_members()
        return total
