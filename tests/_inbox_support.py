"""Helpers shared by the inbox tests: events, producing records, polling, committed offsets."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from ledgerbox.inbox.testing import kafka_parts
from ledgerbox.outbox import EventEnvelope, OutboxWriter, TopicRouter


def order_event(
    topic: str, order_id: str, amount: str = "100.00", kind: str = "OrderPlaced"
) -> EventEnvelope:
    """An event as the order service's outbox writes it (a fresh idempotency key each call)."""
    writer = OutboxWriter(TopicRouter(default=topic), source="/order-service")
    return writer.event(
        event_type=kind,
        aggregate_type="order",
        aggregate_id=order_id,
        payload={"order_id": order_id, "amount": amount},
        idempotency_key=f"order:{order_id}:{kind}:{uuid.uuid4()}",
    )


async def produce(bootstrap: str, topic: str, items: list[Any], partition: int = 0) -> None:
    """Send envelopes (in relay form) or raw ``(key, value, headers)`` tuples, in order."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for item in items:
            key, value, headers = kafka_parts(item) if isinstance(item, EventEnvelope) else item
            await producer.send_and_wait(
                topic, value=value, key=key, headers=headers, partition=partition
            )
    finally:
        await producer.stop()


async def committed(bootstrap: str, group: str, topic: str, partition: int = 0) -> int | None:
    """The group's committed offset of one partition, or ``None``."""
    # A reader only: never commit anything for the group on stop().
    probe = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await probe.start()
    try:
        offset = await probe.committed(TopicPartition(topic, partition))
        return None if offset is None else int(offset)
    finally:
        await probe.stop()


async def poll(check: Callable[[], Awaitable[bool]], what: str, within_s: float = 60) -> None:
    """Await ``check()`` until it is true; fail after ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
