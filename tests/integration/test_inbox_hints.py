"""Redis on the inbox's hot path, against real PostgreSQL, Kafka and Redis (inbox._hints):
records read in order cost no Redis read, a redelivery and a copy are caught by the hints,
and every applied event's "done" key is written after its commit."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata
from redis.asyncio import Redis
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncSession

from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer, RedisDedupStore
from ledgerbox.inbox._metrics import DUPLICATES, PROCESSED
from ledgerbox.outbox import EventEnvelope
from tests._inbox_support import committed, order_event, poll, produce

metadata = sa.MetaData()
applied = sa.Table(
    "it_hint_applied",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("consumer_group", sa.Text, nullable=False),
    sa.Column("order_id", sa.Text, nullable=False),
)


class CountingStore(RedisDedupStore):
    """The real Redis store, counting the reads made before the database."""

    def __init__(self, client: Redis, prefix: str) -> None:
        super().__init__(client, prefix)
        self.reads = 0

    async def done_among(self, group: str, event_ids: list[uuid.UUID]) -> set[uuid.UUID]:
        self.reads += 1
        return await super().done_among(group, event_ids)

    async def is_done(self, group: str, event_id: uuid.UUID) -> bool:
        self.reads += 1
        return await super().is_done(group, event_id)

    async def claim(self, group: str, event_id: uuid.UUID, owner: str, ttl_ms: int) -> bool:
        self.reads += 1
        return await super().claim(group, event_id, owner, ttl_ms)


def paying(consumer: InboxConsumer) -> InboxConsumer:
    """``consumer`` with the test's ``OrderPlaced`` handler (one row in ``applied``)."""

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        await ctx.session.execute(
            sa.insert(applied).values(
                consumer_group=ctx.group_id, order_id=event.payload["order_id"]
            )
        )

    return consumer


def consumer_for(
    database_url: str, bootstrap: str, topic: str, group: str, store: CountingStore
) -> InboxConsumer:
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=database_url,
            kafka_bootstrap_servers=bootstrap,
            commit_interval_ms=20,
            batch_max_records=10,
        ),
        dedup=store,
    )
    return paying(consumer)


def applied_ids(engine: Engine, group: str) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.scalars(
                sa.select(applied.c.order_id)
                .where(applied.c.consumer_group == group)
                .order_by(applied.c.id)
            )
        )


@contextlib.asynccontextmanager
async def consuming(consumer: InboxConsumer) -> AsyncIterator[None]:
    """Run ``consumer`` for the body; then stop it and wait (its close sends the hints)."""
    task = asyncio.create_task(consumer.run())
    try:
        yield
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 60)


async def until_committed(bootstrap: str, group: str, topic: str, n: int) -> None:
    async def caught_up() -> bool:
        return await committed(bootstrap, group, topic) == n

    await poll(caught_up, f"offset {n} committed")


async def rewind(bootstrap: str, group: str, topic: str) -> None:
    kafka = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group)
    kafka.assign([TopicPartition(topic, 0)])
    await kafka.start()
    try:
        await kafka.commit({TopicPartition(topic, 0): OffsetAndMetadata(0, "")})
    finally:
        await kafka.stop()


async def test_in_order_records_read_no_hint_and_a_redelivery_is_caught_by_them(
    database_url: str,
    engine: Engine,
    kafka_bootstrap: str,
    new_topic: Any,
    redis_client: Redis,
    redis_prefix: str,
) -> None:
    metadata.create_all(engine)
    topic = await new_topic.acreate("inbox-hints", partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    events = [order_event(topic, str(i)) for i in range(60)]
    first = CountingStore(redis_client, redis_prefix)
    async with consuming(consumer_for(database_url, kafka_bootstrap, topic, group, first)):
        for start in range(0, 60, 6):  # several fetches, so several batches
            await produce(kafka_bootstrap, topic, events[start : start + 6])
            await asyncio.sleep(0.05)
        await until_committed(kafka_bootstrap, group, topic, 60)
    assert applied_ids(engine, group) == [str(i) for i in range(60)]
    assert PROCESSED.labels(group)._value.get() == 60
    # Only the partition's first batch (new to this consumer) asked Redis: the records
    # that followed in order went to the database alone.
    assert first.reads == 1, first.reads
    # Every applied event has its "done" key (written after the commits; the last ones
    # by the consumer's close).
    keys = [f"{redis_prefix}inbox:{group}:done:{e.event_id}" for e in events]
    assert await redis_client.exists(*keys) == 60
    ttl_ms = await redis_client.pttl(keys[0])
    assert 0 < ttl_ms <= 86_400_000

    # The same group reads the partition again from offset 0 (a lost offset commit, a new
    # owner): the hints say "done" and the database is not asked to run anything again.
    await rewind(kafka_bootstrap, group, topic)
    before_redis = DUPLICATES.labels(group, "redis")._value.get()
    before_db = DUPLICATES.labels(group, "db")._value.get()
    second = CountingStore(redis_client, redis_prefix)
    async with consuming(consumer_for(database_url, kafka_bootstrap, topic, group, second)):
        await until_committed(kafka_bootstrap, group, topic, 60)
    assert applied_ids(engine, group) == [str(i) for i in range(60)]  # nothing twice
    assert DUPLICATES.labels(group, "redis")._value.get() - before_redis == 60
    assert DUPLICATES.labels(group, "db")._value.get() == before_db
    assert second.reads >= 1


async def test_copies_in_the_stream_are_caught_and_then_read_the_hints(
    database_url: str,
    engine: Engine,
    kafka_bootstrap: str,
    new_topic: Any,
    redis_client: Redis,
    redis_prefix: str,
) -> None:
    """A relay that sent a batch twice: the first copy is caught by the database (no hint
    was read, the records continued in order), and the batches after it read the hints."""
    metadata.create_all(engine)
    topic = await new_topic.acreate("inbox-copies", partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    events = [order_event(topic, str(i)) for i in range(30)]
    store = CountingStore(redis_client, redis_prefix)
    async with consuming(consumer_for(database_url, kafka_bootstrap, topic, group, store)):
        await produce(kafka_bootstrap, topic, events)
        await until_committed(kafka_bootstrap, group, topic, 30)
        await asyncio.sleep(0.2)  # the background hints of the last batch
        reads_before = store.reads
        before_redis = DUPLICATES.labels(group, "redis")._value.get()
        before_db = DUPLICATES.labels(group, "db")._value.get()
        await produce(kafka_bootstrap, topic, events)  # every event again, in order
        await until_committed(kafka_bootstrap, group, topic, 60)
    assert applied_ids(engine, group) == [str(i) for i in range(30)]
    by_redis = DUPLICATES.labels(group, "redis")._value.get() - before_redis
    by_db = DUPLICATES.labels(group, "db")._value.get() - before_db
    assert by_redis + by_db == 30
    assert by_db >= 1  # the first copies: found by the database's claim
    # batches of at most 10: the ones after the first duplicate read the hints
    assert by_redis >= 1 and store.reads > reads_before


def redis_consumer(
    database_url: str, bootstrap: str, topic: str, group: str, redis_url: str, prefix: str
) -> InboxConsumer:
    """A consumer with the Redis hints it builds itself (``redis_url``), as users run it."""
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=database_url,
            kafka_bootstrap_servers=bootstrap,
            redis_url=redis_url,
            redis_key_prefix=prefix,
            commit_interval_ms=20,
        )
    )
    return paying(consumer)


async def test_another_inbox_sharing_redis_and_the_group_name_never_believes_these_hints(
    database_url: str,
    engine: Engine,
    empty_database_url: str,
    kafka_bootstrap: str,
    new_topic: Any,
    redis_client: Redis,
    redis_url: str,
    redis_prefix: str,
) -> None:
    """Two deployments (two databases: another environment, another tenant) share a Redis
    and a consumer group name, and see the same events (same event ids). The first applies
    them and writes its "done" hints; the second must apply them in its own database. Before,
    the hint keys named only the group and the event: the second consumer took the first's
    hints as its own, skipped every event and committed the offsets - applied nowhere."""
    from ledgerbox import migrations

    other_engine = sa.create_engine(empty_database_url, poolclass=sa.pool.NullPool)
    try:
        migrations.upgrade_database(empty_database_url)
        metadata.create_all(engine)
        metadata.create_all(other_engine)
        first_topic = await new_topic.acreate("hints-first", partitions=1)
        second_topic = await new_topic.acreate("hints-second", partitions=1)
        group = f"g-{uuid.uuid4().hex[:8]}"
        events = [order_event(first_topic, f"o{i}") for i in range(5)]
        await produce(kafka_bootstrap, first_topic, events)
        await produce(kafka_bootstrap, second_topic, events)
        first = redis_consumer(
            database_url, kafka_bootstrap, first_topic, group, redis_url, redis_prefix
        )
        async with consuming(first):
            await until_committed(kafka_bootstrap, group, first_topic, 5)
        keys = [key async for key in redis_client.scan_iter(match=f"{redis_prefix}*:done:*")]
        assert len(keys) == 5, "the first consumer wrote its hints"
        second = redis_consumer(
            empty_database_url, kafka_bootstrap, second_topic, group, redis_url, redis_prefix
        )
        async with consuming(second):
            await until_committed(kafka_bootstrap, group, second_topic, 5)
        assert applied_ids(engine, group) == [f"o{i}" for i in range(5)]
        assert applied_ids(other_engine, group) == [f"o{i}" for i in range(5)]
        # Each inbox has its own keys.
        keys = [key async for key in redis_client.scan_iter(match=f"{redis_prefix}*:done:*")]
        assert len(keys) == 10 and len({key.split(b":")[-4] for key in keys}) == 2
    finally:
        other_engine.dispose()
