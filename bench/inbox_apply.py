"""Inbox apply rate vs a plain consumer doing the same business update without dedup.

One topic (1 partition) holds ``RECORDS`` events. Each round consumes all of them three ways,
each with a fresh consumer group, against the same database and the same records:

- ``plain``: ``AIOKafkaConsumer`` (manual commits), one transaction per record running the
  business ``UPDATE account SET balance = balance + :amount``; no inbox, no Redis;
- ``inbox``: :class:`inbox.InboxConsumer` without Redis (inbox row + the same UPDATE), with
  its default batching (records already waiting on a partition share one transaction);
- ``inbox_unbatched``: the same with ``batch_max_records=1`` (one transaction per record,
  like ``plain``), to show what the inbox itself costs;
- ``inbox_redis``: the same with Redis (dedup hint, in-progress marker, "done" key).

The clock runs from the first record's processing to the last record's commit, so the group
join (seconds, identical for all) is not measured. Variants are interleaved per round and the
median of the per-round ratios is reported. Target: ``inbox_vs_plain_ratio >= 0.7``.

Run: ``python -m bench inbox_apply`` (services up; ``DATABASE_URL``, ``KAFKA_BOOTSTRAP_SERVERS``,
``REDIS_URL`` set).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from bench._common import fresh_database, kafka_bootstrap, median, write_result
from inbox import ConsumerConfig, HandlerContext, InboxConsumer
from inbox._consumer import ConsumerHooks
from inbox._metrics import PROCESSED
from inbox.testing import kafka_parts
from outbox import EventEnvelope, OutboxWriter, TopicRouter

RECORDS = int(os.environ.get("BENCH_INBOX_RECORDS", "2000"))
ROUNDS = int(os.environ.get("BENCH_INBOX_ROUNDS", "3"))
ACCOUNTS = 50
UPDATE = sa.text("UPDATE bench_account SET balance = balance + :amount WHERE id = :id")


async def _setup(url: str, bootstrap: str) -> str:
    engine = create_async_engine(url)
    async with engine.begin() as conn:
        await conn.execute(
            sa.text("CREATE TABLE bench_account (id text PRIMARY KEY, balance numeric NOT NULL)")
        )
        await conn.execute(
            sa.text("INSERT INTO bench_account SELECT 'a' || g, 0 FROM generate_series(0, :n) g"),
            {"n": ACCOUNTS},
        )
    await engine.dispose()
    topic = f"bench-inbox-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()
    writer = OutboxWriter(TopicRouter(default=topic), source="/bench")
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        for i in range(RECORDS):
            event = writer.event(
                event_type="Credited",
                aggregate_type="account",
                aggregate_id=f"a{i % ACCOUNTS}",
                payload={"amount": "1.00"},
                idempotency_key=f"bench:{topic}:{i}",
            )
            key, value, headers = kafka_parts(event)
            await producer.send(topic, value=value, key=key, headers=headers)
        await producer.flush()
    finally:
        await producer.stop()
    return topic


async def _plain(engine: AsyncEngine, bootstrap: str, topic: str) -> float:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"plain-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    done, started = 0, 0.0
    try:
        while done < RECORDS:
            batches = await consumer.getmany(timeout_ms=100, max_records=500)
            for records in batches.values():
                for record in records:
                    if not started:
                        started = time.perf_counter()
                    # The same parse and the same business write as the inbox handler.
                    from outbox import envelope_from_kafka

                    event = envelope_from_kafka(
                        record.topic, record.key, record.value, list(record.headers)
                    )
                    async with engine.begin() as conn:
                        await conn.execute(
                            UPDATE,
                            {"amount": Decimal(event.payload["amount"]), "id": event.aggregate_id},
                        )
                    done += 1
            if batches:
                await consumer.commit()
        return time.perf_counter() - started
    finally:
        await consumer.stop()


async def _inbox(
    url: str, bootstrap: str, topic: str, redis_url: str | None, batch: int = 100
) -> float:
    group = f"inbox-{uuid.uuid4().hex[:8]}"
    started: list[float] = []

    async def first(ctx: HandlerContext[Any]) -> None:
        if not started:
            started.append(time.perf_counter())

    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=url,
            kafka_bootstrap_servers=bootstrap,
            redis_url=redis_url,
            redis_key_prefix=f"bench:{group}:",
            batch_max_records=batch,
        ),
        hooks=ConsumerHooks(after_begin=first),
    )

    @consumer.handler("Credited")
    async def credit(ctx: HandlerContext[Any], event: EventEnvelope) -> None:
        await ctx.session.execute(
            UPDATE, {"amount": Decimal(event.payload["amount"]), "id": event.aggregate_id}
        )

    task = asyncio.create_task(consumer.run())
    try:
        while PROCESSED.labels(group)._value.get() < RECORDS:
            if task.done():
                task.result()
            await asyncio.sleep(0.005)
        return time.perf_counter() - started[0]
    finally:
        consumer.stop()
        await task


async def _main() -> dict[str, Any]:
    bootstrap = kafka_bootstrap()
    redis_url = os.environ.get("REDIS_URL")
    with fresh_database("bench_inbox") as url:
        topic = await _setup(url, bootstrap)
        engine = create_async_engine(url)
        plain_s: list[float] = []
        inbox_s: list[float] = []
        redis_s: list[float] = []
        single_s: list[float] = []
        try:
            for _ in range(ROUNDS):
                plain_s.append(await _plain(engine, bootstrap, topic))
                inbox_s.append(await _inbox(url, bootstrap, topic, None))
                single_s.append(await _inbox(url, bootstrap, topic, None, batch=1))
                if redis_url:
                    redis_s.append(await _inbox(url, bootstrap, topic, redis_url))
        finally:
            await engine.dispose()
    ratios = [p / i for p, i in zip(plain_s, inbox_s, strict=True)]
    result: dict[str, Any] = {
        "inbox_records": RECORDS,
        "inbox_rounds": ROUNDS,
        "plain_consumer_events_per_s": RECORDS / median(plain_s),
        "inbox_events_per_s": RECORDS / median(inbox_s),
        "inbox_vs_plain_ratio": median(ratios),
        "inbox_unbatched_events_per_s": RECORDS / median(single_s),
        "inbox_unbatched_vs_plain_ratio": median(
            [p / u for p, u in zip(plain_s, single_s, strict=True)]
        ),
        "inbox_raw_seconds": {
            "plain": plain_s,
            "inbox": inbox_s,
            "inbox_unbatched": single_s,
            "inbox_redis": redis_s,
        },
    }
    if redis_s:
        result["inbox_redis_events_per_s"] = RECORDS / median(redis_s)
        result["inbox_redis_vs_plain_ratio"] = median(
            [p / r for p, r in zip(plain_s, redis_s, strict=True)]
        )
    return result


def run() -> dict[str, Any]:
    """Run the benchmark; return the figures (events/s and ratios, raw seconds per round)."""
    result = asyncio.run(_main())
    write_result("inbox_apply", result)
    return result


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
