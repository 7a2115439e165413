"""One contract, two relay stores: every scenario runs against ``PgRelayStore`` (real
PostgreSQL) and ``InMemoryRelayStore`` (relay.testing) and must give the same results, so the
in-memory store used by pure-logic tests keeps the SQL store's semantics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest
from sqlalchemy import Engine, text

from ledgerbox.outbox import EventEnvelope, shard_of
from ledgerbox.relay._pgstore import PgRelayStore
from ledgerbox.relay._store import RelayStore
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


class _Postgres(_Harness):
    def __init__(self, engine: Engine, database_url: str) -> None:
        self.engine, self.database_url = engine, database_url
        self.stores: list[PgRelayStore] = []
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM outbox"))
            conn.execute(text("DELETE FROM outbox_relay_lease"))
            conn.execute(text("DELETE FROM outbox_relay_member"))

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


async def test_claim_mark_dead_letter_hold_and_stats_agree(db: _Harness) -> None:
    writer = rs.writer_for("contract")
    a, b = _keys_on(3, 9)
    ids = db.add([rs.event(writer, k, s) for s in range(3) for k in (a, b)])
    me = await db.store("a")
    await me.ensure_leases(64)
    assert sorted(await me.acquire_shards(2, 30.0, lo=3, hi=9)) == [(3, 1), (4, 1)]
    assert await me.acquire_shards(1, 30.0, lo=9, hi=9) == [(9, 1)]

    claimed = await me.claim_batch([9, 3], 4, hold=True)
    assert [(c.shard, c.id) for c in claimed] == [
        (3, ids[0]),
        (9, ids[1]),
        (9, ids[3]),
        (9, ids[5]),
    ]
    excluded = await me.claim_batch([3, 9], 10, hold=True, exclude=[ids[0], ids[1]])
    assert [c.id for c in excluded] == [ids[2], ids[4], ids[3], ids[5]]

    assert await me.mark_published([ids[1], ids[3]], [(9, 2)]) == 0, "wrong fence"
    assert await me.mark_published([ids[1], ids[3], ids[0]], [(9, 1)]) == 2, "shard 3 not given"
    assert await me.mark_dead_lettered(ids[0], 1, "refused: too large") == 1
    assert await me.mark_dead_lettered(ids[0], 1, "again") == 0, "only a pending row"
    assert [db.status(i) for i in ids] == [2, 1, 0, 1, 0, 0]

    held = await me.claim_batch([3, 9], 10, hold=True)
    assert [c.id for c in held] == [ids[5]], "a's later rows wait behind its dead one"
    skipped = await me.claim_batch([3, 9], 10, hold=False)
    assert [c.id for c in skipped] == [ids[2], ids[4], ids[5]]

    stats = await me.stats(64)
    assert (stats.pending, stats.dead_lettered) == (3, 1)
    assert stats.oldest_pending_age_s is not None and stats.oldest_pending_age_s >= 0
    assert stats.owners[0] == (-1, None, 0, False)
    assert [o for o in stats.owners if o[1] is not None] == [
        (3, "a", 1, True),
        (4, "a", 1, True),
        (9, "a", 1, True),
    ]
    assert len(stats.owners) == 65


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
    assert await me.mark_published(ids[:2], [(0, 1)]) == 2
    assert await me.mark_dead_lettered(ids[2], 1, "x") == 1
    assert await me.cleanup_published(0.5, 10) == 0, "published less than 0.5 s ago"
    await db.advance(0.6)
    assert await me.cleanup_published(0.5, 1) == 1, "bounded"
    assert await me.cleanup_published(0.5, 10) == 1
    assert await me.cleanup_published(0.5, 10) == 0
    assert [db.status(i) for i in ids] == [None, None, 2, 0]


async def test_notifications_yield_once_listening_then_on_a_commit(db: _Harness) -> None:
    me = await db.store("a")
    stream = me.notifications()
    await asyncio.wait_for(anext(stream), 10)  # LISTEN is active
    waiting = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    writer = rs.writer_for("contract-notify")
    await asyncio.to_thread(db.add, [rs.event(writer, "n", 1)])
    await asyncio.wait_for(waiting, 10)
    await stream.aclose()  # type: ignore[attr-defined]
