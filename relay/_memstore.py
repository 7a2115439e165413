"""An in-memory :class:`~ledgerbox.relay._store.RelayStore` with the rules of the SQL one.

Exported as :class:`ledgerbox.relay.testing.InMemoryRelayStore`. What it keeps, as
``PgRelayStore``'s statements do: pending rows per shard in id order; a claim takes the given
shards one after the other and returns the rows sorted by ``(shard, id)``; marks only under
the fence this member holds the row's shard with; dead-lettered rows and the hold rule; lease
rows with owner, fence and expiry on an injectable clock (the database's ``now()``); member
rows; cleanup of published rows past retention; the stats of ``relay status``. The contract
test ``tests/integration/test_relay_store_contract.py`` runs one scenario against both.

Differences, by design: nothing is concurrent (no locks to skip); ``payload`` and
``headers`` are ``json.dumps`` texts (PostgreSQL's ``jsonb`` prints keys in its own order).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from ledgerbox._core.names import DEFAULT_SHARD_COUNT
from ledgerbox.outbox import EventEnvelope, EventStatus, shard_of, timestamp_ms
from ledgerbox.relay._store import ClaimedEvent, RelayStats, SchemaReport, StoreFactory

__all__ = ["InMemoryRelayStore"]

_PENDING, _PUBLISHED, _DEAD = 0, 1, 2
_MEMBER_GRACE_S = 3600.0  # as CLEANUP_MEMBERS: expired for more than an hour


@dataclass(slots=True)
class _Row:
    event: ClaimedEvent
    created_at: float
    status: int = _PENDING
    published_at: float | None = None
    last_error: str | None = None
    attempts: int = 0


@dataclass(slots=True)
class _Lease:
    owner: str | None = None
    fence: int = 0
    expires_at: float | None = None

    def free(self, now: float) -> bool:
        return self.owner is None or (self.expires_at is not None and self.expires_at < now)


@dataclass(slots=True)
class _Tables:
    """The shared "database" of every store returned by ``for_member`` / ``factory``."""

    clock: Callable[[], float]
    shard_count: int
    rows: dict[int, _Row] = field(default_factory=dict)  # insertion order is id order
    next_id: int = 1
    leases: dict[int, _Lease] = field(default_factory=dict)
    members: dict[str, float] = field(default_factory=dict)  # relay_id -> expires_at
    listeners: set[asyncio.Event] = field(default_factory=set)


class InMemoryRelayStore:
    """A relay store in memory, for tests of code around the relay without PostgreSQL.

    Parameters
    ----------
    member_id : str
        The relay this store speaks for (``RelayConfig.member_id``); other members share the
        same tables through :meth:`for_member`.
    clock : Callable[[], float]
        The "database's" clock in seconds (lease and member expiry, retention, ages).
    shard_count : int
        Shards of the rows :meth:`add` writes (``OutboxTable.shard_count``, default 64).

    Examples
    --------
    >>> store = InMemoryRelayStore(config.member_id)                        # doctest: +SKIP
    >>> store.add(writer.event(...))                                         # doctest: +SKIP
    >>> relay = Relay(config, publisher=InMemoryPublisher(), store_factory=store.factory())
    >>> await relay.run_once()                                               # doctest: +SKIP
    """

    def __init__(
        self,
        member_id: str = "in-memory",
        *,
        clock: Callable[[], float] = time.monotonic,
        shard_count: int = DEFAULT_SHARD_COUNT,
    ) -> None:
        self.member_id = member_id
        self._t = _Tables(clock=clock, shard_count=shard_count)

    def for_member(self, member_id: str) -> InMemoryRelayStore:
        """A store of another relay on the same tables."""
        other = InMemoryRelayStore.__new__(InMemoryRelayStore)
        other.member_id = member_id
        other._t = self._t
        return other

    def factory(self, member_id: str | None = None) -> StoreFactory:
        """A ``store_factory`` for :class:`~ledgerbox.relay.Relay`: every role gets the store
        of ``member_id`` (default: this store's member) on these tables."""
        store = self if member_id in (None, self.member_id) else self.for_member(member_id)
        return lambda role: store

    # -- the write side and inspection (what the producer and an operator do) ---------------

    def add(self, event: EventEnvelope) -> int:
        """Commit one outbox row for ``event`` (pending); notifies the listeners. Returns
        the row id (ids increase in commit order)."""
        t = self._t
        row_id, t.next_id = t.next_id, t.next_id + 1
        version = event.aggregate_version
        claimed = ClaimedEvent(
            id=row_id,
            shard=shard_of(event.partition_key, t.shard_count),
            topic=event.topic,
            partition_key=event.partition_key,
            payload=json.dumps(event.payload),
            headers=json.dumps(event.headers),
            event_id=str(event.event_id),
            idempotency_key=event.idempotency_key,
            event_type=event.event_type,
            source=event.source,
            aggregate_type=event.aggregate_type,
            aggregate_id=event.aggregate_id,
            aggregate_version=None if version is None else str(version),
            occurred_at_ms=timestamp_ms(event.occurred_at),
            occurred_at_iso=event.occurred_at.astimezone(dt.UTC).isoformat(),
        )
        t.rows[row_id] = _Row(claimed, created_at=t.clock())
        for listener in t.listeners:
            listener.set()
        return row_id

    def status_of(self, row_id: int) -> EventStatus:
        """The row's status (``KeyError`` if it was deleted or never written)."""
        return EventStatus(self._t.rows[row_id].status)

    def last_error_of(self, row_id: int) -> str | None:
        """The reason a row was dead-lettered, else ``None``."""
        return self._t.rows[row_id].last_error

    def replay(self, row_id: int) -> None:
        """What an operator does to replay a dead-lettered row: ``status = 0`` again."""
        self._t.rows[row_id].status = _PENDING

    def lease_of(self, shard: int) -> tuple[str | None, int]:
        """``(owner, fence)`` of a lease row (``KeyError`` before :meth:`ensure_leases`)."""
        lease = self._t.leases[shard]
        return lease.owner, lease.fence

    # -- leases and membership ---------------------------------------------------------------

    async def ensure_leases(self, shard_count: int) -> None:
        for shard in range(-1, shard_count):
            self._t.leases.setdefault(shard, _Lease())

    async def heartbeat(self, ttl_s: float) -> int:
        t, now = self._t, self._t.clock()
        # As the SQL (one snapshot): the count sees the other live members, plus this one.
        others = sum(1 for m, exp in t.members.items() if exp > now and m != self.member_id)
        t.members[self.member_id] = now + ttl_s
        return 1 + others

    async def renew_shards(
        self, held: Sequence[tuple[int, int]], ttl_s: float
    ) -> list[tuple[int, int]]:
        now = self._t.clock()
        renewed = []
        for shard, fence in held:
            lease = self._t.leases.get(shard)
            if lease is not None and lease.fence == fence and lease.owner == self.member_id:
                lease.expires_at = now + ttl_s
                renewed.append((shard, fence))
        return renewed

    async def acquire_shards(
        self, want: int, ttl_s: float, *, lo: int, hi: int
    ) -> list[tuple[int, int]]:
        if want <= 0:
            return []
        now = self._t.clock()
        free = sorted(s for s, lease in self._t.leases.items() if lo <= s <= hi and lease.free(now))
        granted = []
        for shard in free[:want]:
            lease = self._t.leases[shard]
            lease.owner, lease.fence = self.member_id, lease.fence + 1
            lease.expires_at = now + ttl_s
            granted.append((shard, lease.fence))
        return granted

    async def release_shards(self, held: Sequence[tuple[int, int]]) -> int:
        released = 0
        for shard, fence in held:
            lease = self._t.leases.get(shard)
            if lease is not None and lease.fence == fence and lease.owner == self.member_id:
                lease.owner, lease.expires_at = None, None
                released += 1
        return released

    async def leave(self) -> None:
        self._t.members.pop(self.member_id, None)

    # -- the hot path ----------------------------------------------------------------------

    async def claim_batch(
        self,
        shards: Sequence[int],
        limit: int,
        *,
        hold: bool,
        exclude: Sequence[int] = (),
    ) -> list[ClaimedEvent]:
        excluded = set(exclude)
        dead_first: dict[str, int] = {}  # partition key -> lowest dead-lettered id
        for row_id, row in self._t.rows.items():
            if row.status == _DEAD:
                dead_first.setdefault(row.event.partition_key, row_id)
        claimed: list[ClaimedEvent] = []
        for shard in shards:
            for row_id, row in self._t.rows.items():
                if len(claimed) >= limit:
                    break
                event = row.event
                if event.shard != shard or row.status != _PENDING or row_id in excluded:
                    continue
                if hold and dead_first.get(event.partition_key, row_id) < row_id:
                    continue
                claimed.append(event)
        return sorted(claimed, key=lambda e: (e.shard, e.id))

    async def mark_published(self, ids: Sequence[int], fences: Sequence[tuple[int, int]]) -> int:
        held = self._held_shards(fences)
        now = self._t.clock()
        marked = 0
        for row_id in sorted(set(ids)):
            row = self._t.rows.get(row_id)
            if row is not None and row.status == _PENDING and row.event.shard in held:
                row.status, row.published_at, row.attempts = _PUBLISHED, now, row.attempts + 1
                marked += 1
        return marked

    async def mark_dead_lettered(self, event_id: int, shard_fence: int, error: str) -> int:
        row = self._t.rows.get(event_id)
        if row is None or row.status != _PENDING:
            return 0
        if row.event.shard not in self._held_shards([(row.event.shard, shard_fence)]):
            return 0
        row.status, row.last_error, row.attempts = _DEAD, error[:2000], row.attempts + 1
        return 1

    def _held_shards(self, fences: Sequence[tuple[int, int]]) -> set[int]:
        leases = self._t.leases
        return {
            s
            for s, f in fences
            if s in leases and leases[s].fence == f and leases[s].owner == self.member_id
        }

    # -- maintenance -------------------------------------------------------------------------

    async def cleanup_published(self, retention_s: float, limit: int) -> int:
        cutoff = self._t.clock() - retention_s
        old = [
            row_id
            for row_id, row in self._t.rows.items()
            if row.status == _PUBLISHED
            and row.published_at is not None
            and row.published_at < cutoff
        ][:limit]
        for row_id in old:
            del self._t.rows[row_id]
        return len(old)

    async def cleanup_members(self) -> int:
        cutoff = self._t.clock() - _MEMBER_GRACE_S
        gone = [m for m, expires in self._t.members.items() if expires < cutoff]
        for member in gone:
            del self._t.members[member]
        return len(gone)

    async def stats(self, shard_count: int) -> RelayStats:
        t, now = self._t, self._t.clock()
        rows = list(t.rows.values())
        heads: dict[int, float] = {}  # shard -> created_at of its lowest pending id
        for row in rows:
            if row.status == _PENDING and 0 <= row.event.shard < shard_count:
                heads.setdefault(row.event.shard, row.created_at)
        return RelayStats(
            pending=sum(1 for r in rows if r.status == _PENDING),
            dead_lettered=sum(1 for r in rows if r.status == _DEAD),
            oldest_pending_age_s=now - min(heads.values()) if heads else None,
            owners=[
                (s, lease.owner, lease.fence, lease.owner is not None and _live(lease, now))
                for s, lease in sorted(t.leases.items())
            ],
        )

    async def owned_stats(self, shards: Sequence[int]) -> tuple[int, float | None]:
        t, now, wanted = self._t, self._t.clock(), set(shards)
        waiting = [r for r in t.rows.values() if r.status == _PENDING and r.event.shard in wanted]
        oldest = min((r.created_at for r in waiting), default=None)
        return len(waiting), None if oldest is None else now - oldest

    async def schema_report(self) -> SchemaReport:
        # Memory has every table and column and grants everything.
        topics = sorted({r.event.topic for r in self._t.rows.values() if r.status == _PENDING})
        return SchemaReport([], [], None, [], False, topics[:100])

    async def ping(self) -> None:
        return None

    # -- wake-up ---------------------------------------------------------------------------

    async def notifications(self) -> AsyncIterator[None]:
        notified = asyncio.Event()
        self._t.listeners.add(notified)
        try:
            yield None
            while True:
                await notified.wait()
                notified.clear()
                yield None
        finally:
            self._t.listeners.discard(notified)

    async def aclose(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"InMemoryRelayStore(member_id={self.member_id!r}, rows={len(self._t.rows)})"


def _live(lease: _Lease, now: float) -> bool:
    return lease.expires_at is not None and lease.expires_at > now
