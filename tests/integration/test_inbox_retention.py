"""Inbox retention (G8): purge deletes only this group's rows older than the dedup window,
in bounded batches, and refuses a window shorter than the configured one. (That it also
keeps every row Kafka can still redeliver, C18, is tests/faults/test_inbox_failsafe.py.)"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata
from sqlalchemy import Engine

from ledgerbox import ConfigurationError
from ledgerbox.inbox import ConsumerConfig, InboxConsumer


async def commit_offset(bootstrap: str, group: str, topic: str, offset: int) -> None:
    """Commit ``offset`` for partition 0 of ``topic`` as ``group`` (without consuming)."""
    # No auto-commit: stop() would commit the client's own position over ``offset``.
    client = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    client.assign([TopicPartition(topic, 0)])
    await client.start()
    try:
        await client.commit({TopicPartition(topic, 0): OffsetAndMetadata(offset, "")})
    finally:
        await client.stop()


async def test_purge_deletes_only_rows_older_than_the_window(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any
) -> None:
    topic = await new_topic.acreate("inbox-ret", partitions=1)
    group, other = f"ret-{uuid.uuid4().hex[:8]}", f"ret-{uuid.uuid4().hex[:8]}"
    # Every row's record is below the group's committed offset: only age decides here.
    await commit_offset(kafka_bootstrap, group, topic, 1000)
    insert = sa.text(
        "INSERT INTO inbox (consumer_group, event_id, status, first_seen_at, last_seen_at, "
        'topic, "partition", "offset") '
        "SELECT :g, gen_random_uuid(), 1, now() - make_interval(days => :d), now(), :t, 0, n "
        "FROM generate_series(1, :n) AS n"
    )
    with engine.begin() as conn:
        conn.execute(insert, {"g": group, "d": 8, "n": 25, "t": topic})  # older than 7 days
        conn.execute(insert, {"g": group, "d": 6, "n": 5, "t": topic})  # inside the window
        conn.execute(insert, {"g": other, "d": 30, "n": 3, "t": topic})  # another group's rows
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=database_url,
            kafka_bootstrap_servers=kafka_bootstrap,
            auto_offset_reset="latest",  # the log-start rule of "earliest": the C18 test
        )
    )
    try:
        with pytest.raises(ConfigurationError):
            await consumer.purge(older_than_s=24 * 3600)  # would eat the dedup window
        assert await consumer.purge(batch_size=10) == 25
        assert await consumer.purge(batch_size=10) == 0
    finally:
        await consumer.aclose()
    count = sa.text("SELECT count(*) FROM inbox WHERE consumer_group = :g")
    with engine.connect() as conn:
        assert conn.execute(count, {"g": group}).scalar_one() == 5
        assert conn.execute(count, {"g": other}).scalar_one() == 3
