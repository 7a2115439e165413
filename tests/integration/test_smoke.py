"""The stack is real: PostgreSQL commits, Kafka stores and serves records and committed offsets,
Redis honours SET NX EX. If these fail, nothing else in the suite means anything."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from redis.asyncio import Redis
from sqlalchemy import Engine, column, create_engine, select, table, text
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import NullPool

from tests import _services
from tests._services import BrokerInfo, TopicFactory


def test_postgres_commit_is_visible_from_a_new_connection(
    engine: Engine, database_url: str
) -> None:
    with engine.begin() as conn:
        assert str(conn.execute(text("SELECT current_database()")).scalar_one()).startswith(
            "ledgerbox_t_"
        )
        conn.execute(text("CREATE TABLE smoke (id int PRIMARY KEY, note text NOT NULL)"))
        conn.execute(text("INSERT INTO smoke (id, note) VALUES (1, 'committed')"))

    # A separate engine without pooling: the row must come from the server, not a session.
    other = create_engine(database_url, poolclass=NullPool)
    try:
        with other.connect() as conn:
            row = conn.execute(text("SELECT id, note FROM smoke")).one()
            version = conn.execute(text("SHOW server_version")).scalar_one()
    finally:
        other.dispose()
    assert tuple(row) == (1, "committed")
    print(f"PostgreSQL {version} at {_services.redact(database_url)}")


async def test_postgres_async_engine(async_engine: AsyncEngine) -> None:
    async with async_engine.connect() as conn:
        assert (await conn.execute(text("SELECT 41 + 1"))).scalar_one() == 42


def test_template_is_migrated(engine: Engine) -> None:
    from ledgerbox import migrations

    version_table = migrations.VERSION_TABLE
    with engine.connect() as conn:
        versions: Sequence[object] = (
            conn.execute(select(column("version_num")).select_from(table(version_table)))
            .scalars()
            .all()
        )
    assert len(versions) == 1, versions


async def test_kafka_produce_consume_commit(
    kafka_bootstrap: str, kafka_broker: BrokerInfo, new_topic: TopicFactory
) -> None:
    print(f"Kafka broker: {kafka_broker.describe()}")
    assert kafka_broker.api_count > 0, "broker did not answer ApiVersions v3"

    topic = await new_topic.acreate("smoke", partitions=3)
    key = f"k-{uuid.uuid4().hex}".encode()
    value = b'{"hello": "outbox"}'
    headers = [("event_type", b"smoke.v1"), ("trace", uuid.uuid4().bytes)]

    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True
    )
    await producer.start()
    try:
        sent = await producer.send_and_wait(topic, value=value, key=key, headers=headers)
    finally:
        await producer.stop()

    group = f"smoke-{uuid.uuid4().hex}"
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka_bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        async with asyncio.timeout(60):
            record = await consumer.getone()
        assert (record.partition, record.offset) == (sent.partition, sent.offset)
        assert record.key == key
        assert record.value == value
        assert list(record.headers) == headers

        tp = TopicPartition(topic, record.partition)
        assert await consumer.committed(tp) is None
        await consumer.commit()
        committed = await consumer.committed(tp)
    finally:
        await consumer.stop()
    assert committed == record.offset + 1
    print(
        f"Kafka round trip ok: topic={topic} partition={record.partition} "
        f"offset={record.offset} group={group} committed={committed}"
    )


async def test_redis_set_nx_ex(redis_client: Redis, redis_prefix: str) -> None:
    key = f"{redis_prefix}lock"
    assert await redis_client.set(key, b"owner-1", nx=True, ex=30) is True
    assert await redis_client.set(key, b"owner-2", nx=True, ex=30) is None
    assert await redis_client.get(key) == b"owner-1"
    ttl = await redis_client.ttl(key)
    assert 0 < ttl <= 30
    info = await redis_client.info("server")
    print(f"Redis {info['redis_version']}: SET NX EX ok, ttl={ttl}")
