"""The in-memory relay store (``ledgerbox.relay.testing.InMemoryRelayStore``): the rules of the
SQL store without PostgreSQL, and the relay's pure logic run on it (no services)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid
from typing import Any

import pytest
from aiokafka.errors import MessageSizeTooLargeError

from ledgerbox.outbox import EventEnvelope, EventStatus, shard_of
from ledgerbox.relay import Relay, RelayConfig
from ledgerbox.relay._store import Cursor, CursorWrite, DeadLetter, PersistOutcome, ShardRead
from ledgerbox.relay.testing import InMemoryPublisher, InMemoryRelayStore

T0 = dt.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=dt.UTC)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ev(key: str, seq: int, *, topic: str = "t", **payload: object) -> EventEnvelope:
    return EventEnvelope(
        event_id=uuid.uuid4(),
        idempotency_key=f"{key}:{seq}:{uuid.uuid4().hex}",
        event_type="Tested",
        topic=topic,
        partition_key=key,
        source="/memstore-tests",
        aggregate_type="thing",
        aggregate_id=key,
        aggregate_version=seq,
        occurred_at=T0,
        payload={"key": key, "seq": seq, **payload},
    )


def keys_on_shards(*shards: int) -> list[str]:
    """One partition key per wanted shard (of 64)."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < len(shards):
        key = f"k{i}"
        if shard_of(key, 64) in shards:
            found.setdefault(shard_of(key, 64), key)
        i += 1
    return [found[s] for s in shards]


async def owned(store: InMemoryRelayStore, shards: range | list[int]) -> dict[int, int]:
    await store.ensure_leases(64)
    lo, hi = min(shards), max(shards)
    return dict(await store.acquire_shards(len(shards), 5.0, lo=lo, hi=hi))


# -- the store's rules ---------------------------------------------------------------------

EMPTY = Cursor(None)


def reads(*shards: int, cursor: Cursor = EMPTY) -> list[ShardRead]:
    return [ShardRead(s, cursor) for s in shards]


async def test_claim_takes_shards_in_the_given_order_rows_in_id_order_sorted_by_shard() -> None:
    store = InMemoryRelayStore("me")
    a, b = keys_on_shards(3, 9)
    ids = [store.add(ev(k, s)) for s in range(3) for k in (a, b)]  # interleaved ids
    claim = await store.claim_batch(reads(9, 3), 4, hold=True)
    # shard 9 first (all 3 rows), then one row of shard 3; returned sorted by (shard, id)
    assert [(c.shard, c.id) for c in claim.events] == [
        (3, ids[0]),
        (9, ids[1]),
        (9, ids[3]),
        (9, ids[5]),
    ]
    # The open ranges go on after their last id, up to the claim's snapshot.
    snap = claim.snapshot
    again = await store.claim_batch(
        [ShardRead(3, Cursor(None, snap, ids[0])), ShardRead(9, Cursor(None, snap, ids[1]))],
        10,
        hold=True,
    )
    assert [c.id for c in again.events] == [ids[2], ids[4], ids[3], ids[5]]
    assert (await store.claim_batch([], 10, hold=True)).events == []


async def test_a_range_holds_what_committed_after_lo_up_to_hi_and_pages_by_id() -> None:
    store = InMemoryRelayStore("me")
    (key,) = keys_on_shards(4)
    first = [store.add(ev(key, i)) for i in range(3)]
    snap = (await store.claim_batch(reads(4), 10, hold=False)).snapshot
    later = [store.add(ev(key, i)) for i in range(3, 5)]
    claim = await store.claim_batch(reads(4, cursor=Cursor(snap)), 10, hold=False)
    assert [c.id for c in claim.events] == later, "only what committed after lo"
    closed = Cursor(None, snap)
    assert [
        c.id for c in (await store.claim_batch(reads(4, cursor=closed), 10, hold=False)).events
    ] == first
    assert await store.range_ids(reads(4, cursor=Cursor(None, claim.snapshot, first[0])), 3) == {
        4: [first[1], first[2], later[0]]
    }
    page = await store.claim_batch(
        [ShardRead(4, Cursor(None, claim.snapshot), [first[2], later[1]])], 10, hold=False
    )
    assert [c.id for c in page.events] == [first[2], later[1]], "a page reads exactly its ids"


async def test_claimed_rows_carry_what_the_kafka_record_needs() -> None:
    store = InMemoryRelayStore()
    event = ev("k", 4).model_copy(update={"headers": {"traceparent": "00-x"}})
    store.add(event)
    (claimed,) = (await store.claim_batch(reads(*range(64)), 1, hold=False)).events
    assert claimed.event_id == str(event.event_id)
    assert claimed.aggregate_version == "4"
    assert claimed.occurred_at_ms == 1767323045678
    assert claimed.occurred_at_iso == "2026-01-02T03:04:05.678000+00:00"
    assert json.loads(claimed.payload) == event.payload
    assert json.loads(claimed.headers) == {"traceparent": "00-x"}
    assert claimed.held is False


async def test_persists_are_fenced_and_move_the_cursor() -> None:
    clock = Clock()
    me = InMemoryRelayStore("me", clock=clock)
    other = me.for_member("other")
    (key,) = keys_on_shards(5)
    first, second = me.add(ev(key, 1)), me.add(ev(key, 2))
    fences = await owned(me, [5])
    assert fences == {5: 1}
    claim = await me.claim_batch(reads(5), 1, hold=True)
    mid = Cursor(None, claim.snapshot, first)
    assert await me.persist([CursorWrite(5, 2, mid)]) == {5: PersistOutcome.LOST}, "wrong fence"
    assert await other.persist([CursorWrite(5, 1, mid)]) == {5: PersistOutcome.LOST}, "not mine"
    assert me.pending_count() == 2
    assert await me.persist([CursorWrite(5, 1, mid)]) == {5: PersistOutcome.OK}
    assert me.is_published(first) and not me.is_published(second)
    assert me.pending_count() == 1
    assert me.status_of(first) is EventStatus.PENDING, "nothing written per row"
    # the lease expires and another relay takes the shard: the old fence writes nothing
    clock.now += 6
    assert await other.acquire_shards(1, 5.0, lo=5, hi=5) == [(5, 2)]
    dead = DeadLetter(second, 5, "x")
    done = Cursor(claim.snapshot)
    assert await me.persist([CursorWrite(5, 1, done)], [dead]) == {5: PersistOutcome.LOST}
    assert me.status_of(second) is EventStatus.PENDING
    assert (await other.open_shards([(5, 2)]))[0].cursor == mid, "the new owner reads it"
    assert await other.persist([CursorWrite(5, 2, done)], [DeadLetter(second, 5, "E" * 3000)]) == {
        5: PersistOutcome.OK
    }
    assert me.status_of(second) is EventStatus.DEAD_LETTERED
    assert me.last_error_of(second) == "E" * 2000
    assert me.pending_count() == 0


async def test_a_cursor_ahead_of_the_database_is_refused_and_stays_refused() -> None:
    store = InMemoryRelayStore("me")
    (key,) = keys_on_shards(6)
    store.add(ev(key, 1))
    fences = await owned(store, [6])
    store.set_cursor(6, Cursor("99"))  # as after a restore into a cluster that is behind
    (opened,) = await store.open_shards([(6, fences[6])])
    assert opened.cursor is None and opened.refused is not None
    assert "ahead" in opened.refused
    claim = await store.claim_batch(reads(6, cursor=Cursor("99")), 10, hold=True)
    assert claim.ahead == [6] and claim.events == []
    for _ in range(100):  # the counter passes the cursor: still refused (sticky)
        store.add(ev("other", 1))
    assert (await store.open_shards([(6, fences[6])]))[0].refused is not None
    assert await store.refused_shards() == [(6, opened.refused)]
    await store.rebase(0.0, dry_run=False)
    assert await store.refused_shards() == []


async def test_hold_flags_later_rows_of_a_key_with_a_dead_lettered_row() -> None:
    store = InMemoryRelayStore("me")
    bad, ok = keys_on_shards(1, 2)
    dead, later, other = store.add(ev(bad, 1)), store.add(ev(bad, 2)), store.add(ev(ok, 1))
    fences = await owned(store, [1, 2])
    claim = await store.claim_batch(reads(1, 2), 1, hold=True)
    assert [c.id for c in claim.events] == [dead]
    written = await store.persist(
        [CursorWrite(1, fences[1], Cursor(None, claim.snapshot, dead))],
        [DeadLetter(dead, 1, "refused")],
    )
    assert written == {1: PersistOutcome.OK}
    cursor = Cursor(None, claim.snapshot, dead)
    held = await store.claim_batch([ShardRead(1, cursor), ShardRead(2, EMPTY)], 10, hold=True)
    assert [(c.id, c.held) for c in held.events] == [(later, True), (other, False)]
    skipped = await store.claim_batch([ShardRead(1, cursor), ShardRead(2, EMPTY)], 10, hold=False)
    assert [(c.id, c.held) for c in skipped.events] == [(later, False), (other, False)]
    # the persist that passes the flagged row holds it
    await store.persist([CursorWrite(1, fences[1], Cursor(held.snapshot))], held=[(later, 1)])
    assert store.status_of(later) is EventStatus.HELD
    assert store.pending_count() == 1  # `other` only
    # replay: the dead row and the held row are read again, in id order
    assert store.replay(dead) == 2
    again = await store.claim_batch(reads(1, cursor=Cursor(held.snapshot)), 10, hold=True)
    assert [(c.id, c.held) for c in again.events] == [(dead, False), (later, False)]


async def test_discard_lets_the_held_rows_go_on_and_never_sends_the_dead_one() -> None:
    store = InMemoryRelayStore("me")
    (bad,) = keys_on_shards(1)
    dead, later = store.add(ev(bad, 1)), store.add(ev(bad, 2))
    fences = await owned(store, [1])
    claim = await store.claim_batch(reads(1), 10, hold=True)
    await store.persist(
        [CursorWrite(1, fences[1], Cursor(claim.snapshot))],
        [DeadLetter(dead, 1, "refused")],
        [(later, 1)],
    )
    assert store.status_of(later) is EventStatus.HELD
    assert await store.discard_dead_lettered(dead) == 2
    assert store.status_of(dead) is EventStatus.DISCARDED
    again = await store.claim_batch(reads(1, cursor=Cursor(claim.snapshot)), 10, hold=True)
    assert [(c.id, c.held) for c in again.events] == [(later, False)]


async def test_leases_fences_expiry_and_membership() -> None:
    clock = Clock()
    a = InMemoryRelayStore("a", clock=clock)
    b = a.for_member("b")
    await a.ensure_leases(4)
    await a.ensure_leases(4)  # idempotent
    assert a.lease_of(-1) == (None, 0)
    assert await a.acquire_shards(2, 5.0, lo=0, hi=3) == [(0, 1), (1, 1)], "lowest first"
    assert await b.acquire_shards(9, 5.0, lo=0, hi=3) == [(2, 1), (3, 1)], "never the same"
    assert await a.acquire_shards(0, 5.0, lo=0, hi=3) == []
    assert await a.heartbeat(5.0) == 1
    assert await b.heartbeat(5.0) == 2
    clock.now += 4
    assert await a.renew_shards([(0, 1), (1, 1), (2, 1)], 5.0) == [(0, 1), (1, 1)]
    clock.now += 2  # b's leases expired (not renewed), a's hold until now + 3
    assert await a.acquire_shards(4, 5.0, lo=0, hi=3) == [(2, 2), (3, 2)]
    assert await b.renew_shards([(2, 1)], 5.0) == [], "the old fence is lost"
    assert await b.release_shards([(2, 1)]) == 0
    assert await a.release_shards([(2, 2), (3, 2)]) == 2
    assert a.lease_of(2) == (None, 2)
    assert await a.heartbeat(5.0) == 1, "b's member row expired"
    await a.leave()
    clock.now += 3601 + 5
    assert await a.cleanup_members() == 1  # b; a left already


async def test_cleanup_deletes_only_published_rows_past_retention() -> None:
    clock = Clock()
    store = InMemoryRelayStore("me", clock=clock)
    (key,) = keys_on_shards(0)
    rows = [store.add(ev(key, i)) for i in range(5)]
    fences = await owned(store, [0])
    claim = await store.claim_batch(reads(0), 3, hold=True)
    await store.persist(
        [CursorWrite(0, fences[0], Cursor(None, claim.snapshot, rows[2]))]
    )  # rows 0..2 published, in an open range: not yet below lo
    claim = await store.claim_batch(
        reads(0, cursor=Cursor(None, claim.snapshot, rows[2])), 1, hold=True
    )
    await store.persist(
        [CursorWrite(0, fences[0], Cursor(None, claim.snapshot, rows[3]))],
        [DeadLetter(rows[3], 0, "x")],
    )
    assert await store.cleanup_published(0.0, 10) == 0, "published but not below lo"
    await store.persist([CursorWrite(0, fences[0], Cursor(claim.snapshot))])  # rows[4] too
    clock.now += 100
    assert await store.record_tick(10.0, 100.0) is True
    assert await store.record_tick(10.0, 100.0) is False, "one tick per gap"
    later = store.add(ev(key, 9))  # committed after the tick
    assert await store.cleanup_published(100.0, 10) == 0, "no tick older than the retention"
    clock.now += 101
    assert await store.cleanup_published(100.0, 2) == 2, "bounded"
    assert await store.cleanup_published(100.0, 10) == 2, "rows 2 and 4; never the dead one"
    with pytest.raises(KeyError):
        store.status_of(rows[0])
    assert store.status_of(rows[3]) is EventStatus.DEAD_LETTERED
    assert store.status_of(later) is EventStatus.PENDING, "pending: the cursor has not passed it"


async def test_stats_count_pending_dead_held_and_age_and_list_owners() -> None:
    clock = Clock()
    store = InMemoryRelayStore("me", clock=clock)
    empty = await store.stats(64)
    assert (empty.pending, empty.dead_lettered, empty.oldest_pending_age_s, empty.owners) == (
        0,
        0,
        None,
        [],
    )
    a, b = keys_on_shards(0, 1)
    first = store.add(ev(a, 1))
    clock.now += 10
    second = store.add(ev(b, 1))
    fences = await owned(store, [0, 1])
    claim = await store.claim_batch(reads(0), 10, hold=True)
    await store.persist(
        [CursorWrite(0, fences[0], Cursor(claim.snapshot))], [DeadLetter(first, 0, "x")]
    )
    clock.now += 4
    stats = await store.stats(64)
    assert (stats.pending, stats.dead_lettered, stats.held, stats.oldest_pending_age_s) == (
        1,
        1,
        0,
        4.0,
    )
    assert not store.is_published(second)
    assert stats.owners[:3] == [(-1, None, 0, False), (0, "me", 1, True), (1, "me", 1, True)]
    clock.now += 1
    assert (await store.stats(64)).owners[1] == (0, "me", 1, False), "expired"


async def test_notifications_yield_once_listening_then_per_commit() -> None:
    store = InMemoryRelayStore()
    stream = store.notifications()
    await asyncio.wait_for(anext(stream), 1)  # listening now
    waiting = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    store.add(ev("k", 1))
    await asyncio.wait_for(waiting, 1)
    await stream.aclose()


# -- the relay on it ---------------------------------------------------------------------------


def config(**overrides: object) -> RelayConfig:
    values: dict[str, object] = {
        "database_url": "postgresql://unused/db",
        "kafka_bootstrap_servers": "unused:9092",
        "relay_id": "r1",
        "lease_ttl_s": 3.0,
        "heartbeat_interval_s": 0.5,
        "lanes": 1,
        **overrides,
    }
    return RelayConfig(**values)  # type: ignore[arg-type]


async def test_relay_run_once_publishes_each_key_in_order_and_persists_the_cursors() -> None:
    store, publisher = InMemoryRelayStore("r1"), InMemoryPublisher()
    rows = [store.add(ev(f"k{i % 3}", i)) for i in range(7)]
    relay = Relay(config(batch_size=5), publisher=publisher, store_factory=store.factory())
    try:
        assert await relay.run_once() == 5
        assert await relay.run_once() == 2
        assert await relay.run_once() == 0
        assert relay.is_leader() and len(relay.owned_shards()) == 64
    finally:
        await relay.aclose()
    by_key: dict[bytes, list[int]] = {}
    for record in publisher.records:
        by_key.setdefault(record.key, []).append(json.loads(record.value)["seq"])
    assert by_key == {b"k0": [0, 3, 6], b"k1": [1, 4], b"k2": [2, 5]}
    assert all(store.is_published(r) for r in rows)
    assert store.pending_count() == 0
    assert all(store.lease_of(s)[0] is None for s in range(-1, 64)), "aclose released them"


async def test_relay_dead_letters_a_refused_record_and_holds_its_key() -> None:
    store, publisher = InMemoryRelayStore("r1"), InMemoryPublisher()
    bad = store.add(ev("k-bad", 1, huge=True))
    held = store.add(ev("k-bad", 2))
    fine = store.add(ev("k-ok", 1))
    publisher.reject_on_send(lambda r: b'"huge"' in r.value, MessageSizeTooLargeError())
    relay = Relay(config(), publisher=publisher, store_factory=store.factory())
    try:
        assert await relay.run_once() == 1
        assert await relay.run_once() == 0, "k-bad's later event is held"
    finally:
        await relay.aclose()
    assert store.status_of(bad) is EventStatus.DEAD_LETTERED
    assert (store.last_error_of(bad) or "").startswith("MessageSizeTooLargeError")
    assert store.status_of(held) is EventStatus.HELD
    assert store.is_published(fine) and store.status_of(fine) is EventStatus.PENDING
    assert store.pending_count() == 0, "the cursor passed all three"


async def test_two_relays_split_the_shards_and_take_over_a_dead_ones() -> None:
    clock = Clock()
    db = InMemoryRelayStore("r1", clock=clock)
    one = Relay(
        config(relay_id="r1"),
        publisher=InMemoryPublisher(),
        store_factory=db.factory(),
        clock=clock,
    )
    two = Relay(
        config(relay_id="r2"),
        publisher=InMemoryPublisher(),
        store_factory=db.factory("r2"),
        clock=clock,
    )
    await one.run_once()
    assert len(one.owned_shards()) == 64
    await two.run_once()  # r2 counts 2 members: wants 32, all taken
    await one.run_once()  # r1 drains to its fair share of 32 and releases the rest
    await two.run_once()
    assert len(one.owned_shards()) == 32 and len(two.owned_shards()) == 32
    assert not set(one.owned_shards()) & set(two.owned_shards())
    # r1 dies (no more heartbeats): after the TTL r2 takes its shards with a new fence
    clock.now += 3.5
    await two.run_once()
    assert len(two.owned_shards()) == 64
    assert one.owned_shards() == [], "past its local deadline r1 publishes nothing"
    await two.aclose()


class _UnreachablePublisher(InMemoryPublisher):
    """Kafka at a wrong address: the producer never starts."""

    async def start(self) -> None:
        from aiokafka.errors import KafkaConnectionError

        raise KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 1)]")


async def test_failsafe_02_a_relay_that_cannot_publish_holds_no_shard_and_no_membership() -> None:
    """Issue 12 line 2: a relay with a wrong Kafka address acquired half of the shards and
    held them (their events stuck). It must hold none, and must not count as a member
    either (a healthy relay's fair share would shrink and leave shards to nobody)."""
    clock = Clock()
    db = InMemoryRelayStore("good", clock=clock)
    rows = [db.add(ev(key, 1)) for key in keys_on_shards(*range(0, 64, 7))]
    bad = Relay(
        config(relay_id="bad"),
        publisher=_UnreachablePublisher(),
        store_factory=db.factory("bad"),
        clock=clock,
    )
    good = Relay(
        config(relay_id="good"), publisher=InMemoryPublisher(), store_factory=db.factory(),
        clock=clock,
    )  # fmt: skip
    try:
        for _ in range(3):
            assert await bad.run_once() == 0
            await good.run_once()
        assert bad.owned_shards() == []
        assert len(good.owned_shards()) == 64, "the bad relay is not a member"
        assert all(db.is_published(r) for r in rows)
        report = bad.health()
        assert report.state == "down" and report.cause is not None
        assert report.cause.startswith("kafka: producer start failed: KafkaConnectionError")
        assert good.health().state == "ok"
    finally:
        await bad.aclose()
        await good.aclose()


class _Partitioned(InMemoryPublisher):
    """A broker this relay can stop reaching (sends time out, metadata requests fail)."""

    def __init__(self) -> None:
        super().__init__()
        self.reachable = True

    async def check(self) -> None:
        if not self.reachable:
            from aiokafka.errors import KafkaConnectionError

            raise KafkaConnectionError("no route")

    async def send_many(self, records: Any) -> Any:
        if not self.reachable:
            from aiokafka.errors import KafkaTimeoutError

            self.fail_next_sends(len(records), KafkaTimeoutError())
        return await super().send_many(records)


async def test_failsafe_02_shards_are_released_when_kafka_stays_unreachable_past_the_ttl() -> None:
    clock = Clock()
    db = InMemoryRelayStore("r1", clock=clock)
    publisher = _Partitioned()
    relay = Relay(
        config(relay_id="r1"), publisher=publisher, store_factory=db.factory(), clock=clock
    )
    key = keys_on_shards(5)[0]
    try:
        await relay.run_once()
        assert len(relay.owned_shards()) == 64
        publisher.reachable = False
        db.add(ev(key, 1))
        await relay.run_once()  # the send fails: Kafka down since now
        assert relay.health().state == "down"
        clock.now += 1.0
        await relay.run_once()
        assert len(relay.owned_shards()) == 64, "within the TTL the shards are kept"
        clock.now += 3.0  # past lease_ttl_s (3 s in these tests) without one good send
        await relay.run_once()
        assert relay.owned_shards() == [], "released to relays that can publish"
        assert all(db.lease_of(s)[0] is None for s in range(64))
        clock.now += 1.0
        await relay.run_once()
        assert relay.owned_shards() == [], "still unreachable: nothing acquired"
        publisher.reachable = True
        clock.now += 11.0  # past the next probe (backoff_max_s 10)
        await relay.run_once()  # the probe sees Kafka again, the heartbeat acquires
        assert len(relay.owned_shards()) == 64 and relay.health().state == "ok"
        await relay.run_once()
        assert [r.key for r in publisher.records] == [key.encode()], "sent once Kafka is back"
    finally:
        await relay.aclose()


async def test_a_lane_idle_after_every_batch_persists_once_per_interval_not_per_batch() -> None:
    """At a moderate rate the lane goes idle after nearly every batch. Its cursors are
    persisted once ``PERSIST_EVERY_S`` has passed since the last persist (a round trip each;
    the clock here stands still, so only the final one passes), unless the next NOTIFY comes
    first - not once per batch, as when an idle lane persisted at once."""
    clock = Clock()
    store, publisher = InMemoryRelayStore("r1", clock=clock), InMemoryPublisher()
    persists = 0
    real_persist = store.persist

    async def counting(*args: Any, **kwargs: Any) -> dict[int, PersistOutcome]:
        nonlocal persists
        persists += 1
        return await real_persist(*args, **kwargs)

    store.persist = counting  # type: ignore[method-assign]
    relay = Relay(
        config(claim_linger_ms=0, poll_interval_s=60.0),
        publisher=publisher,
        store_factory=store.factory(),
        clock=clock,
    )
    task = asyncio.create_task(relay.run())

    async def until(check: Any) -> None:
        for _ in range(2000):
            if check():
                return
            await asyncio.sleep(0.001)
        raise TimeoutError("condition not met")

    try:
        await until(lambda: len(relay.owned_shards()) == 64)
        rows = []
        for i in range(20):
            rows.append(store.add(ev(f"k{i}", 1)))
            await until(lambda: len(publisher.records) == len(rows))
        during = persists
        await until(lambda: all(store.is_published(r) for r in rows))
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
    assert len(publisher.records) == 20
    assert during <= 5, f"{during} persists for 20 batches published one after the other"


async def test_a_shard_reacquired_under_a_new_fence_during_a_slow_claim_is_not_sent() -> None:
    """The claim ran long: meanwhile this relay's leases expired and it acquired the shards
    again, under new fences. The claimed rows were read with the old cursor, so they must not
    be sent: the next claim reads the cursor again from the lease row, under the new fence.
    Sent anyway (as 886a2a7 did, filtering by "still usable" alone), each event went out twice:
    once now, its persist refused by the fence, and again after the cursor was re-read."""
    clock = Clock()
    store, publisher = InMemoryRelayStore("r1", clock=clock), InMemoryPublisher()
    relay = Relay(config(), publisher=publisher, store_factory=store.factory(), clock=clock)
    real_claim = store.claim_batch
    slow = True

    async def slow_claim(*args: Any, **kwargs: Any) -> Any:
        nonlocal slow
        claimed = await real_claim(*args, **kwargs)
        if slow and claimed.events:
            slow = False
            before = {s: relay._leases.fence(s) for s in relay.owned_shards()}
            # Past lease_ttl_s: another relay takes the expired shards and gives them up
            # again (it stopped); this relay's heartbeat finds them lost and acquires them.
            clock.now += 3.5
            other = store.for_member("r2")
            taken = await other.acquire_shards(64, 3.0, lo=0, hi=63)
            assert len(taken) == 64
            assert await other.release_shards(taken) == 64
            await relay._leases.heartbeat_once()
            after = {s: relay._leases.fence(s) for s in relay.owned_shards()}
            assert len(after) == 64 and all(after[s] != before[s] for s in after)
        return claimed

    store.claim_batch = slow_claim  # type: ignore[method-assign]
    try:
        assert await relay.run_once() == 0, "rows to be published"
        rows = [store.add(ev(f"k{i}", 1)) for i in range(5)]
        assert await relay.run_once() == 0
        assert publisher.records == [], "nothing sent from the claim under the old fences"
        assert await relay.run_once() == 5
        assert await relay.run_once() == 0
    finally:
        await relay.aclose()
    assert sorted(json.loads(r.value)["key"] for r in publisher.records) == [
        f"k{i}" for i in range(5)
    ], "each event sent once"
    assert all(store.is_published(r) for r in rows)


async def test_g3_a_delivery_refusal_holds_the_later_events_of_its_key_sent_with_it() -> None:
    """The broker refuses E1's record batch (MessageSizeTooLarge at delivery, not at the
    precheck) while E2 and E3 of the same key travel in later record batches of the same
    send: they are not sent (the publisher holds them back), E1 is dead-lettered and E2, E3
    are held - never published ahead of E1. Before 2026-12-04 E2 and E3 were confirmed."""
    store, publisher = InMemoryRelayStore("r1"), InMemoryPublisher()
    bad = store.add(ev("k", 1, huge=True))
    later = [store.add(ev("k", 2)), store.add(ev("k", 3))]
    other = store.add(ev("other", 1))
    publisher.fail_delivery(lambda r: b'"huge"' in r.value, MessageSizeTooLargeError())
    relay = Relay(config(), publisher=publisher, store_factory=store.factory())
    try:
        for _ in range(3):
            await relay.run_once()
    finally:
        await relay.aclose()
    assert store.status_of(bad) is EventStatus.DEAD_LETTERED
    assert [store.status_of(r) for r in later] == [EventStatus.HELD, EventStatus.HELD]
    assert [r.key for r in publisher.records] == [b"other"]
    assert store.is_published(other)


async def test_g3_a_transient_delivery_failure_sends_nothing_of_its_key_after_it() -> None:
    """E1's delivery times out; E2 (same key, same send) must not be confirmed before E1:
    after the fault clears, the key's records are [1, 2] and nothing came before E1."""
    store, publisher = InMemoryRelayStore("r1"), InMemoryPublisher()
    rows = [store.add(ev("k", 1)), store.add(ev("k", 2))]
    from aiokafka.errors import KafkaTimeoutError

    publisher.fail_next_sends(1, KafkaTimeoutError())
    relay = Relay(config(backoff_max_s=0.1), publisher=publisher, store_factory=store.factory())
    try:
        for _ in range(4):
            await relay.run_once()
    finally:
        await relay.aclose()
    assert [json.loads(r.value)["seq"] for r in publisher.records] == [1, 2]
    assert all(store.is_published(r) for r in rows)


async def test_g3_a_record_held_back_behind_a_restamped_one_is_read_again_when_pipelined() -> None:
    """Pipelined lane (Relay.run, prefetch on): E1's timestamp is refused and it is re-sent
    with the send time (C19); E2 of its key, held back unsent behind it, is neither confirmed
    nor dead - the batch is not clean, so the prefetched claim (read past E2) is dropped and
    E2 is read again, then published after E1 (batches of 2: the prefetch read E3, E4)."""
    from aiokafka.errors import InvalidTimestampError

    store, publisher = InMemoryRelayStore("r1"), InMemoryPublisher()
    rows = [store.add(ev("k", 1, future=True))] + [store.add(ev("k", i)) for i in (2, 3, 4)]
    refused_at = T0.timestamp() * 1000
    publisher.fail_delivery(
        lambda r: b'"future"' in r.value and r.timestamp_ms == refused_at, InvalidTimestampError()
    )
    relay = Relay(
        config(claim_linger_ms=0, poll_interval_s=0.05, batch_size=2),
        publisher=publisher,
        store_factory=store.factory(),
    )
    task = asyncio.create_task(relay.run())
    try:
        for _ in range(2000):
            if len(publisher.records) >= 4 and all(store.is_published(r) for r in rows):
                break
            await asyncio.sleep(0.002)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
    assert [json.loads(r.value)["seq"] for r in publisher.records] == [1, 2, 3, 4]
    assert all(store.is_published(r) for r in rows)
