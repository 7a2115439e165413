"""The relay against real PostgreSQL and Kafka: record form, run_once, NOTIFY wake-up."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import random
from collections.abc import AsyncIterator

from sqlalchemy import Engine, text

from ledgerbox.outbox import envelope_from_kafka, kafka_headers, timestamp_ms
from ledgerbox.relay import Relay
from ledgerbox.relay._pgstore import PgRelayStore
from ledgerbox.relay._record import to_record
from ledgerbox.relay._store import Cursor, ShardRead
from ledgerbox.relay.testing import InMemoryPublisher
from tests import _relay_support as rs
from tests._services import TopicFactory


async def test_published_record_has_key_value_timestamp_headers(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("relay-rec", partitions=3)
    writer = rs.writer_for(topic)
    when = dt.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=dt.UTC)
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    ev = writer.event(
        event_type="OrderPlaced",
        aggregate_type="order",
        aggregate_id="order-17",
        aggregate_version=3,
        payload={"amount": "100.00", "items": [1, 2], "note": "naïve ✓"},
        idempotency_key="order:17:req-1",
        occurred_at=when,
        headers={"traceparent": traceparent},
    )
    rs.stage(engine, writer, [ev])

    relay = Relay(rs.config(database_url, kafka_bootstrap))
    try:
        assert await relay.run_once() == 1
        assert await relay.run_once() == 0
    finally:
        await relay.aclose()
    records = await rs.consume(kafka_bootstrap, topic, until=lambda r: len(r) >= 1)
    assert len(records) == 1
    record = records[0]
    assert record.key == b"order-17"
    assert json.loads(record.value) == {"amount": "100.00", "items": [1, 2], "note": "naïve ✓"}
    assert record.timestamp == timestamp_ms(when)
    assert rs.header(record, "traceparent") == traceparent
    assert rs.header(record, "ce_id") == str(ev.event_id)
    assert rs.header(record, "ce_idempotencykey") == "order:17:req-1"
    assert rs.header(record, "ce_specversion") == "1.0"
    assert rs.header(record, "content-type") == "application/json"
    back = envelope_from_kafka(topic, record.key, record.value, list(record.headers))
    assert back == ev
    with engine.connect() as conn:
        (row_id,) = conn.execute(
            text("SELECT id FROM outbox WHERE event_id = :e"), {"e": ev.event_id}
        ).one()
    assert rs.published_ids(engine, topic) == [row_id], "the persisted cursor passed it"
    assert rs.pending_count(engine) == 0


async def test_run_once_publishes_one_batch_in_key_order(engine: Engine, database_url: str) -> None:
    rs.reset_relay_tables(engine)
    writer = rs.writer_for("relay-run-once")
    events = [rs.event(writer, f"k{i % 3}", i) for i in range(7)]
    rs.stage(engine, writer, events)
    publisher = InMemoryPublisher()
    # One lane: one batch per cycle (tests/integration/test_relay_lanes.py covers several).
    config = rs.config(database_url, "unused:9092", batch_size=5, lanes=1)
    relay = Relay(config, publisher=publisher)
    try:
        assert await relay.run_once() == 5
        assert await relay.run_once() == 2
        assert await relay.run_once() == 0
        assert relay.is_leader()
        assert len(relay.owned_shards()) == 64
    finally:
        await relay.aclose()
    seen: dict[bytes, list[int]] = {}
    for record in publisher.records:
        seen.setdefault(record.key, []).append(json.loads(record.value)["seq"])
    assert seen == {b"k0": [0, 3, 6], b"k1": [1, 4], b"k2": [2, 5]}
    with engine.connect() as conn:
        owners = conn.execute(
            text("SELECT count(*) FROM outbox_relay_lease WHERE owner IS NOT NULL")
        )
        assert owners.scalar_one() == 0, "close() releases every lease"


async def test_notify_wakes_an_idle_relay(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("relay-notify", partitions=1)
    writer = rs.writer_for(topic)
    # Polling every 60 s: only NOTIFY can make the relay see the event within the deadline.
    async with _polling_off_relay(database_url, kafka_bootstrap):
        await asyncio.sleep(0.5)  # let the main loop go idle (waiting on its 60 s poll)
        rs.stage(engine, writer, [rs.event(writer, "wake", 1)])
        records = await rs.consume(kafka_bootstrap, topic, until=lambda r: len(r) >= 1, within_s=20)
        assert records[0].key == b"wake"


async def test_a_stream_of_commits_is_published_without_polling(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    """The listener pauses its reads while the lanes are busy (relay._wakeup): no wake-up
    may be lost. With polling every 60 s, commits arriving one by one while batches are in
    flight must all go out on notifications alone."""
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("relay-stream", partitions=3)
    writer = rs.writer_for(topic)
    async with _polling_off_relay(database_url, kafka_bootstrap):
        rng = random.Random(7)
        for i in range(150):  # one transaction per event, gaps from 0 to 4 ms
            await asyncio.to_thread(rs.stage, engine, writer, [rs.event(writer, f"k{i % 7}", i)])
            await asyncio.sleep(rng.choice([0, 0, 0.001, 0.004]))
        await asyncio.sleep(1.5)  # the relay goes idle between the last commits
        rs.stage(engine, writer, [rs.event(writer, "last", 1)])
        records = await rs.consume(
            kafka_bootstrap, topic, until=lambda r: len(r) >= 151, within_s=30
        )
        assert len(records) == 151
        assert {r.key for r in records} >= {b"last"}


@contextlib.asynccontextmanager
async def _polling_off_relay(database_url: str, kafka_bootstrap: str) -> AsyncIterator[Relay]:
    """A relay that polls every 60 s (only NOTIFY wakes it), running with all 64 shards for
    the body; stopped afterwards."""
    relay = Relay(rs.config(database_url, kafka_bootstrap, poll_interval_s=60.0))
    task = asyncio.create_task(relay.run())
    try:

        async def with_shards() -> bool:
            return len(relay.owned_shards()) == 64

        await _until(with_shards, 20)
        yield relay
    finally:
        relay.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)


async def _until(check, within_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + within_s
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.05)


async def test_claimed_record_is_byte_identical_to_kafka_headers(
    engine: Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """The claim pre-formats fields in SQL; the record must equal the Python wire form."""
    rs.reset_relay_tables(engine)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox"))
    writer = rs.writer_for("relay-form")
    cet = dt.timezone(dt.timedelta(hours=1))
    times = [
        dt.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=dt.UTC),
        dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC),  # no fraction in isoformat
        dt.datetime(2026, 6, 30, 23, 59, 59, 999999, tzinfo=cet),  # not UTC on the way in
        dt.datetime(1969, 12, 31, 23, 59, 59, 500001, tzinfo=dt.UTC),  # before the epoch
        dt.datetime(2024, 2, 29, 12, 0, 0, 697000, tzinfo=dt.UTC),  # float edge of * 1000
    ]
    events = [
        writer.event(
            event_type="OrderPlaced",
            aggregate_type="order",
            aggregate_id=f"order-{i}",
            aggregate_version=None if i % 2 else i,
            payload={"i": i, "note": "naïve ✓"},
            idempotency_key=f"form:{i}",
            occurred_at=when,
            headers={} if i % 2 else {"traceparent": f"00-{i:032x}-{i:016x}-01", "ce_id": "x"},
        )
        for i, when in enumerate(times)
    ]
    rs.stage(engine, writer, events)
    config = rs.config(database_url, kafka_bootstrap)
    store = PgRelayStore(config)
    try:
        reads = [ShardRead(s, Cursor(None)) for s in range(config.shard_count)]
        claimed = (await store.claim_batch(reads, 100, hold=True)).events
    finally:
        await store.aclose()
    by_id = {c.event_id: c for c in claimed}
    assert len(by_id) == len(events)
    for ev in events:
        record = to_record(by_id[str(ev.event_id)])
        assert record.key == ev.partition_key.encode()
        assert json.loads(record.value) == ev.payload
        assert record.timestamp_ms == timestamp_ms(ev.occurred_at)
        assert record.headers == kafka_headers(
            event_id=ev.event_id,
            event_type=ev.event_type,
            source=ev.source,
            occurred_at=ev.occurred_at.astimezone(dt.UTC),
            idempotency_key=ev.idempotency_key,
            aggregate_type=ev.aggregate_type,
            aggregate_id=ev.aggregate_id,
            aggregate_version=ev.aggregate_version,
            extra=ev.headers,
        )


async def test_the_relay_sessions_never_jit_compile(
    engine: Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """PostgreSQL JIT-compiles a statement once its estimated cost passes jit_above_cost, and
    the estimates grow with the rows the outbox keeps: the relay's gauges over 300,000
    published rows spent 310 of 311 ms compiling a 0.6 ms query. Every relay session runs
    with jit off (docs/performance.md)."""
    config = rs.config(database_url, kafka_bootstrap)
    query = "EXPLAIN (ANALYZE, FORMAT JSON) SELECT sum(g) FROM generate_series(1, 1000) AS g"
    with engine.connect() as conn:  # a session of the server's defaults, JIT forced
        conn.execute(text("SET jit_above_cost = 0"))
        plain = json.dumps(conn.execute(text(query)).scalar_one())
    for role in ("main", "mark0", "lease", "maint", "listen", "status"):
        store = PgRelayStore(config, role)
        try:
            session = await store._connection()
            await session.execute("SET jit_above_cost = 0")
            cur = await session.execute(query)
            row = await cur.fetchone()
            assert row is not None
            assert '"JIT"' not in json.dumps(row[0]), role
        finally:
            await store.aclose()
    # The premise: this server compiles such a statement when JIT is not switched off.
    assert '"JIT"' in plain
