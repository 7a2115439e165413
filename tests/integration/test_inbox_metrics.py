"""The inbox's lock and latency metrics move, on real PostgreSQL (docs/observability.md)."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer, Outcome
from ledgerbox.inbox._metrics import (
    EVENT_LATENCY,
    LAG,
    LOCK_ACQUIRED,
    LOCK_CONTENDED,
    LOCK_EXPIRED,
    REPLAYED,
)
from ledgerbox.inbox.testing import (
    InMemoryAggregateLock,
    InMemoryDeadLetterPublisher,
    InMemoryDedupStore,
    ManualClock,
    record_for,
)
from ledgerbox.outbox import EventEnvelope
from tests._inbox_support import order_event, poll, produce


def _value(counter: Any, group: str) -> float:
    return float(counter.labels(group)._value.get())


def _consumer(database_url: str, redis_url: str, group: str, lock: InMemoryAggregateLock) -> Any:
    return InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=["unused"],
            database_url=database_url,
            kafka_bootstrap_servers="127.0.0.1:1",
            redis_url=redis_url,
            lock_aggregates=True,
            lock_ttl_ms=300,
            lock_wait_ms=5000,
        ),
        dedup=InMemoryDedupStore(),
        lock=lock,
    )


async def test_lock_acquired_contended_and_expired_while_running(
    database_url: str, redis_url: str
) -> None:
    group = f"g-lock-{uuid.uuid4().hex[:8]}"
    clock = ManualClock(1000.0)
    lock = InMemoryAggregateLock(clock)
    consumer = _consumer(database_url, redis_url, group, lock)
    expire = asyncio.Event()

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        if event.payload["order_id"] == "3" and not expire.is_set():
            expire.set()
            clock.advance(1.0)  # past lock_ttl_ms: the next renewal finds it gone
            await asyncio.sleep(0.4)  # a renewal runs every lock_ttl_ms / 3

    try:
        # 1: a free lock.
        assert await consumer.process_record(record_for(order_event("t", "1"))) is Outcome.APPLIED
        assert (_value(LOCK_ACQUIRED, group), _value(LOCK_CONTENDED, group)) == (1, 0)

        # 2: the aggregate's lock is taken by another worker until it is released.
        event = order_event("t", "2")
        other = await lock.acquire(f"{group}:order:2", 60_000)
        assert other is not None
        task = asyncio.create_task(consumer.process_record(record_for(event)))
        await asyncio.sleep(0.1)
        assert _value(LOCK_CONTENDED, group) == 1 and not task.done()
        await lock.release(other)
        assert await asyncio.wait_for(task, 10) is Outcome.APPLIED
        assert (_value(LOCK_ACQUIRED, group), _value(LOCK_CONTENDED, group)) == (2, 1)

        # 3: the lock expires while the handler runs.
        assert _value(LOCK_EXPIRED, group) == 0
        await consumer.process_record(record_for(order_event("t", "3")))
        assert _value(LOCK_EXPIRED, group) >= 1
    finally:
        await consumer.aclose()


async def test_event_latency_is_observed_after_the_commit(
    database_url: str, redis_url: str
) -> None:
    group = f"g-lat-{uuid.uuid4().hex[:8]}"
    consumer = _consumer(database_url, redis_url, group, InMemoryAggregateLock())

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        return None

    old = order_event("t", "9").model_copy(
        update={"occurred_at": dt.datetime.now(dt.UTC) - dt.timedelta(seconds=42)}
    )
    try:
        assert await consumer.process_record(record_for(old)) is Outcome.APPLIED
        assert await consumer.process_record(record_for(old)) is Outcome.DUPLICATE
    finally:
        await consumer.aclose()
    samples = {
        (s.name, s.labels.get("le")): s.value
        for metric in EVENT_LATENCY.collect()
        for s in metric.samples
        if s.labels.get("group") == group
    }
    assert samples[("ledgerbox_inbox_event_latency_seconds_count", None)] == 1  # not the dup
    assert 42 <= samples[("ledgerbox_inbox_event_latency_seconds_sum", None)] < 60
    assert samples[("ledgerbox_inbox_event_latency_seconds_bucket", "30.0")] == 0
    assert samples[("ledgerbox_inbox_event_latency_seconds_bucket", "60.0")] == 1


async def test_lag_gauge_counts_records_not_applied_then_drops_to_zero(
    database_url: str, kafka_bootstrap: str, new_topic: Any
) -> None:
    topic = await new_topic.acreate("inbox-lag", partitions=1)
    group = f"g-lag-{uuid.uuid4().hex[:8]}"
    await produce(kafka_bootstrap, topic, [order_event(topic, str(i)) for i in range(6)])
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=database_url,
            kafka_bootstrap_servers=kafka_bootstrap,
            commit_interval_ms=20,
            batch_max_records=1,
        )
    )
    gate = asyncio.Event()
    seen: list[str] = []

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        seen.append(event.payload["order_id"])
        if event.payload["order_id"] == "2":
            await gate.wait()  # records 2..5 are not applied while it waits

    lag = LAG.labels(group, topic, "0")
    task = asyncio.create_task(consumer.run())
    try:

        async def stuck() -> bool:
            return "2" in seen and lag._value.get() == 4

        await poll(stuck, "lag 4 while the handler of record 2 waits", within_s=30)
        gate.set()

        async def drained() -> bool:
            return len(seen) == 6 and lag._value.get() == 0

        await poll(drained, "lag 0 once every record is applied", within_s=30)
    finally:
        gate.set()
        consumer.stop()
        await asyncio.wait_for(task, 60)
    assert not any(s.labels.get("group") == group for m in LAG.collect() for s in m.samples), (
        "the series goes when the partition is given up"
    )


async def test_replayed_counts_an_operators_replay_once_per_path(
    database_url: str, redis_url: str
) -> None:
    group = f"g-replay-{uuid.uuid4().hex[:8]}"
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=["unused"],
            database_url=database_url,
            kafka_bootstrap_servers="127.0.0.1:1",
            dead_letter_on=(ValueError,),
            batch_max_records=10,
        ),
        dead_letters=InMemoryDeadLetterPublisher(),
    )
    broken = {"1", "2", "3"}

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        if event.payload["order_id"] in broken:
            raise ValueError("bad amount")

    one, two, three = (order_event("t", i) for i in ("1", "2", "3"))
    try:
        for event in (one, two, three):
            outcome = await consumer.process_record(record_for(event))
            assert outcome is Outcome.DEAD_LETTERED
        assert await consumer.request_replay([one.event_id, two.event_id, three.event_id]) == 3
        broken.clear()
        # A first delivery is not a replay; the per-message path, then a batch of two.
        assert await consumer.process_record(record_for(order_event("t", "4"))) is Outcome.APPLIED
        assert _value(REPLAYED, group) == 0
        assert await consumer.process_record(record_for(one)) is Outcome.APPLIED
        assert _value(REPLAYED, group) == 1
        outcomes = await consumer.process_batch(
            [record_for(two, offset=1), record_for(three, offset=2)]
        )
        assert outcomes == [Outcome.APPLIED, Outcome.APPLIED]
        assert _value(REPLAYED, group) == 3
        assert await consumer.process_record(record_for(one)) is Outcome.DUPLICATE
        assert _value(REPLAYED, group) == 3
    finally:
        await consumer.aclose()
