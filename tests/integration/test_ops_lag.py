"""``ledgerbox consumer lag``, the lag lines of ``ledgerbox consumer check`` and
:func:`ledgerbox.admin.consumer_lag` on real Kafka: committed offset vs high watermark per
partition, a partition without a committed offset, a running consumer catching up to 0, JSON
output, and one-line errors with exit 2."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from sqlalchemy.ext.asyncio import AsyncSession

from ledgerbox import admin
from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer
from ledgerbox.outbox import EventEnvelope
from tests._inbox_support import committed, order_event, poll, produce

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEDGERBOX_CONSUMER_")}
    return subprocess.run(
        [sys.executable, "-m", "ledgerbox", "consumer", *args],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_consumer_lag_per_partition_then_zero_once_a_consumer_caught_up(
    database_url: str, kafka_bootstrap: str, new_topic: Any
) -> None:
    topic = await new_topic.acreate("ops-lag", partitions=2)
    group = f"ops-lag-{uuid.uuid4().hex[:6]}"
    await produce(kafka_bootstrap, topic, [order_event(topic, f"A{i}") for i in range(5)], 0)
    await produce(kafka_bootstrap, topic, [order_event(topic, f"B{i}") for i in range(3)], 1)
    # The group committed offset 2 on partition 0 and nothing on partition 1.
    # No auto-commit: on stop() it would commit the probe's position (the end of the
    # partition once resolved) over the offset committed by hand (a flake seen under load).
    probe = AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False
    )
    await probe.start()
    try:
        probe.assign([TopicPartition(topic, 0)])
        await probe.commit({TopicPartition(topic, 0): 2})
    finally:
        await probe.stop()
    kafka = admin.KafkaSettings(bootstrap_servers=kafka_bootstrap)

    lags = await admin.consumer_lag(kafka, group, [topic])
    assert [(p.partition, p.committed, p.high_watermark, p.lag) for p in lags] == [
        (0, 2, 5, 3),
        (1, None, 3, 3),
    ]
    own = await admin.consumer_lag(kafka, group)
    assert [(p.topic, p.partition, p.lag) for p in own] == [(topic, 0, 3), (topic, 1, 3)], (
        "without topics: every partition of the topics the group committed on"
    )
    assert await admin.consumer_lag(kafka, f"never-{uuid.uuid4().hex[:6]}") == []

    env = {"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    out = _cli("lag", "--group", group, "--topic", topic, "--json", **env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [p.to_json() for p in lags]
    text = _cli("lag", "--group", group, "--topic", topic, **env)
    assert text.returncode == 0, text.stderr
    rows = text.stdout.splitlines()
    assert rows[0].split() == ["topic", "partition", "committed", "high", "watermark", "lag"]
    assert rows[1].split() == [topic, "0", "2", "5", "3"]
    assert rows[2].split() == [topic, "1", "-", "3", "3"]
    assert rows[3] == "total lag: 6"
    checked = _cli(
        "check",
        "--database-url",
        database_url,
        "--kafka-bootstrap-servers",
        kafka_bootstrap,
        "--group",
        group,
        "--topic",
        topic,
        REDIS_URL="",
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines() == [
        "ok",
        f"lag {topic}[0]: 3 (committed 2, high watermark 5)",
        f"lag {topic}[1]: 3 (committed -, high watermark 3)",
        f"lag of group {group}: 6 records",
    ]
    for args, message in [
        (("lag", "--group", group, "--topic", f"no-such-{uuid.uuid4().hex[:6]}"), "does not exist"),
        (("lag", "--topic", topic), "no consumer group: set --group"),
        (("lag", "--group", group), "no Kafka bootstrap servers"),
    ]:
        bad = _cli(*args, **(env if "no Kafka" not in message else {"KAFKA_BOOTSTRAP_SERVERS": ""}))
        assert bad.returncode == 2, (args, bad.stdout, bad.stderr)
        (line,) = bad.stderr.strip().splitlines()
        assert message in line and "Traceback" not in bad.stderr, (args, line)

    # A running consumer of the group catches up: lag 0 everywhere.
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=database_url,
            kafka_bootstrap_servers=kafka_bootstrap,
            commit_interval_ms=20,
        )
    )

    @consumer.handler("OrderPlaced")
    async def take(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        del ctx, event

    task = asyncio.create_task(consumer.run())
    try:

        async def caught_up() -> bool:
            assert not task.done(), task
            ends = [await committed(kafka_bootstrap, group, topic, p) for p in (0, 1)]
            return ends == [5, 3]

        await poll(caught_up, "the consumer committed both partitions")
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 60)
    after = await admin.consumer_lag(kafka, group, [topic])
    assert [(p.partition, p.committed, p.lag) for p in after] == [(0, 5, 0), (1, 3, 0)]
