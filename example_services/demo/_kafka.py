"""Kafka chores of the demo: topics, consumer lag, and duplicate deliveries."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, UnknownTopicOrPartitionError

__all__ = ["consumer_lag", "create_topics", "delete_topics", "end_offsets", "resend_records"]

#: Upper bound of records read back for a duplicate burst (keeps the demo's memory small).
MAX_READ_BACK = 20_000
#: Longest read-back of a duplicate-deliveries fault, in seconds.
READ_BACK_S = 15.0
#: Longest wait of the duplicates fault for the topic's first published records, in seconds.
WAIT_FOR_RECORDS_S = 30.0


async def create_topics(
    bootstrap: str, topics: Sequence[str], partitions: int, replication_factor: int = 1
) -> None:
    """Create ``topics`` with ``partitions`` partitions; existing ones are kept."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for topic in topics:
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(
                    [
                        NewTopic(
                            name=topic,
                            num_partitions=partitions,
                            replication_factor=replication_factor,
                        )
                    ]
                )
    finally:
        await admin.close()


async def delete_topics(bootstrap: str, topics: Sequence[str]) -> None:
    """Best-effort deletion of the demo's topics."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        doomed = [t for t in topics if t in existing]
        if doomed:
            await admin.delete_topics(doomed)
    finally:
        await admin.close()


async def end_offsets(bootstrap: str, topics: Sequence[str]) -> dict[TopicPartition, int]:
    """Log end offset of every partition of ``topics`` (a missing topic raises)."""
    # A consumer's metadata only covers its subscriptions; the producer fetches a topic's.
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    try:
        await producer.start()
        partitions = [
            TopicPartition(topic, p)
            for topic in topics
            for p in sorted(await producer.partitions_for(topic))
        ]
    finally:
        await producer.stop()
    if not partitions:
        return {}
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        await consumer.start()
        return dict(await consumer.end_offsets(partitions))
    finally:
        await consumer.stop()


async def consumer_lag(bootstrap: str, group: str, topics: Sequence[str]) -> int:
    """Records of ``topics`` not yet committed by ``group`` (a partition never committed
    counts from 0, as the consumers start at the earliest offset)."""
    ends = await end_offsets(bootstrap, topics)
    if not ends:
        raise RuntimeError(f"no partitions found for {list(topics)}: cannot measure lag")
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        committed = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    lag = 0
    for tp, end in ends.items():
        meta = committed.get(tp)
        done = meta.offset if meta is not None and meta.offset >= 0 else 0
        lag += max(0, end - done)
    return lag


async def resend_records(bootstrap: str, topic: str, count: int, rng: random.Random) -> int:
    """Duplicate deliveries: re-produce ``count`` already published records of ``topic``.

    Random records are read back from the beginning and produced again, unchanged (key,
    value, headers, timestamp) to their original partition: to a consumer this is exactly
    a redelivery. Returns how many were re-sent.
    """
    if count <= 0:
        return 0
    # Only records that exist can be delivered twice: on a fast run this fault can come
    # before the relay (still starting, or restarted by an earlier fault) published any, and
    # it re-sent nothing (the fault silently did not happen; seen once the write path stopped
    # notifying while no relay waits, and the orders went in faster). Wait for some, bounded.
    waited_until = time.monotonic() + WAIT_FOR_RECORDS_S
    ends = await end_offsets(bootstrap, [topic])
    while ends and not any(ends.values()) and time.monotonic() < waited_until:
        await asyncio.sleep(0.25)
        ends = await end_offsets(bootstrap, [topic])
    if not ends:
        return 0
    reader = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await reader.start()
    records: list[Any] = []
    try:
        reader.assign(list(ends))
        await reader.seek_to_beginning(*ends)
        remaining = {tp: end for tp, end in ends.items() if end > 0}
        # Until every partition is read to its end offset, for READ_BACK_S at most: the first
        # fetch after the seek can take over a second on a loaded machine, and stopping at the
        # first empty poll re-sent nothing at all (the fault silently did not happen).
        deadline = time.monotonic() + READ_BACK_S
        while remaining and len(records) < MAX_READ_BACK and time.monotonic() < deadline:
            batch = await reader.getmany(timeout_ms=500, max_records=1000)
            for tp, messages in batch.items():
                for message in messages:
                    if message.offset < ends[tp]:
                        records.append(message)
                if messages and messages[-1].offset + 1 >= ends[tp]:
                    remaining.pop(tp, None)
    except UnknownTopicOrPartitionError:
        return 0
    finally:
        await reader.stop()
    chosen = sorted(
        rng.sample(records, min(count, len(records))), key=lambda m: (m.partition, m.offset)
    )
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for message in chosen:
            await producer.send(
                topic,
                value=message.value,
                key=message.key,
                headers=list(message.headers),
                partition=message.partition,
                timestamp_ms=message.timestamp,
            )
        await producer.flush()
    finally:
        await producer.stop()
    return len(chosen)
