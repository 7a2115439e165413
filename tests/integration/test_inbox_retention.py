"""Inbox retention (G8): purge deletes only this group's rows older than the dedup window,
in bounded batches, and refuses a window shorter than the configured one."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine

from ledgerbox import ConfigurationError
from ledgerbox.inbox import ConsumerConfig, InboxConsumer


async def test_purge_deletes_only_rows_older_than_the_window(
    database_url: str, engine: Engine, kafka_bootstrap: str
) -> None:
    group, other = f"ret-{uuid.uuid4().hex[:8]}", f"ret-{uuid.uuid4().hex[:8]}"
    insert = sa.text(
        "INSERT INTO inbox (consumer_group, event_id, status, first_seen_at, last_seen_at) "
        "SELECT :g, gen_random_uuid(), 1, now() - make_interval(days => :d), now() "
        "FROM generate_series(1, :n)"
    )
    with engine.begin() as conn:
        conn.execute(insert, {"g": group, "d": 8, "n": 25})  # older than 7 days
        conn.execute(insert, {"g": group, "d": 6, "n": 5})  # inside the window
        conn.execute(insert, {"g": other, "d": 30, "n": 3})  # another group's rows
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=["t"],
            database_url=database_url,
            kafka_bootstrap_servers=kafka_bootstrap,
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
