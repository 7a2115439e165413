"""The 3-broker cluster of ``scripts/services.sh`` (``OUTBOX_KAFKA_NODES=3``) is a real one.

1. A topic created with replication factor 3 has 3 in-sync replicas; records produced with
   ``acks=all`` survive ``kill -9`` of the leader of partition 0: leadership moves, producing
   and consuming go on, every record is read back exactly once (idempotent producer).
2. ``min.insync.replicas=2`` holds: with two brokers stopped a produce with ``acks=all`` is
   refused with NOT_ENOUGH_REPLICAS (retriable), and succeeds again once they are back.
3. The restarted broker rejoins the ISR of every partition.

Opt-in: runs only with ``OUTBOX_KAFKA_NODES=3`` (``make test-cluster``, ``make soak``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, KafkaTimeoutError, NotEnoughReplicasError

from tests._services import SERVICES_SCRIPT

pytestmark = [pytest.mark.services, pytest.mark.timeout(240)]

BROKERS = (1, 2, 3)


def _script(command: str, *args: str) -> str:
    env = dict(os.environ, OUTBOX_KAFKA_NODES="3")
    proc = subprocess.run(
        ["bash", str(SERVICES_SCRIPT), command, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"services.sh {command} {args}: {proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def bootstrap() -> str:
    value = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "")
    servers = [s for s in value.split(",") if s]
    assert len(servers) == 3, (
        f"KAFKA_BOOTSTRAP_SERVERS={value!r}: the cluster tests need the 3 brokers "
        '(OUTBOX_KAFKA_NODES=3 eval "$(bash scripts/services.sh up)", or make test-cluster)'
    )
    return value


@pytest.fixture(autouse=True)
def _all_brokers_back() -> Any:
    yield
    for broker in BROKERS:
        _script("start-broker", str(broker))  # a no-op for a running broker


CREATED: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _delete_created_topics(bootstrap: str) -> Any:
    """The cluster's storage outlives a run: every topic left behind is one more log a
    restarted broker loads and re-replicates in every later run."""
    yield
    if CREATED:
        asyncio.run(_delete(bootstrap, list(CREATED)))
        CREATED.clear()


async def _partitions(bootstrap: str, topic: str) -> dict[int, dict[str, Any]]:
    # A fresh client per call: aiokafka's admin keeps sending to the node it picked, which
    # may be the broker the test just killed.
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5_000)
    await admin.start()
    try:
        [described] = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return {p["partition"]: p for p in described["partitions"]}


async def _create(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=3)])
        CREATED.append(topic)
    finally:
        await admin.close()


async def _delete(bootstrap: str, topics: list[str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        await admin.delete_topics(topics)
    finally:
        await admin.close()


async def _wait_partitions(
    bootstrap: str, topic: str, ok: Any, timeout_s: float = 60.0
) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    parts: dict[int, dict[str, Any]] = {}
    while True:
        with contextlib.suppress(KafkaError):
            parts = await _partitions(bootstrap, topic)
            if parts and all(ok(p) for p in parts.values()):
                return parts
        assert time.monotonic() < deadline, f"{topic} partitions never got there: {parts}"
        await asyncio.sleep(0.5)


async def _produce(
    bootstrap: str, topic: str, values: list[bytes], idempotent: bool = True, **kw: Any
) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", enable_idempotence=idempotent, **kw
    )
    await producer.start()
    try:
        futures = [await producer.send(topic, v, key=v[-2:]) for v in values]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def _read_all(bootstrap: str, topic: str, partitions: int) -> list[bytes]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        values: list[bytes] = []
        deadline = time.monotonic() + 60
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            assert time.monotonic() < deadline, "could not read the topic back"
            batch = await consumer.getmany(timeout_ms=1000)
            values.extend(m.value for msgs in batch.values() for m in msgs)
        return values
    finally:
        await consumer.stop()


async def test_rf3_topic_survives_kill_of_its_leader(bootstrap: str) -> None:
    topic = f"cluster-{uuid.uuid4().hex[:8]}"
    await _create(bootstrap, topic)
    parts = await _wait_partitions(bootstrap, topic, lambda p: len(p["isr"]) == 3)
    assert all(sorted(p["replicas"]) == [1, 2, 3] for p in parts.values())
    before = [f"before-{i:04d}".encode() for i in range(200)]
    await _produce(bootstrap, topic, before)

    victim = parts[0]["leader"]
    _script("kill-broker", str(victim))
    moved = await _wait_partitions(bootstrap, topic, lambda p: p["leader"] not in (victim, -1))
    assert moved[0]["leader"] != victim
    after = [f"after-{i:04d}".encode() for i in range(200)]
    await _produce(bootstrap, topic, after)  # ISR 2 >= min.insync.replicas 2
    got = await _read_all(bootstrap, topic, 3)
    assert sorted(got) == sorted(before + after), "a record was lost or doubled"

    _script("start-broker", str(victim))
    await _wait_partitions(bootstrap, topic, lambda p: victim in p["isr"])


async def test_two_brokers_down_refuses_acks_all_with_not_enough_replicas(bootstrap: str) -> None:
    topic = f"cluster-{uuid.uuid4().hex[:8]}"
    await _create(bootstrap, topic)
    await _wait_partitions(bootstrap, topic, lambda p: len(p["isr"]) == 3)
    survivor, *stopped = BROKERS
    for broker in stopped:
        _script("stop-broker", str(broker))
    await _wait_partitions(bootstrap, topic, lambda p: p["isr"] == [survivor])
    # Not idempotent: aiokafka's idempotent producer retries NOT_ENOUGH_REPLICAS without
    # bound; a plain one gives up once the batch expired and reports the broker's error.
    with pytest.raises((NotEnoughReplicasError, KafkaTimeoutError)) as refused:
        await asyncio.wait_for(
            _produce(bootstrap, topic, [b"refused-00"], idempotent=False, request_timeout_ms=3000),
            timeout=60,
        )
    assert isinstance(refused.value, NotEnoughReplicasError), repr(refused.value)
    for broker in stopped:
        _script("start-broker", str(broker))
    await _wait_partitions(bootstrap, topic, lambda p: len(p["isr"]) == 3)
    await _produce(bootstrap, topic, [b"accepted-00"])
    assert await _read_all(bootstrap, topic, 3) == [b"accepted-00"]


def test_status_names_each_node() -> None:
    out = _script("status")
    for role in ("controller", "broker"):
        for n in BROKERS:
            assert f"kafka {role} {n}: running" in out, out
