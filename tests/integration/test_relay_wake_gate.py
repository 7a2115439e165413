"""The wake gate against real PostgreSQL and Kafka (relay._gate, docs/relay.md "Wake gate").

Every relay here polls every 60 s: an event published within the deadline went out on a
notification or on the short poll of an open gate, never on the 60 s poll. What would fail:
a relay that waits for notifications while writers skip them (a lost wake-up).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import Engine

from ledgerbox.outbox import shard_of
from ledgerbox.relay import Relay
from ledgerbox.relay._gate import GateState
from tests import _relay_support as rs
from tests._services import TopicFactory


@contextlib.asynccontextmanager
async def _relays(database_url: str, kafka_bootstrap: str, n: int) -> AsyncIterator[list[Relay]]:
    relays = [
        Relay(rs.config(database_url, kafka_bootstrap, relay_id=f"gate-{i}", poll_interval_s=60.0))
        for i in range(n)
    ]
    tasks = [asyncio.create_task(r.run()) for r in relays]
    try:
        deadline = asyncio.get_running_loop().time() + 30
        # Balanced (64 / n each): a lease taken later wakes the lanes that take it, which
        # would hide a lost wake-up.
        while any(len(r.owned_shards()) != 64 // n for r in relays):
            assert asyncio.get_running_loop().time() < deadline, "shards not shared out"
            await asyncio.sleep(0.05)
        yield relays
    finally:
        for relay in relays:
            relay.stop()
        for task in tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 30)


def _states(relays: list[Relay]) -> list[GateState]:
    return [r._gate.state for r in relays]


async def _settled(relays: list[Relay], within_s: float = 10) -> None:
    """Until one relay holds the gate and the others are covered (writers notify)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while sorted(s.value for s in _states(relays)) != sorted(
        ["guarded"] + ["covered"] * (len(relays) - 1)
    ):
        assert asyncio.get_running_loop().time() < deadline, _states(relays)
        await asyncio.sleep(0.02)


async def test_two_relays_miss_no_commit_while_the_gate_closes_opens_and_closes(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("relay-gate", partitions=4)
    writer = rs.writer_for(topic)
    keys = [f"k{i}" for i in range(40)]  # on shards of both relays
    async with _relays(database_url, kafka_bootstrap, 2) as relays:
        await _settled(relays)
        # Quiet: one commit at a time; each goes out on its notification.
        for i, key in enumerate(keys[:10]):
            await asyncio.to_thread(rs.stage, engine, writer, [rs.event(writer, key, i)])
            await asyncio.sleep(0.05)
        # A burst from 4 writers: the relays' rates pass OPEN_RATE and they let the gate go.
        seen_open: set[int] = set()

        async def watch() -> None:
            while True:
                seen_open.update(i for i, s in enumerate(_states(relays)) if s is GateState.OPEN)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())

        def write(part: int) -> None:
            for n in range(600):
                key = keys[part * 10 + n % 10]  # a key is one writer's: seq order = commits
                rs.stage(engine, writer, [rs.event(writer, key, 100 + part * 1000 + n)])

        with ThreadPoolExecutor(4) as pool:
            await asyncio.gather(
                *(asyncio.get_running_loop().run_in_executor(pool, write, p) for p in range(4))
            )
        # Quiet again: the gate closes; single commits on every key go out at once.
        await _settled(relays)
        watcher.cancel()
        for i, key in enumerate(keys):
            await asyncio.to_thread(rs.stage, engine, writer, [rs.event(writer, key, 9000 + i)])
            await asyncio.sleep(0.01)
        total = 10 + 4 * 600 + len(keys)
        records = await rs.consume(
            kafka_bootstrap, topic, until=lambda r: len(r) >= total, within_s=30
        )
    assert seen_open, "the burst never opened a gate: the test did not test the open path"
    by_key: dict[bytes, list[int]] = {}
    for record in records:
        assert record.key is not None
        by_key.setdefault(record.key, []).append(json.loads(record.value)["seq"])
    assert sum(len(v) for v in by_key.values()) == total
    for seqs in by_key.values():
        assert seqs == sorted(seqs), "per-key commit order"


async def test_a_writer_in_flight_keeps_the_gate_open_and_other_keys_still_flow(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    """A transaction that skipped its NOTIFY holds the gate in SHARE mode until it ends: no
    relay can take the gate meanwhile, so the relay polls (open) and the commits of other
    keys, which skip their NOTIFY too, still go out; the long one goes out after its
    commit."""
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("relay-gate-long", partitions=2)
    writer = rs.writer_for(topic)
    with engine.connect() as conn:
        tx = conn.begin()
        writer.stage(conn, rs.event(writer, "long", 1))  # no relay holds the gate: SHARE
        async with _relays(database_url, kafka_bootstrap, 1) as relays:
            for i in range(5):
                await asyncio.to_thread(rs.stage, engine, writer, [rs.event(writer, "other", i)])
            records = await rs.consume(
                kafka_bootstrap, topic, until=lambda r: len(r) >= 5, within_s=20
            )
            assert [r.key for r in records] == [b"other"] * 5
            assert _states(relays) == [GateState.OPEN], "the writer in flight holds SHARE"
            tx.commit()
            await _settled(relays)
            records = await rs.consume(
                kafka_bootstrap, topic, until=lambda r: len(r) >= 6, within_s=20
            )
            assert b"long" in {r.key for r in records}


async def test_a_covered_relay_polls_as_soon_as_the_holder_lets_the_gate_go(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    """A burst on the holder's shards only: the holder lets the gate go (writers stop
    notifying) while the covered relay stays idle. Its release notification must end the
    cover at once: an event on the covered relay's shards, committed during the burst,
    goes out without a notification of its own."""
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("relay-gate-cover", partitions=2)
    writer = rs.writer_for(topic)
    async with _relays(database_url, kafka_bootstrap, 2) as relays:
        await _settled(relays)
        holder, covered = sorted(relays, key=lambda r: r._gate.state is not GateState.GUARDED)
        hot = [k for k in (f"h{i}" for i in range(400)) if shard_of(k, 64) in holder.owned_shards()]
        cold = next(
            k for k in (f"c{i}" for i in range(400)) if shard_of(k, 64) in covered.owned_shards()
        )
        stop = False

        def burst(part: int) -> None:
            n = 0
            while not stop:
                rs.stage(engine, writer, [rs.event(writer, hot[part], n)])
                n += 1

        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(4) as pool:
            writers = [loop.run_in_executor(pool, burst, p) for p in range(4)]
            try:
                deadline = loop.time() + 20
                while holder._gate.state is not GateState.OPEN:
                    assert loop.time() < deadline, "the burst never opened the holder's gate"
                    await asyncio.sleep(0.005)
                # The burst goes on without notifications; the covered relay has read those
                # sent before the release (its listener reads them in batches).
                await asyncio.sleep(1.0)
                await asyncio.to_thread(rs.stage, engine, writer, [rs.event(writer, cold, 1)])
                records = await rs.consume(
                    kafka_bootstrap,
                    topic,
                    until=lambda r: any(x.key == cold.encode() for x in r),
                    within_s=15,
                )
                assert cold.encode() in {r.key for r in records}
            finally:
                stop = True
                await asyncio.gather(*writers)
