"""One contract, two relay stores: every scenario runs against ``PgRelayStore`` (real
PostgreSQL) and ``InMemoryRelayStore`` (relay.testing) and must give the same results, so the
in-memory store used by pure-logic tests keeps the SQL store's semantics."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence

import psycopg
import pytest
from sqlalchemy import Engine, text

from ledgerbox._core.identifiers import outbox_notify_channel, wake_gate_key
from ledgerbox.outbox import EventEnvelope, shard_of
from ledgerbox.relay._gate import GATE_PAYLOAD, TAKE_PAYLOAD, GateStore
from ledgerbox.relay._pgstore import PgRelayStore
from ledgerbox.relay._store import (
    Cursor,
    CursorWrite,
    DeadLetter,
    DeadQuery,
    PersistOutcome,
    RelayStore,
    ShardRead,
)
from ledgerbox.relay.testing import InMemoryRelayStore
from tests import _relay_support as rs

TTL_S = 1.0


class _Harness:
    """The "database" behind a store: write rows, read a row's status, let time pass."""

    async def store(self, member: str) -> RelayStore:
        raise NotImplementedError

    def add(self, events: Sequence[EventEnvelope]) -> list[int]:
        raise NotImplementedError

    def status(self, row_id: int) -> int | None:
        raise NotImplementedError

    async def advance(self, seconds: float) -> None:
        raise NotImplementedError

    def ahead(self) -> Cursor:
        """A cursor beyond the database's transaction counter (as after a restore)."""
        raise NotImplementedError

    def set_cursor(self, shard: int, cursor: Cursor) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        return None


class _Memory(_Harness):
    def __init__(self) -> None:
        self.now = 0.0
        self.db = InMemoryRelayStore("a", clock=lambda: self.now)

    async def store(self, member: str) -> RelayStore:
        return self.db.for_member(member)

    def add(self, events: Sequence[EventEnvelope]) -> list[int]:
        return [self.db.add(e) for e in events]

    def status(self, row_id: int) -> int | None:
        try:
            return int(self.db.status_of(row_id))
        except KeyError:
            return None

    async def advance(self, seconds: float) -> None:
        self.now += seconds

    def ahead(self) -> Cursor:
        return Cursor("1000000")

    def set_cursor(self, shard: int, cursor: Cursor) -> None:
        self.db.set_cursor(shard, cursor)


class _Postgres(_Harness):
    def __init__(self, engine: Engine, database_url: str) -> None:
        self.engine, self.database_url = engine, database_url
        self.stores: list[PgRelayStore] = []
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM outbox"))
            conn.execute(text("DELETE FROM outbox_relay_lease"))
            conn.execute(text("DELETE FROM outbox_relay_member"))
            conn.execute(text("DELETE FROM outbox_relay_tick"))

    async def store(self, member: str) -> RelayStore:
        config = rs.config(self.database_url, "unused:9092", relay_id=member)
        self.stores.append(PgRelayStore(config, "contract"))
        return self.stores[-1]

    def add(self, events: Sequence[EventEnvelope]) -> list[int]:
        for event in events:  # one transaction each, in order: ids increase
            rs.stage(self.engine, rs.writer_for(event.topic), [event])
        with self.engine.connect() as conn:
            ids = dict(conn.execute(text("SELECT event_id::text, id FROM outbox")).all())
        return [int(ids[str(e.event_id)]) for e in events]

    def status(self, row_id: int) -> int | None:
        with self.engine.connect() as conn:
            found = conn.execute(text("SELECT status FROM outbox WHERE id = :i"), {"i": row_id})
            value = found.scalar_one_or_none()
        return None if value is None else int(value)

    async def advance(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def ahead(self) -> Cursor:
        with self.engine.connect() as conn:
            xmax = int(
                conn.execute(text("SELECT pg_snapshot_xmax(pg_current_snapshot())")).scalar_one()
            )
        return Cursor(f"{xmax + 1_000_000}:{xmax + 1_000_000}:")

    def set_cursor(self, shard: int, cursor: Cursor) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE outbox_relay_lease SET lo = CAST(:lo AS pg_snapshot) WHERE shard = :s"
                ),
                {"lo": cursor.lo, "s": shard},
            )

    async def aclose(self) -> None:
        for store in self.stores:
            await store.aclose()


@pytest.fixture(params=["postgres", "memory"])
async def db(request: pytest.FixtureRequest) -> AsyncIterator[_Harness]:
    harness: _Harness
    if request.param == "memory":
        harness = _Memory()
    else:
        engine: Engine = request.getfixturevalue("engine")
        harness = _Postgres(engine, request.getfixturevalue("database_url"))
    try:
        yield harness
    finally:
        await harness.aclose()


def _keys_on(*shards: int) -> list[str]:
    found: dict[int, str] = {}
    i = 0
    while len(found) < len(shards):
        shard = shard_of(f"c{i}", 64)
        if shard in shards:
            found.setdefault(shard, f"c{i}")
        i += 1
    return [found[s] for s in shards]


EMPTY = Cursor(None)


async def test_claim_persist_dead_letter_hold_and_stats_agree(db: _Harness) -> None:
    writer = rs.writer_for("contract")
    a, b = _keys_on(3, 9)
    ids = db.add([rs.event(writer, k, s) for s in range(3) for k in (a, b)])
    me = await db.store("a")
    await me.ensure_leases(64)
    assert sorted(await me.acquire_shards(2, 30.0, lo=3, hi=9)) == [(3, 1), (4, 1)]
    assert await me.acquire_shards(1, 30.0, lo=9, hi=9) == [(9, 1)]
    opened = await me.open_shards([(9, 1), (3, 1), (4, 2)])
    assert [(o.shard, o.fence, o.cursor) for o in opened] == [(3, 1, EMPTY), (9, 1, EMPTY)]

    claim = await me.claim_batch([ShardRead(9, EMPTY), ShardRead(3, EMPTY)], 4, hold=True)
    assert [(c.shard, c.id) for c in claim.events] == [
        (3, ids[0]),
        (9, ids[1]),
        (9, ids[3]),
        (9, ids[5]),
    ]
    snap = claim.snapshot
    mid3, done9 = Cursor(None, snap, ids[0]), Cursor(snap)
    rest = await me.claim_batch([ShardRead(3, mid3), ShardRead(9, done9)], 10, hold=True)
    assert [c.id for c in rest.events] == [ids[2], ids[4]]
    listed = await me.range_ids([ShardRead(3, mid3)], 1)
    assert {s: list(v) for s, v in listed.items()} == {3: [ids[2]]}

    assert await me.persist([CursorWrite(9, 2, done9)]) == {9: PersistOutcome.LOST}, "fence"
    assert await me.persist(
        [CursorWrite(9, 1, done9), CursorWrite(3, 1, mid3)], [DeadLetter(ids[0], 3, "refused")]
    ) == {9: PersistOutcome.OK, 3: PersistOutcome.OK}
    assert [db.status(i) for i in ids] == [2, 0, 0, 0, 0, 0]
    reopened = await me.open_shards([(3, 1), (9, 1)])
    assert [o.cursor for o in reopened] == [mid3, done9]

    held = await me.claim_batch([ShardRead(3, mid3)], 10, hold=True)
    assert [(c.id, c.held) for c in held.events] == [(ids[2], True), (ids[4], True)], (
        "a's later rows wait behind its dead one"
    )
    skipped = await me.claim_batch([ShardRead(3, mid3)], 10, hold=False)
    assert [(c.id, c.held) for c in skipped.events] == [(ids[2], False), (ids[4], False)]
    assert await me.persist([CursorWrite(3, 1, Cursor(snap))], held=[(ids[2], 3), (ids[4], 3)]) == {
        3: PersistOutcome.OK
    }
    assert [db.status(i) for i in ids] == [2, 0, 3, 0, 3, 0]

    stats = await me.stats(64)
    assert (stats.pending, stats.dead_lettered, stats.held) == (0, 1, 2)
    assert stats.oldest_pending_age_s is None
    assert stats.owners[0] == (-1, None, 0, False)
    assert [o for o in stats.owners if o[1] is not None] == [
        (3, "a", 1, True),
        (4, "a", 1, True),
        (9, "a", 1, True),
    ]
    assert len(stats.owners) == 65

    # The operator's reads (ledgerbox relay dead list, relay status): the same on both.
    dead = await me.dead_lettered(DeadQuery(topic="contract"))
    assert [(r.id, r.key, r.held_behind, r.last_error, r.attempts) for r in dead] == [
        (ids[0], a, 2, "refused", 1)
    ]
    assert (dead[0].event_type, dead[0].shard, dead[0].payload) == ("Tested", 3, None)
    assert [r.id for r in await me.dead_lettered(DeadQuery(topic="contract", key=b))] == []
    assert [r.id for r in await me.dead_lettered(DeadQuery(ids=[ids[0], ids[1]]))] == [ids[0]]
    assert [r.id for r in await me.dead_lettered(DeadQuery(error="REFUS"))] == [ids[0]]
    assert await me.dead_lettered(DeadQuery(topic="contract", older_than_s=3600)) == []
    (body,) = await me.dead_lettered(DeadQuery(ids=[ids[0]], with_body=True))
    assert body.payload is not None and json.loads(body.payload) == {"key": a, "seq": 0}
    held_keys = [h for h in await me.held_keys(100) if h.key == a]
    assert [(h.dead_id, h.dead_count, h.held) for h in held_keys] == [(ids[0], 1, 2)]

    # Replay: the dead row and the held rows of its key are read again, in id order.
    assert await me.replay_dead_lettered(ids[1]) == 0, "not dead-lettered"
    assert await me.replay_dead_lettered(ids[0]) == 3
    again = await me.claim_batch([ShardRead(3, Cursor(snap))], 10, hold=True)
    assert [(c.id, c.held) for c in again.events] == [
        (ids[0], False),
        (ids[2], False),
        (ids[4], False),
    ]
    assert (await me.stats(64)).pending == 3


async def test_a_held_row_is_read_again_when_its_dead_row_was_replayed_meanwhile(
    db: _Harness,
) -> None:
    writer = rs.writer_for("contract-replay")
    (key,) = _keys_on(5)
    dead, later = db.add([rs.event(writer, key, 1), rs.event(writer, key, 2)])
    me = await db.store("a")
    await me.ensure_leases(64)
    await me.acquire_shards(1, 30.0, lo=5, hi=5)
    first = await me.claim_batch([ShardRead(5, EMPTY)], 1, hold=True)
    mid = Cursor(None, first.snapshot, dead)
    await me.persist([CursorWrite(5, 1, mid)], [DeadLetter(dead, 5, "refused")])
    flagged = await me.claim_batch([ShardRead(5, mid)], 10, hold=True)
    assert [(c.id, c.held) for c in flagged.events] == [(later, True)]
    # The operator replays the dead row before the persist that would hold `later`.
    assert await me.replay_dead_lettered(dead) == 2, "the dead row and the unpublished later one"
    assert await me.persist([CursorWrite(5, 1, Cursor(first.snapshot))], held=[(later, 5)]) == {
        5: PersistOutcome.OK
    }
    assert [db.status(i) for i in (dead, later)] == [0, 0], "not held: nothing is dead"
    again = await me.claim_batch([ShardRead(5, Cursor(first.snapshot))], 10, hold=True)
    assert [(c.id, c.held) for c in again.events] == [(dead, False), (later, False)]


async def test_discard_releases_the_held_rows(db: _Harness) -> None:
    writer = rs.writer_for("contract-discard")
    (key,) = _keys_on(6)
    dead, later = db.add([rs.event(writer, key, 1), rs.event(writer, key, 2)])
    me = await db.store("a")
    await me.ensure_leases(64)
    await me.acquire_shards(1, 30.0, lo=6, hi=6)
    claim = await me.claim_batch([ShardRead(6, EMPTY)], 10, hold=True)
    await me.persist(
        [CursorWrite(6, 1, Cursor(claim.snapshot))], [DeadLetter(dead, 6, "x")], [(later, 6)]
    )
    assert [db.status(i) for i in (dead, later)] == [2, 3]
    assert await me.discard_dead_lettered(dead) == 2
    assert [db.status(i) for i in (dead, later)] == [4, 0]
    again = await me.claim_batch([ShardRead(6, Cursor(claim.snapshot))], 10, hold=True)
    assert [(c.id, c.held) for c in again.events] == [(later, False)]


async def test_a_cursor_ahead_of_the_database_is_refused_for_good(db: _Harness) -> None:
    me = await db.store("a")
    await me.ensure_leases(64)
    await me.acquire_shards(1, 30.0, lo=7, hi=7)
    ahead = db.ahead()
    db.set_cursor(7, ahead)
    claim = await me.claim_batch([ShardRead(7, ahead)], 10, hold=True)
    assert claim.ahead == [7] and claim.events == []
    assert await me.persist([CursorWrite(7, 1, ahead)]) == {7: PersistOutcome.RECHECK}
    (opened,) = await me.open_shards([(7, 1)])
    assert opened.cursor is None and opened.refused is not None and "ahead" in opened.refused
    db.set_cursor(7, Cursor(None))  # even once the cursor looks fine: sticky
    assert [o.refused for o in await me.open_shards([(7, 1)])] == [opened.refused]
    assert await me.refused_shards() == [(7, opened.refused)]
    assert (await me.stats(64)).refused == [(7, opened.refused)]
    assert len(await me.rebase(0.0, dry_run=True)) == 64
    assert await me.refused_shards() == [(7, opened.refused)], "a dry run changes nothing"
    await me.rebase(0.0, dry_run=False)
    assert await me.refused_shards() == []


async def test_leases_expire_and_move_under_a_new_fence(db: _Harness) -> None:
    a, b = await db.store("a"), await db.store("b")
    await a.ensure_leases(4)
    await a.ensure_leases(4)
    assert await a.heartbeat(TTL_S) == 1
    assert await b.heartbeat(TTL_S) == 2
    assert sorted(await a.acquire_shards(2, TTL_S, lo=0, hi=3)) == [(0, 1), (1, 1)]
    assert sorted(await b.acquire_shards(9, TTL_S, lo=0, hi=3)) == [(2, 1), (3, 1)]
    assert await a.acquire_shards(1, TTL_S, lo=-1, hi=-1) == [(-1, 1)]
    assert await b.acquire_shards(1, TTL_S, lo=-1, hi=-1) == [], "one leader"
    await db.advance(TTL_S * 0.6)
    renewed = await a.renew_shards([(0, 1), (1, 1), (-1, 1), (2, 1)], TTL_S)
    assert sorted(renewed) == [(-1, 1), (0, 1), (1, 1)], "not b's shard 2"
    assert await a.heartbeat(TTL_S) == 2
    await db.advance(TTL_S * 0.6)  # b's leases and member row expired, a's renewed ones not
    assert await a.heartbeat(TTL_S) == 1
    assert sorted(await a.acquire_shards(4, TTL_S, lo=0, hi=3)) == [(2, 2), (3, 2)]
    assert await b.renew_shards([(2, 1), (3, 1)], TTL_S) == [], "the old fence is lost"
    assert await b.release_shards([(2, 1)]) == 0
    assert await a.release_shards([(2, 2), (3, 2)]) == 2
    assert await b.acquire_shards(1, TTL_S, lo=0, hi=3) == [(2, 3)], "released: free again"
    await a.leave()
    await b.leave()
    assert await a.cleanup_members() == 0, "expired for less than an hour"


async def test_cleanup_deletes_only_published_rows_past_retention(db: _Harness) -> None:
    writer = rs.writer_for("contract-clean")
    (key,) = _keys_on(0)
    ids = db.add([rs.event(writer, key, i) for i in range(4)])
    me = await db.store("a")
    await me.ensure_leases(64)
    assert await me.acquire_shards(1, 30.0, lo=0, hi=0) == [(0, 1)]
    claim = await me.claim_batch([ShardRead(0, EMPTY)], 3, hold=True)
    await me.persist(
        [CursorWrite(0, 1, Cursor(claim.snapshot))], [DeadLetter(ids[2], 0, "x")]
    )  # ids 0-1 published, 2 dead, 3 pending: in the next range? no, committed before: passed
    assert await me.record_tick(0.0, 0.5) is True
    late = db.add([rs.event(writer, key, 9)])[0]  # committed after the tick: pending
    assert await me.cleanup_published(0.5, 10) == 0, "no tick older than 0.5 s"
    await db.advance(0.6)
    assert await me.cleanup_published(0.5, 1) == 1, "bounded"
    assert await me.cleanup_published(0.5, 10) == 2
    assert await me.cleanup_published(0.5, 10) == 0
    assert [db.status(i) for i in [*ids, late]] == [None, None, 2, None, 0]
    assert (await me.stats(64)).pending == 1


async def test_notifications_yield_once_listening_then_on_a_commit(db: _Harness) -> None:
    me = await db.store("a")
    if isinstance(me, GateStore):  # writers notify while a relay holds the wake gate
        gate = await db.store("gate")
        assert await gate.gate_try() == (True, True)  # type: ignore[attr-defined]
    stream = me.notifications()
    await asyncio.wait_for(anext(stream), 10)  # LISTEN is active
    waiting = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    writer = rs.writer_for("contract-notify")
    await asyncio.to_thread(db.add, [rs.event(writer, "n", 1)])
    await asyncio.wait_for(waiting, 10)
    await stream.aclose()  # type: ignore[attr-defined]


async def test_acquire_takes_at_most_the_wanted_leases_whatever_the_plan(
    engine: Engine, database_url: str
) -> None:
    """ACQUIRE_SHARDS picked its leases in an ``IN (SELECT ... LIMIT n FOR UPDATE SKIP
    LOCKED)`` subquery. A nested-loop semi join re-runs that subquery for each lease row,
    and each run skips the rows the statement already updated: it took every free lease, not
    ``n`` (``make test`` under load, 2026-12-04: 4 of 4 instead of 2). The planner settings
    in the URL force that plan; a materialized CTE runs the pick once whatever the plan."""
    harness = _Postgres(engine, database_url)
    forcing = "%20".join(  # libpq decodes %20, not "+"
        f"-c%20enable_{name}%3Doff"
        for name in ("hashjoin", "mergejoin", "memoize", "material", "sort", "hashagg")
    )
    separator = "&" if "?" in database_url else "?"
    harness.database_url = f"{database_url}{separator}options={forcing}"
    try:
        a = await harness.store("a")
        await a.ensure_leases(4)
        assert await a.heartbeat(TTL_S) == 1
        assert sorted(await a.acquire_shards(2, TTL_S, lo=0, hi=3)) == [(0, 1), (1, 1)]
        assert sorted(await a.acquire_shards(9, TTL_S, lo=0, hi=3)) == [(2, 1), (3, 1)]
    finally:
        await harness.aclose()


async def test_the_urls_own_options_reach_the_relays_connections(
    engine: Engine, database_url: str
) -> None:
    """``?options=-c ...`` in the database URL (a search_path, a role setting) is kept: the
    relay's own options (time zone, statement timeout, jit) were passed as psycopg's
    ``options`` argument, which replaced the URL's."""
    harness = _Postgres(engine, database_url)
    separator = "&" if "?" in database_url else "?"
    harness.database_url = f"{database_url}{separator}options=-c%20work_mem%3D7MB"
    try:
        store = await harness.store("a")
        assert isinstance(store, PgRelayStore)
        conn = await store._connection()
        settings = await (await conn.execute("SHOW work_mem")).fetchone()
        timeout = await (await conn.execute("SHOW statement_timeout")).fetchone()
        assert (settings, timeout) == (("7MB",), ("1min",)), "the URL's and the relay's"
    finally:
        await harness.aclose()


class _Payloads:
    """Reads a store's notifications in a task (a timed-out ``anext`` would close the
    stream): ``next(within_s)`` is the next payload, TimeoutError if none came."""

    def __init__(self, store: RelayStore) -> None:
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.task = asyncio.ensure_future(self._read(store))

    async def _read(self, store: RelayStore) -> None:
        async for payload in store.notifications():
            self.queue.put_nowait(payload)

    async def next(self, within_s: float) -> str | None:
        return await asyncio.wait_for(self.queue.get(), within_s)

    async def aclose(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def test_writers_notify_only_while_a_relay_holds_the_wake_gate(
    engine: Engine, database_url: str
) -> None:
    """The wake gate (relay._gate): the trigger notifies only if it cannot take the gate in
    SHARE mode; a writer that skipped its NOTIFY keeps it until it ends, so no relay can take
    the gate (and then trust notifications) before that writer's row is committed."""
    db = _Postgres(engine, database_url)
    try:
        stream = _Payloads(await db.store("a"))
        assert await stream.next(10) is None  # LISTEN is active
        writer = rs.writer_for("contract-gate")
        # No relay holds the gate: the commit sends no notification.
        await asyncio.to_thread(db.add, [rs.event(writer, "g", 1)])
        with pytest.raises(TimeoutError):
            await stream.next(0.5)
        # A writer in flight that skipped its NOTIFY holds the gate in SHARE mode.
        with engine.connect() as conn:
            tx = conn.begin()
            rs.writer_for("contract-gate").stage(conn, rs.event(writer, "g", 2))
            first, second = await db.store("gate1"), await db.store("gate2")
            assert await first.gate_try() == (False, False), "a writer in flight: not yet"
            tx.commit()
        assert await first.gate_try() == (True, True)
        assert await second.gate_try() == (False, True), "held by another relay: covered"
        assert await stream.next(10) == TAKE_PAYLOAD, "a take tells every relay to claim once"
        with pytest.raises(TimeoutError):
            await stream.next(0.3)  # (the in-flight writer skipped its NOTIFY)
        # Held: every writer notifies, once per transaction.
        await asyncio.to_thread(db.add, [rs.event(writer, "g", 3)])
        assert await stream.next(10) == ""
        # Released: one "gate" notification, then writers are silent again.
        await first.gate_release()
        assert await stream.next(10) == GATE_PAYLOAD
        await asyncio.to_thread(db.add, [rs.event(writer, "g", 4)])
        with pytest.raises(TimeoutError):
            await stream.next(0.5)
        assert await second.gate_try() == (True, True)
        await stream.aclose()
    finally:
        await db.aclose()


async def test_the_gate_of_another_database_is_no_cover(
    engine: Engine, database_url: str, empty_database_url: str
) -> None:
    """Advisory locks belong to one database, and every database's outbox of the default
    name has the same gate key: a relay whose own writers hold the gate in SHARE mode must
    not count a relay of another database on the same server as its cover (pg_locks shows
    every database's locks: the first GATE_TRY read it)."""
    here, there = _Postgres(engine, database_url), _Postgres(engine, empty_database_url)
    try:
        holder, other = await here.store("gate-here"), await there.store("gate-there")
        assert await holder.gate_try() == (True, True)  # type: ignore[attr-defined]
        key = wake_gate_key(outbox_notify_channel("outbox", None))
        with psycopg.connect(empty_database_url.replace("+psycopg", "")) as writer:
            writer.execute("SELECT pg_try_advisory_xact_lock_shared(%s, %s)", key)  # in flight
            assert await other.gate_try() == (False, False)  # type: ignore[attr-defined]
            writer.rollback()
        assert await other.gate_try() == (True, True)  # type: ignore[attr-defined]
    finally:
        await here.aclose()
        await there.aclose()
