"""An in-memory :class:`~ledgerbox.relay._store.RelayStore` with the rules of the SQL one.

Exported as :class:`ledgerbox.relay.testing.InMemoryRelayStore`. It models COMMITTED rows
only: every :meth:`InMemoryRelayStore.add` is one committed transaction and gets the next
commit sequence number, which stands in for the transaction id; a snapshot is the highest
sequence number committed (its text form, e.g. ``"17"``), so a range ``(lo, hi]`` holds the
rows committed after ``lo`` up to ``hi``. What it keeps, as ``PgRelayStore``'s statements
do: claims of each shard's range in id order (pages of listed ids for open ranges, the
first rows of the others, shard after shard, sorted by ``(shard, id)``); fenced persists of
cursors with the batch's dead-lettered and held rows; the hold rule; replay and discard
(rows stamped with a new sequence number, so they are read again in id order); lease rows
with owner, fence, cursor, refusal and expiry on an injectable clock (the database's
``now()``); member rows; cleanup ticks and the cleanup of published rows past retention;
the stats of ``relay status``. The contract test
``tests/integration/test_relay_store_contract.py`` runs the same scenarios against both.

Differences, by design: nothing is concurrent (no locks to skip, no transaction in flight:
cases such as C01 need PostgreSQL); there is one cluster (no system identifier, a cursor is
ahead only if a test sets one by hand with :meth:`InMemoryRelayStore.set_cursor`);
``payload`` and ``headers`` are ``json.dumps`` texts (PostgreSQL's ``jsonb`` prints keys in
its own order).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

from ledgerbox._core.names import DEFAULT_SHARD_COUNT
from ledgerbox.outbox import EventEnvelope, EventStatus, shard_of, timestamp_ms
from ledgerbox.relay._store import (
    STRAY_COUNT_CAP,
    Claim,
    ClaimedEvent,
    Cursor,
    CursorWrite,
    DeadLetter,
    DeadQuery,
    DeadRow,
    HeldKeyRow,
    OpenedShard,
    PersistOutcome,
    RebasedShard,
    RelayStats,
    SchemaReport,
    ShardRead,
    StoreFactory,
)

__all__ = ["InMemoryRelayStore"]

_PENDING, _PUBLISHED_V1, _DEAD, _HELD, _DISCARDED = 0, 1, 2, 3, 4
_DELETABLE = (_PENDING, _PUBLISHED_V1, _DISCARDED)
_MEMBER_GRACE_S = 3600.0  # as CLEANUP_MEMBERS: expired for more than an hour
_AHEAD = "cursor ahead of the database (transaction counter behind the cursor's snapshot)"


@dataclass(slots=True)
class _Row:
    event: ClaimedEvent
    created_at: float
    seq: int
    status: int = _PENDING
    last_error: str | None = None
    attempts: int = 0


@dataclass(slots=True)
class _Lease:
    owner: str | None = None
    fence: int = 0
    expires_at: float | None = None
    cursor: Cursor = field(default_factory=lambda: Cursor(None))
    persisted_at: float | None = None
    refused: str | None = None

    def free(self, now: float) -> bool:
        return self.owner is None or (self.expires_at is not None and self.expires_at < now)


@dataclass(slots=True)
class _Tables:
    """The shared "database" of every store returned by ``for_member`` / ``factory``."""

    clock: Callable[[], float]
    shard_count: int
    rows: dict[int, _Row] = field(default_factory=dict)  # insertion order is id order
    next_id: int = 1
    committed: int = 0  # the highest commit sequence number (the current snapshot)
    leases: dict[int, _Lease] = field(default_factory=dict)
    members: dict[str, float] = field(default_factory=dict)  # relay_id -> expires_at
    ticks: list[tuple[float, int]] = field(default_factory=list)  # (taken_at, horizon)
    listeners: set[asyncio.Event] = field(default_factory=set)

    def commit(self) -> int:
        """A new transaction's sequence number (as if it committed now)."""
        self.committed += 1
        return self.committed


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
    >>> store.pending_count()                                                # doctest: +SKIP
    0
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

    @property
    def epoch(self) -> int:
        """Always 1: the "connection" never drops."""
        return 1

    async def connected(self) -> int:
        """:attr:`epoch`: there is nothing to open."""
        return self.epoch

    # -- the write side and inspection (what the producer and an operator do) ---------------

    def add(self, event: EventEnvelope) -> int:
        """Commit one outbox row for ``event`` (one transaction); notifies the listeners.
        Returns the row id (ids increase in commit order)."""
        t = self._t
        row_id, t.next_id = t.next_id, t.next_id + 1
        version = event.aggregate_version
        claimed = ClaimedEvent(
            id=row_id,
            shard=shard_of(event.partition_key, t.shard_count),
            topic=event.topic,
            partition_key=event.partition_key,
            payload=json.dumps(event.payload).encode(),
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
        t.rows[row_id] = _Row(claimed, created_at=t.clock(), seq=t.commit())
        for listener in t.listeners:
            listener.set()
        return row_id

    def status_of(self, row_id: int) -> EventStatus:
        """The row's ``status`` column (``KeyError`` if it was deleted or never written);
        whether a ``PENDING`` row is published is :meth:`is_published`."""
        return EventStatus(self._t.rows[row_id].status)

    def is_published(self, row_id: int) -> bool:
        """True once its shard's persisted cursor passed the row (it was confirmed by Kafka,
        or dead-lettered, held or discarded: see :meth:`status_of`)."""
        row = self._t.rows[row_id]
        return row.status == _PUBLISHED_V1 or _passed(self._lease(row.event.shard), row)

    def pending_count(self) -> int:
        """Rows not yet published (``relay status``'s ``pending``)."""
        return sum(1 for row in self._t.rows.values() if self._pending(row))

    def last_error_of(self, row_id: int) -> str | None:
        """The reason a row was dead-lettered, else ``None``."""
        return self._t.rows[row_id].last_error

    def replay(self, row_id: int) -> int:
        """What an operator does to replay a dead-lettered row (synchronous form of
        :meth:`replay_dead_lettered`)."""
        return self._release(row_id, _PENDING)

    def lease_of(self, shard: int) -> tuple[str | None, int]:
        """``(owner, fence)`` of a lease row (``KeyError`` before :meth:`ensure_leases`)."""
        lease = self._t.leases[shard]
        return lease.owner, lease.fence

    def cursor_of(self, shard: int) -> Cursor:
        """The persisted cursor of a shard (``Cursor(None)`` before its first persist)."""
        return self._lease(shard).cursor

    def set_cursor(self, shard: int, cursor: Cursor) -> None:
        """Overwrite a shard's persisted cursor (tests: e.g. one ahead of the database)."""
        self._t.leases.setdefault(shard, _Lease()).cursor = cursor

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

    # -- cursors -------------------------------------------------------------------------------

    async def open_shards(
        self, held: Sequence[tuple[int, int]], *, release_held: bool = False
    ) -> list[OpenedShard]:
        opened = []
        for shard, fence in sorted(held):
            lease = self._t.leases.get(shard)
            if lease is None or lease.fence != fence or lease.owner != self.member_id:
                continue
            if lease.refused is None and self._ahead(lease.cursor.hi or lease.cursor.lo):
                lease.refused = _AHEAD
            if lease.refused is not None:
                opened.append(OpenedShard(shard, fence, None, lease.refused))
            else:
                opened.append(OpenedShard(shard, fence, lease.cursor))
        usable = {o.shard for o in opened if o.cursor is not None}
        held_rows = [r for r in self._t.rows.values() if r.status == _HELD]
        if release_held and any(r.event.shard in usable for r in held_rows):
            stamp = self._t.commit()
            for row in held_rows:
                if row.event.shard in usable:
                    row.status, row.seq = _PENDING, stamp
        return opened

    async def range_ids(self, reads: Sequence[ShardRead], cap: int) -> dict[int, Sequence[int]]:
        return {
            r.shard: [row.event.id for row in self._range(r.shard, r.cursor, None)][:cap]
            for r in reads
        }

    async def persist(
        self,
        cursors: Sequence[CursorWrite],
        dead: Sequence[DeadLetter] = (),
        held: Sequence[tuple[int, int]] = (),
    ) -> dict[int, PersistOutcome]:
        t = self._t
        outcomes: dict[int, PersistOutcome] = {}
        for write in cursors:
            lease = t.leases.get(write.shard)
            if write.epoch is not None and write.epoch != self.epoch:
                outcomes[write.shard] = PersistOutcome.RECHECK  # as the SQL store's rule
            elif lease is None or lease.fence != write.fence or lease.owner != self.member_id:
                outcomes[write.shard] = PersistOutcome.LOST
            elif lease.refused is not None or self._ahead(write.cursor.hi or write.cursor.lo):
                outcomes[write.shard] = PersistOutcome.RECHECK
            else:
                lease.cursor, lease.persisted_at = write.cursor, t.clock()
                outcomes[write.shard] = PersistOutcome.OK
        ok = {s for s, o in outcomes.items() if o is PersistOutcome.OK}
        for letter in dead:
            row = t.rows.get(letter.id)
            if row is not None and row.status == _PENDING and row.event.shard in ok:
                row.status, row.last_error = _DEAD, letter.error[:2000]
                row.attempts += 1
        stamp: int | None = None
        for row_id, _shard in held:
            row = t.rows.get(row_id)
            if row is None or row.status != _PENDING or row.event.shard not in ok:
                continue
            if self._blocked(row):
                row.status = _HELD
            else:  # its dead row was replayed or discarded meanwhile: read it again
                stamp = stamp or t.commit()
                row.seq = stamp
        return outcomes

    # -- the hot path ----------------------------------------------------------------------

    async def claim_batch(self, reads: Sequence[ShardRead], limit: int, *, hold: bool) -> Claim:
        snapshot = self._t.committed
        ahead = [r.shard for r in reads if self._ahead(r.cursor.hi or r.cursor.lo)]
        claimed: list[ClaimedEvent] = []
        pages = [r for r in reads if r.ids is not None and r.shard not in ahead]
        for read in pages:
            wanted = set(read.ids or ())
            claimed += [
                self._claimed(row, hold)
                for row in self._range(read.shard, read.cursor, None)
                if row.event.id in wanted
            ]
        room = limit - sum(len(r.ids or ()) for r in pages)
        for read in reads:
            if read.ids is not None or read.shard in ahead:
                continue
            for row in self._range(read.shard, read.cursor, snapshot):
                if room <= 0:
                    break
                claimed.append(self._claimed(row, hold))
                room -= 1
        claimed.sort(key=lambda e: (e.shard, e.id))
        return Claim(claimed, str(snapshot), ahead)

    def _range(self, shard: int, cursor: Cursor, snapshot: int | None) -> list[_Row]:
        lo = _seq(cursor.lo)
        hi = _seq(cursor.hi) if cursor.hi is not None else snapshot
        assert hi is not None
        return [
            row
            for row_id, row in self._t.rows.items()
            if row.event.shard == shard
            and row.status == _PENDING
            and row_id > cursor.after_id
            and lo < row.seq <= hi
        ]

    def _claimed(self, row: _Row, hold: bool) -> ClaimedEvent:
        if hold and self._blocked(row):
            return _with_held(row.event)
        return row.event

    def _blocked(self, row: _Row) -> bool:
        key, row_id = row.event.partition_key, row.event.id
        return any(
            r.status == _DEAD and r.event.partition_key == key and r.event.id < row_id
            for r in self._t.rows.values()
        )

    def _ahead(self, snapshot: str | None) -> bool:
        return snapshot is not None and _seq(snapshot) > self._t.committed

    def _lease(self, shard: int) -> _Lease:
        return self._t.leases.get(shard) or _Lease()

    def _pending(self, row: _Row) -> bool:
        return row.status == _PENDING and not _passed(self._lease(row.event.shard), row)

    # -- maintenance -------------------------------------------------------------------------

    async def record_tick(self, min_gap_s: float, retention_s: float) -> bool:
        t, now = self._t, self._t.clock()
        recorded = False
        if not any(taken > now - min_gap_s for taken, _ in t.ticks):
            t.ticks.append((now, t.committed + 1))
            recorded = True
        usable = [taken for taken, _ in t.ticks if taken <= now - retention_s]
        if usable:
            t.ticks = [(taken, h) for taken, h in t.ticks if taken >= max(usable)]
        return recorded

    async def cleanup_published(self, retention_s: float, limit: int) -> int:
        t, now = self._t, self._t.clock()
        cutoff = now - retention_s
        horizons = [h for taken, h in t.ticks if taken <= cutoff]
        horizon = horizons[-1] if horizons else 0
        old = [
            row_id
            for row_id, row in t.rows.items()
            if row.status in _DELETABLE
            and row.created_at < cutoff
            and row.seq < horizon
            and row.event.shard in t.leases
            and t.leases[row.event.shard].cursor.lo is not None
            and t.leases[row.event.shard].refused is None
            and not self._ahead(
                t.leases[row.event.shard].cursor.hi or t.leases[row.event.shard].cursor.lo
            )
            and row.seq <= _seq(t.leases[row.event.shard].cursor.lo)
        ][:limit]
        for row_id in old:
            del t.rows[row_id]
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
        pending = [r for r in rows if 0 <= r.event.shard < shard_count and self._pending(r)]
        return RelayStats(
            pending=len(pending),
            dead_lettered=sum(1 for r in rows if r.status == _DEAD),
            oldest_pending_age_s=now - min(r.created_at for r in pending) if pending else None,
            owners=[
                (s, lease.owner, lease.fence, lease.owner is not None and _live(lease, now))
                for s, lease in sorted(t.leases.items())
            ],
            held=sum(1 for r in rows if r.status == _HELD),
            refused=[(s, lease.refused) for s, lease in sorted(t.leases.items()) if lease.refused],
            stray=min(
                STRAY_COUNT_CAP,
                sum(1 for r in rows if r.event.shard >= shard_count and self._pending(r)),
            ),
        )

    async def owned_stats(self, shards: Sequence[int]) -> tuple[int, float | None]:
        t, now, wanted = self._t, self._t.clock(), set(shards)
        waiting = [r for r in t.rows.values() if r.event.shard in wanted and self._pending(r)]
        oldest = min((r.created_at for r in waiting), default=None)
        return len(waiting), None if oldest is None else now - oldest

    async def schema_report(self) -> SchemaReport:
        # Memory has every table and column and grants everything.
        topics = sorted({r.event.topic for r in self._t.rows.values() if self._pending(r)})
        return SchemaReport([], [], None, [], False, topics[:100])

    async def refused_shards(self) -> list[tuple[int, str]]:
        return [
            (s, lease.refused or _AHEAD)
            for s, lease in sorted(self._t.leases.items())
            if s >= 0
            and (lease.refused is not None or self._ahead(lease.cursor.hi or lease.cursor.lo))
        ]

    async def ping(self) -> None:
        return None

    # -- operations ----------------------------------------------------------------------------

    async def replay_dead_lettered(self, row_id: int) -> int:
        return self._release(row_id, _PENDING)

    async def dead_lettered(self, query: DeadQuery) -> list[DeadRow]:
        now, found = self._t.clock(), []
        ids = None if query.ids is None else set(query.ids)
        for row in self._t.rows.values():
            e = row.event
            if row.status != _DEAD or (ids is not None and e.id not in ids):
                continue
            if query.key is not None and e.partition_key != query.key:
                continue
            if query.event_type is not None and e.event_type != query.event_type:
                continue
            if query.topic is not None and e.topic != query.topic:
                continue
            if query.older_than_s is not None and not row.created_at < now - query.older_than_s:
                continue
            if (
                query.error is not None
                and query.error.lower() not in (row.last_error or "").lower()
            ):
                continue
            found.append(self._dead_row(row, query.with_body))
            if len(found) >= query.limit:
                break
        return found

    def _dead_row(self, row: _Row, with_body: bool) -> DeadRow:
        e, rows = row.event, list(self._t.rows.values())
        later = [
            r.event.id
            for r in rows
            if r.status == _DEAD and r.event.partition_key == e.partition_key and r.event.id > e.id
        ]
        stop = min(later, default=None)
        held = sum(
            1
            for r in rows
            if r.status == _HELD
            and r.event.partition_key == e.partition_key
            and r.event.id > e.id
            and (stop is None or r.event.id < stop)
        )
        return DeadRow(
            id=e.id,
            event_id=e.event_id,
            key=e.partition_key,
            event_type=e.event_type,
            topic=e.topic,
            shard=e.shard,
            attempts=row.attempts,
            last_error=row.last_error,
            created_at=dt.datetime.fromtimestamp(row.created_at, dt.UTC),
            occurred_at=dt.datetime.fromtimestamp(e.occurred_at_ms / 1000, dt.UTC),
            held_behind=held,
            payload=e.payload.decode() if with_body else None,
            headers=e.headers if with_body else None,
        )

    async def held_keys(self, limit: int) -> list[HeldKeyRow]:
        rows = list(self._t.rows.values())
        first: dict[str, _Row] = {}
        dead: dict[str, int] = {}
        for row in rows:
            if row.status == _DEAD:
                first.setdefault(row.event.partition_key, row)
                dead[row.event.partition_key] = dead.get(row.event.partition_key, 0) + 1
        keys = sorted(first.values(), key=lambda r: r.event.id)[:limit]
        return [
            HeldKeyRow(
                key=r.event.partition_key,
                dead_id=r.event.id,
                dead_event_id=r.event.event_id,
                dead_count=dead[r.event.partition_key],
                held=sum(
                    1
                    for h in rows
                    if h.status == _HELD and h.event.partition_key == r.event.partition_key
                ),
                since=dt.datetime.fromtimestamp(r.created_at, dt.UTC),
            )
            for r in keys
        ]

    async def discard_dead_lettered(self, row_id: int) -> int:
        return self._release(row_id, _DISCARDED)

    def _release(self, row_id: int, status: int) -> int:
        t = self._t
        dead = t.rows.get(row_id)
        if dead is None or dead.status != _DEAD:
            return 0
        key, lease = dead.event.partition_key, self._lease(dead.event.shard)
        later_dead = [
            r.event.id
            for r in t.rows.values()
            if r.status == _DEAD and r.event.partition_key == key and r.event.id > row_id
        ]
        until = min(later_dead) if later_dead else None
        stamp = t.commit()
        dead.status = status
        if status == _PENDING:
            dead.seq = stamp
        changed = 1
        for row in t.rows.values():
            event = row.event
            if event.partition_key != key or event.id <= row_id:
                continue
            if until is not None and event.id >= until:
                continue
            if row.status == _HELD or (row.status == _PENDING and not _passed(lease, row)):
                row.status, row.seq = _PENDING, stamp
                changed += 1
        return changed

    async def rebase(self, margin_s: float, *, dry_run: bool) -> list[RebasedShard]:
        t = self._t
        await self.ensure_leases(t.shard_count)
        done = []
        for shard in range(t.shard_count):
            lease = t.leases[shard]
            since = None if lease.persisted_at is None else lease.persisted_at - margin_s
            again = [
                r
                for r in t.rows.values()
                if r.event.shard == shard
                and r.status == _PENDING
                and (not _passed(lease, r) or (since is not None and r.created_at > since))
            ]
            if not dry_run:
                stamp = t.commit()
                for row in again:
                    row.seq = stamp
                lease.cursor = Cursor(str(stamp - 1))
                lease.fence += 1
                lease.owner = lease.expires_at = lease.refused = None
                lease.persisted_at = t.clock()
            done.append(RebasedShard(shard, len(again), 0))
        return done

    # -- wake-up ---------------------------------------------------------------------------

    async def notifications(self) -> AsyncIterator[str | None]:
        notified = asyncio.Event()
        self._t.listeners.add(notified)
        try:
            yield None
            while True:
                await notified.wait()
                notified.clear()
                yield ""
        finally:
            self._t.listeners.discard(notified)

    async def aclose(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"InMemoryRelayStore(member_id={self.member_id!r}, rows={len(self._t.rows)})"


def _seq(snapshot: str | None) -> int:
    return 0 if snapshot is None else int(snapshot)


def _passed(lease: _Lease, row: _Row) -> bool:
    """The lease's cursor passed the row (as ``_PENDING_ROWS`` decides)."""
    cursor = lease.cursor
    if row.seq <= _seq(cursor.lo):
        return True
    return cursor.hi is not None and row.seq <= _seq(cursor.hi) and row.event.id <= cursor.after_id


def _with_held(event: ClaimedEvent) -> ClaimedEvent:
    return replace(event, held=True)


def _live(lease: _Lease, now: float) -> bool:
    return lease.expires_at is not None and lease.expires_at > now
