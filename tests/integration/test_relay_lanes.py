"""Lanes: several claim -> publish -> mark pipelines in one relay, shards split by
``shard % lanes``; every event published, each key in order (G3)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from sqlalchemy import Engine, text

from ledgerbox.outbox import shard_of
from ledgerbox.relay import Relay, RelayConfig
from ledgerbox.relay._pgstore import pg_store_factory
from ledgerbox.relay._store import Claim, RelayStore, ShardRead
from ledgerbox.relay.testing import InMemoryPublisher
from tests import _relay_support as rs
from tests._relay_support import DelegatingStore
from tests._services import TopicFactory, poll_until

LANES = 4
KEYS = 64
PER_KEY = 25


def _keys_per_lane(keys: list[str]) -> dict[int, int]:
    lanes: dict[int, int] = {}
    for key in keys:
        lane = shard_of(key, 64) % LANES
        lanes[lane] = lanes.get(lane, 0) + 1
    return lanes


async def test_four_lanes_publish_every_key_in_order(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("relay-lanes", partitions=3)
    writer = rs.writer_for(topic)
    keys = [f"lane-key-{i}" for i in range(KEYS)]
    assert sorted(_keys_per_lane(keys)) == list(range(LANES)), "keys cover every lane"
    # Round-robin over keys, 5 transactions: ids of one key interleave with all the others.
    events = [rs.event(writer, key, seq) for seq in range(1, PER_KEY + 1) for key in keys]
    step = len(events) // 5
    for i in range(0, len(events), step):
        rs.stage(engine, writer, events[i : i + step])
    # Small batches: every lane runs many claim/publish/mark cycles concurrently.
    relay = Relay(rs.config(database_url, kafka_bootstrap, batch_size=50, lanes=LANES))
    task = asyncio.create_task(relay.run())
    try:
        total = KEYS * PER_KEY
        records = await rs.consume(
            kafka_bootstrap,
            topic,
            until=lambda r: len({rs.header(x, "ce_id") for x in r}) >= total,
            within_s=120,
        )
        with engine.connect() as conn:
            lane_conns = conn.execute(
                text(
                    "SELECT count(DISTINCT application_name) FROM pg_stat_activity"
                    " WHERE datname = current_database()"
                    " AND application_name LIKE 'ledgerbox-relay-main_'"
                )
            ).scalar_one()
        assert lane_conns == LANES, "each lane claims on its own connection"
    finally:
        relay.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 60)
    by_key: dict[bytes, list[int]] = {}
    for r in records:
        by_key.setdefault(r.key or b"", []).append(json.loads(r.value or b"")["seq"])
    assert len(by_key) == KEYS
    for key, seqs in by_key.items():
        assert list(dict.fromkeys(seqs)) == list(range(1, PER_KEY + 1)), key
    assert rs.pending_count(engine) == 0


async def test_run_once_runs_one_batch_per_lane(engine: Engine, database_url: str) -> None:
    rs.reset_relay_tables(engine)
    writer = rs.writer_for("relay-lanes-once")
    # k0 and k2 map to lane 3, k1 to lane 1 (crc32 % 64 % 4): 5 + 2 rows.
    assert [shard_of(k, 64) % LANES for k in ("k0", "k1", "k2")] == [3, 1, 3]
    events = [rs.event(writer, f"k{i % 3}", i) for i in range(10)]
    rs.stage(engine, writer, events)
    publisher = InMemoryPublisher()
    config = rs.config(database_url, "unused:9092", batch_size=5, lanes=LANES)
    relay = Relay(config, publisher=publisher)
    try:
        assert await relay.run_once() == 5 + 3, "lane 3: one batch of 5; lane 1: all 3 of k1"
        assert await relay.run_once() == 2
        assert await relay.run_once() == 0
    finally:
        await relay.aclose()
    seen: dict[bytes, list[int]] = {}
    for record in publisher.records:
        seen.setdefault(record.key, []).append(json.loads(record.value)["seq"])
    assert seen == {b"k0": [0, 3, 6, 9], b"k1": [1, 4, 7], b"k2": [2, 5, 8]}


async def test_lanes_follow_the_load_and_keep_key_order(engine: Engine, database_url: str) -> None:
    """One lane while the relay keeps up; every lane while claims come back full (a
    backlog); back to one once caught up. Shards move between lanes only between batches, so
    every key still comes out in order, each event once (in-memory broker: no failures)."""
    rs.reset_relay_tables(engine)
    writer = rs.writer_for("relay-lanes-adaptive")
    publisher = InMemoryPublisher()
    relay = Relay(
        rs.config(database_url, "unused:9092", batch_size=20, lanes=LANES), publisher=publisher
    )
    seen_lanes: list[int] = []

    async def watch() -> None:
        while True:
            if not seen_lanes or seen_lanes[-1] != relay.active_lanes:
                seen_lanes.append(relay.active_lanes)
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    task = asyncio.create_task(relay.run())
    try:
        # A trickle first: single events, the relay keeps up with one lane.
        for seq in range(1, 4):
            rs.stage(engine, writer, [rs.event(writer, "trickle", seq)])
            await asyncio.sleep(0.2)
        assert relay.active_lanes == 1
        # Then a backlog: 64 keys x 25 events committed at once.
        keys = [f"burst-{i}" for i in range(KEYS)]
        rs.stage(engine, writer, [rs.event(writer, k, s) for s in range(1, 26) for k in keys])

        async def drained() -> bool:
            return rs.pending_count(engine) == 0

        async def one_lane() -> bool:
            return relay.active_lanes == 1

        await poll_until(drained, within=60, what="backlog published")
        await poll_until(one_lane, within=30, what="back to one lane")

        async def idle_lanes_disconnected() -> bool:
            with engine.connect() as conn:
                names = conn.execute(
                    text(
                        "SELECT application_name FROM pg_stat_activity"
                        " WHERE datname = current_database()"
                        " AND application_name LIKE 'ledgerbox-relay-%'"
                    )
                ).scalars()
                return not any(n[-1].isdigit() and n[-1] != "0" for n in names)

        await poll_until(idle_lanes_disconnected, within=30, what="idle lanes disconnected")
    finally:
        relay.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 60)
        watcher.cancel()
    assert seen_lanes[:3] == [1, LANES, 1], seen_lanes
    by_key: dict[bytes, list[int]] = {}
    for record in publisher.records:
        by_key.setdefault(record.key, []).append(json.loads(record.value)["seq"])
    assert by_key.pop(b"trickle") == [1, 2, 3]
    assert len(by_key) == KEYS
    for key, seqs in by_key.items():
        assert seqs == list(range(1, 26)), key


class _HeldClaimStore(DelegatingStore):
    """Store seam whose second claim (the prefetch) waits until the test releases it."""

    def __init__(self, inner: RelayStore) -> None:
        super().__init__(inner)
        self.claims = 0
        self.prefetch_started = asyncio.Event()
        self.release = asyncio.Event()

    async def claim_batch(self, reads: Sequence[ShardRead], limit: int, *, hold: bool) -> Claim:
        self.claims += 1
        if self.claims == 2:
            self.prefetch_started.set()
            await self.release.wait()
            return Claim([], (await super().claim_batch([], limit, hold=hold)).snapshot)
        return await super().claim_batch(reads, limit, hold=hold)


def _factory(config: RelayConfig, role: str, store: Callable[[RelayStore], RelayStore]) -> Any:
    """Real PostgreSQL stores for every role; the store of ``role`` wrapped by ``store``."""
    real = pg_store_factory(config)
    return lambda r: store(real(r)) if r == role else real(r)


async def test_stop_during_an_empty_prefetch_does_not_wait_for_the_poll(
    engine: Engine, database_url: str
) -> None:
    """Regression: stop() sets the lanes' wake flags; a lane whose prefetch then came back
    empty re-claimed (which clears the flag) and waited a whole poll interval before it saw
    the stop. Same path as a regroup of the lanes."""
    rs.reset_relay_tables(engine)
    writer = rs.writer_for("relay-lanes-stop")
    rs.stage(engine, writer, [rs.event(writer, "k", 1)])
    config = rs.config(database_url, "unused:9092", lanes=1, poll_interval_s=60.0)
    held: list[_HeldClaimStore] = []

    def hold_claims(inner: RelayStore) -> RelayStore:
        held.append(_HeldClaimStore(inner))
        return held[-1]

    relay = Relay(
        config, publisher=InMemoryPublisher(), store_factory=_factory(config, "main", hold_claims)
    )
    (store,) = held  # lanes=1: the one lane's claim store
    task = asyncio.create_task(relay.run())
    try:
        await asyncio.wait_for(store.prefetch_started.wait(), 30)
        relay.stop()
        store.release.set()
        await asyncio.wait_for(task, 10)  # was: ~60 s (the poll interval)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert store.claims == 2, "no claim after the stop"


class _LateListenStore(DelegatingStore):
    """LISTEN connection that becomes active only when the test says so."""

    def __init__(self, inner: RelayStore) -> None:
        super().__init__(inner)
        self.go = asyncio.Event()

    async def notifications(self) -> AsyncIterator[None]:
        await self.go.wait()
        async for item in super().notifications():
            yield item


async def test_a_commit_before_listen_is_active_is_claimed_once_it_is(
    engine: Engine, database_url: str
) -> None:
    """Regression: the relay woke its lanes BEFORE its LISTEN was active; an event committed
    in between notified no one and waited for the poll interval (here 60 s)."""
    rs.reset_relay_tables(engine)
    writer = rs.writer_for("relay-lanes-listen")
    config = rs.config(database_url, "unused:9092", lanes=1, poll_interval_s=60.0)
    publisher = InMemoryPublisher()
    late: list[_LateListenStore] = []

    def listen_late(inner: RelayStore) -> RelayStore:
        late.append(_LateListenStore(inner))
        return late[-1]

    relay = Relay(
        config, publisher=publisher, store_factory=_factory(config, "listen", listen_late)
    )
    (listen,) = late
    task = asyncio.create_task(relay.run())
    try:

        async def holds_shards() -> bool:
            return bool(relay.owned_shards())

        await poll_until(holds_shards, within=30, what="shards acquired")
        await asyncio.sleep(0.5)  # the lane claimed (nothing) and waits
        rs.stage(engine, writer, [rs.event(writer, "late", 1)])
        listen.go.set()

        async def published() -> bool:
            return len(publisher.records) == 1

        await poll_until(published, within=10, what="the event published")
    finally:
        relay.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
