"""Inbox apply rate vs a plain consumer doing the same business update without dedup.

One topic (1 partition) holds ``RECORDS`` events. Each round consumes all of them once per
variant, each with a fresh consumer group (manually assigned partition: no group join), against
the same database and the same records. Every inbox variant is compared with the plain consumer
of the SAME transaction structure:

============================  ===================================================================
variant                       what one transaction holds
============================  ===================================================================
``plain``                     up to ``BATCH`` records of the partition: the business
                              ``UPDATE account SET balance = balance + :amount`` for each;
                              no inbox row, no dedup, no Redis (``AIOKafkaConsumer``, manual
                              offset commits)
``plain_unbatched``           one record: its ``UPDATE``
``inbox``                     :class:`inbox.InboxConsumer` without Redis, ``batch_max_records =
                              BATCH``: one inbox insert for the batch + the same ``UPDATE`` s
``inbox_unbatched``           the same with ``batch_max_records=1``: inbox row + ``UPDATE``
``inbox_redis``               ``inbox`` with Redis (dedup hint, "done" keys)
``inbox_redis_unbatched``     ``inbox_unbatched`` with Redis (hint, in-progress marker, "done")
============================  ===================================================================

Both sides parse the envelope of every record. The clock runs from the first record handed to
processing to the last record's database commit (inbox: the ``after_commit`` hook), so fetch
start-up is not measured. A warm-up round is run first and discarded; in each round the batched
variants run back to back, then the unbatched ones, in an order rotated every round; every
ratio is the median of the per-round ratios ``plain seconds / inbox seconds`` of the matched
pair. The consumer process's CPU time per event is reported too: on a shared machine it is
steadier than wall time.

Keys read by ``python -m bench``: ``inbox_vs_plain_ratio`` (batched vs batched, target >= 0.9),
``inbox_redis_overhead_us_per_event`` (the consumer framework's overhead as users run it, with
Redis and the default batching: CPU per event minus the plain consumer's with the same batching,
target <= 150), ``inbox_unbatched_overhead_us_per_event`` and
``inbox_redis_unbatched_overhead_us_per_event`` (one record per transaction, shown without a
target), ``inbox_events_per_s``, ``plain_consumer_events_per_s``.

Run: ``python -m bench inbox_apply`` (services up; ``DATABASE_URL``, ``KAFKA_BOOTSTRAP_SERVERS``,
``REDIS_URL`` set). ``BENCH_INBOX_RECORDS`` (default 5000), ``BENCH_INBOX_ROUNDS`` (default 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from bench._common import fresh_database, kafka_bootstrap, median, write_result
from example_services.demo._kafka import delete_topics
from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer, Outcome
from ledgerbox.inbox._consumer import ConsumerHooks
from ledgerbox.inbox.testing import kafka_parts
from ledgerbox.outbox import EventEnvelope, OutboxWriter, TopicRouter, envelope_from_kafka

RECORDS = int(os.environ.get("BENCH_INBOX_RECORDS", "5000"))
ROUNDS = int(os.environ.get("BENCH_INBOX_ROUNDS", "3"))
BATCH = 100  # the inbox default batch_max_records
ACCOUNTS = 50
UPDATE = sa.text("UPDATE bench_account SET balance = balance + :amount WHERE id = :id")
# inbox variant: (plain variant of the same transaction structure, key of their ratio)
PAIRS = {
    "inbox": ("plain", "inbox_vs_plain_ratio"),
    "inbox_unbatched": ("plain_unbatched", "inbox_unbatched_vs_plain_unbatched_ratio"),
    "inbox_redis": ("plain", "inbox_redis_vs_plain_ratio"),
    "inbox_redis_unbatched": (
        "plain_unbatched",
        "inbox_redis_unbatched_vs_plain_unbatched_ratio",
    ),
}


#: inbox variant -> key of its framework overhead (CPU us per event over its plain pair).
OVERHEAD_KEYS = {
    "inbox": "inbox_overhead_us_per_event",
    "inbox_unbatched": "inbox_unbatched_overhead_us_per_event",
    "inbox_redis": "inbox_redis_overhead_us_per_event",
    "inbox_redis_unbatched": "inbox_redis_unbatched_overhead_us_per_event",
}


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


async def _plain(
    engine: AsyncEngine, bootstrap: str, topic: str, batch: int
) -> tuple[float, float]:
    """A hand-written consumer: ``batch`` records of the partition per transaction.

    Returns wall and CPU seconds from the first record to the last commit."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=f"plain-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    consumer.assign([TopicPartition(topic, 0)])
    await consumer.start()
    done, started, finished, cpu_started, cpu_finished = 0, 0.0, 0.0, 0.0, 0.0
    try:
        while done < RECORDS:
            batches = await consumer.getmany(timeout_ms=100, max_records=500)
            for records in batches.values():
                if not started:
                    started, cpu_started = time.perf_counter(), time.process_time()
                for i in range(0, len(records), batch):
                    async with engine.begin() as conn:
                        for record in records[i : i + batch]:
                            # The same parse and the same business write as the inbox handler.
                            event = envelope_from_kafka(
                                record.topic, record.key, record.value, list(record.headers)
                            )
                            await conn.execute(
                                UPDATE,
                                {
                                    "amount": Decimal(event.payload["amount"]),
                                    "id": event.aggregate_id,
                                },
                            )
                    done += len(records[i : i + batch])
                finished, cpu_finished = time.perf_counter(), time.process_time()
            if batches:
                await consumer.commit()
        return finished - started, cpu_finished - cpu_started
    finally:
        await consumer.stop()


async def _inbox(
    url: str, bootstrap: str, topic: str, redis_url: str | None, batch: int
) -> tuple[float, float]:
    """The inbox consumer; returns wall and CPU seconds from the first record's transaction
    to the last record's commit."""
    group = f"inbox-{uuid.uuid4().hex[:8]}"
    started: list[float] = []  # wall, CPU
    finished: list[float] = []
    count = 0
    all_done = asyncio.Event()

    async def first(ctx: HandlerContext[Any]) -> None:
        if not started:
            started.extend((time.perf_counter(), time.process_time()))

    async def committed(record: Any, outcome: Outcome) -> None:
        nonlocal count
        count += 1
        if count == RECORDS:
            finished.extend((time.perf_counter(), time.process_time()))
            all_done.set()

    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            assignment=[(topic, 0)],
            database_url=url,
            kafka_bootstrap_servers=bootstrap,
            redis_url=redis_url,
            redis_key_prefix=f"bench:{group}:",
            batch_max_records=batch,
        ),
        hooks=ConsumerHooks(after_begin=first, after_commit=committed),
    )

    @consumer.handler("Credited")
    async def credit(ctx: HandlerContext[Any], event: EventEnvelope) -> None:
        await ctx.session.execute(
            UPDATE, {"amount": Decimal(event.payload["amount"]), "id": event.aggregate_id}
        )

    task = asyncio.create_task(consumer.run())
    try:
        waiter = asyncio.create_task(all_done.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not all_done.is_set():
            waiter.cancel()
            task.result()  # the consumer died: surface why
            raise RuntimeError("inbox consumer stopped before applying every record")
        return finished[0] - started[0], finished[1] - started[1]
    finally:
        consumer.stop()
        await task


Variant = Callable[[], Awaitable[tuple[float, float]]]


def _groups(
    url: str, engine: AsyncEngine, bootstrap: str, topic: str, redis_url: str | None
) -> list[dict[str, Variant]]:
    # Variants compared with each other run next to each other: the machine is shared and
    # its load drifts, so a pair measured minutes apart would compare two machines.
    batched: dict[str, Variant] = {
        "plain": lambda: _plain(engine, bootstrap, topic, BATCH),
        "inbox": lambda: _inbox(url, bootstrap, topic, None, BATCH),
    }
    unbatched: dict[str, Variant] = {
        "plain_unbatched": lambda: _plain(engine, bootstrap, topic, 1),
        "inbox_unbatched": lambda: _inbox(url, bootstrap, topic, None, 1),
    }
    if redis_url:
        batched["inbox_redis"] = lambda: _inbox(url, bootstrap, topic, redis_url, BATCH)
        unbatched["inbox_redis_unbatched"] = lambda: _inbox(url, bootstrap, topic, redis_url, 1)
    return [batched, unbatched]


async def _main() -> dict[str, Any]:
    bootstrap = kafka_bootstrap()
    redis_url = os.environ.get("REDIS_URL")
    with fresh_database("bench_inbox") as url:
        topic = await _setup(url, bootstrap)
        engine = create_async_engine(url)
        try:
            groups = _groups(url, engine, bootstrap, topic, redis_url)
            seconds: dict[str, list[float]] = {name: [] for group in groups for name in group}
            cpu_s: dict[str, list[float]] = {name: [] for name in seconds}
            for round_no in range(ROUNDS + 1):  # round 0 warms up and is discarded
                for group in groups:
                    names = list(group)
                    shift = round_no % len(names)
                    for name in names[shift:] + names[:shift]:
                        wall, cpu = await group[name]()
                        if round_no:
                            seconds[name].append(wall)
                            cpu_s[name].append(cpu)
        finally:
            await engine.dispose()
            # A leftover topic costs Kafka CPU in every later run: delete it, best effort.
            with contextlib.suppress(Exception):
                await delete_topics(bootstrap, [topic])
    result: dict[str, Any] = {
        "inbox_records": RECORDS,
        "inbox_rounds": ROUNDS,
        "inbox_batch_records": BATCH,
        "plain_consumer_events_per_s": RECORDS / median(seconds["plain"]),
        "plain_unbatched_events_per_s": RECORDS / median(seconds["plain_unbatched"]),
        "inbox_raw_seconds": seconds,
        # Consumer process CPU per event (client side: Python, driver, event loop), medians.
        "inbox_cpu_us_per_event": {n: 1e6 * median(v) / RECORDS for n, v in cpu_s.items()},
    }
    for inbox_name, (plain_name, key) in PAIRS.items():
        if inbox_name not in seconds:
            continue
        result[f"{inbox_name}_events_per_s"] = RECORDS / median(seconds[inbox_name])
        ratios = [p / i for p, i in zip(seconds[plain_name], seconds[inbox_name], strict=True)]
        result[key] = median(ratios)
        # The framework's overhead: the consumer process's CPU per event minus the plain
        # consumer's of the same transaction structure, per round (side by side), median.
        extra = [
            1e6 * (i - p) / RECORDS
            for p, i in zip(cpu_s[plain_name], cpu_s[inbox_name], strict=True)
        ]
        result[OVERHEAD_KEYS[inbox_name]] = median(extra)
    return result


def run() -> dict[str, Any]:
    """Run the benchmark; return the figures (events/s and ratios, raw seconds per round)."""
    result = asyncio.run(_main())
    write_result("inbox_apply", result)
    return result


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
