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


async def test_claim_takes_shards_in_the_given_order_rows_in_id_order_sorted_by_shard() -> None:
    store = InMemoryRelayStore("me")
    a, b = keys_on_shards(3, 9)
    ids = [store.add(ev(k, s)) for s in range(3) for k in (a, b)]  # interleaved ids
    claimed = await store.claim_batch([9, 3], 4, hold=True)
    # shard 9 first (all 3 rows), then one row of shard 3; returned sorted by (shard, id)
    assert [(c.shard, c.id) for c in claimed] == [
        (3, ids[0]),
        (9, ids[1]),
        (9, ids[3]),
        (9, ids[5]),
    ]
    again = await store.claim_batch([3, 9], 10, hold=True, exclude=[ids[0], ids[1]])
    assert [c.id for c in again] == [ids[2], ids[4], ids[3], ids[5]]
    assert await store.claim_batch([], 10, hold=True) == []


async def test_claimed_rows_carry_what_the_kafka_record_needs() -> None:
    store = InMemoryRelayStore()
    event = ev("k", 4).model_copy(update={"headers": {"traceparent": "00-x"}})
    store.add(event)
    (claimed,) = await store.claim_batch(range(64), 1, hold=False)
    assert claimed.event_id == str(event.event_id)
    assert claimed.aggregate_version == "4"
    assert claimed.occurred_at_ms == 1767323045678
    assert claimed.occurred_at_iso == "2026-01-02T03:04:05.678000+00:00"
    assert json.loads(claimed.payload) == event.payload
    assert json.loads(claimed.headers) == {"traceparent": "00-x"}


async def test_marks_are_fenced_and_only_pending_rows_change() -> None:
    clock = Clock()
    me = InMemoryRelayStore("me", clock=clock)
    other = me.for_member("other")
    (key,) = keys_on_shards(5)
    first, second = me.add(ev(key, 1)), me.add(ev(key, 2))
    fences = await owned(me, [5])
    assert fences == {5: 1}
    assert await me.mark_published([first], [(5, 2)]) == 0, "wrong fence"
    assert await other.mark_published([first], [(5, 1)]) == 0, "not the owner"
    assert await me.mark_published([first, first], [(5, 1)]) == 1
    assert await me.mark_published([first], [(5, 1)]) == 0, "already published"
    assert me.status_of(first) is EventStatus.PUBLISHED
    # the lease expires and another relay takes the shard: the old fence marks nothing
    clock.now += 6
    assert await other.acquire_shards(1, 5.0, lo=5, hi=5) == [(5, 2)]
    assert await me.mark_published([second], [(5, 1)]) == 0
    assert await me.mark_dead_lettered(second, 1, "x") == 0
    assert await other.mark_dead_lettered(second, 2, "E" * 3000) == 1
    assert me.status_of(second) is EventStatus.DEAD_LETTERED
    assert me.last_error_of(second) == "E" * 2000


async def test_hold_skips_later_rows_of_a_key_with_a_dead_lettered_row() -> None:
    store = InMemoryRelayStore("me")
    bad, ok = keys_on_shards(1, 2)
    dead, later, other = store.add(ev(bad, 1)), store.add(ev(bad, 2)), store.add(ev(ok, 1))
    fences = await owned(store, [1, 2])
    assert await store.mark_dead_lettered(dead, fences[1], "refused") == 1
    held = await store.claim_batch([1, 2], 10, hold=True)
    assert [c.id for c in held] == [other]
    skipped = await store.claim_batch([1, 2], 10, hold=False)
    assert [c.id for c in skipped] == [later, other]
    store.replay(dead)
    assert [c.id for c in await store.claim_batch([1], 10, hold=True)] == [dead, later]


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
    await store.mark_published(rows[:3], [(0, fences[0])])
    await store.mark_dead_lettered(rows[3], fences[0], "x")
    clock.now += 100
    assert await store.cleanup_published(100.0, 10) == 0, "not older than the retention"
    clock.now += 1
    assert await store.cleanup_published(100.0, 2) == 2, "bounded"
    assert await store.cleanup_published(100.0, 10) == 1
    with pytest.raises(KeyError):
        store.status_of(rows[0])
    assert store.status_of(rows[3]) is EventStatus.DEAD_LETTERED
    assert store.status_of(rows[4]) is EventStatus.PENDING


async def test_stats_count_pending_dead_and_age_and_list_owners() -> None:
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
    store.add(ev(b, 1))
    fences = await owned(store, [0, 1])
    await store.mark_dead_lettered(first, fences[0], "x")
    clock.now += 4
    stats = await store.stats(64)
    assert (stats.pending, stats.dead_lettered, stats.oldest_pending_age_s) == (1, 1, 4.0)
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


async def test_relay_run_once_publishes_each_key_in_order_and_marks_the_rows() -> None:
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
    assert {store.status_of(r) for r in rows} == {EventStatus.PUBLISHED}
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
    assert store.status_of(held) is EventStatus.PENDING
    assert store.status_of(fine) is EventStatus.PUBLISHED


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
        assert {db.status_of(r) for r in rows} == {EventStatus.PUBLISHED}
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
