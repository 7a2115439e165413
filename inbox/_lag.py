"""A consumer group's lag: its committed offset against each partition's high watermark,
read with an admin client and an assigned consumer (no group joined, nothing committed):
``ledgerbox consumer lag``, ``ledgerbox consumer check`` and :func:`ledgerbox.admin.
consumer_lag` (docs/operations.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import (
    CoordinatorLoadInProgressError,
    GroupCoordinatorNotAvailableError,
    KafkaError,
)

from ledgerbox._core.errors import BrokerError
from ledgerbox._core.faults import Fault
from ledgerbox._core.kafka import KafkaSettings
from ledgerbox._core.kafka_clients import admin_client, consumer_client

__all__ = ["GROUPS_SHOWN", "Lag", "group_lag", "group_names", "no_offsets_line"]

#: A fresh cluster has no group coordinator until its offsets topic exists (created at the
#: first group request): the lookup is retried for up to this long, in seconds.
COORDINATOR_WAIT_S = 10.0
#: At most this many other group names are offered in the "no such group" line.
GROUPS_SHOWN = 10


@dataclass(frozen=True, slots=True)
class Lag:
    """One partition: ``committed`` (``None``: the group committed nothing there),
    ``low`` / ``high`` (first offset still in the log / the high watermark) and ``lag`` in
    records (``high - committed``, or ``high - low`` when nothing is committed)."""

    topic: str
    partition: int
    committed: int | None
    low: int
    high: int

    @property
    def lag(self) -> int:
        """Records the group has not committed yet."""
        start = self.low if self.committed is None else max(self.committed, self.low)
        return max(self.high - start, 0)


async def group_lag(
    kafka: KafkaSettings, group: str, topics: Sequence[str] | None = None
) -> list[Lag]:
    """The lag of ``group`` on every partition of ``topics`` (``None``: the topics it has
    committed offsets on), sorted by (topic, partition).

    Raises
    ------
    ledgerbox.BrokerError
        Kafka unreachable, not authorized, or a topic does not exist (one line, the cause).
    """
    admin = admin_client(kafka)
    consumer = consumer_client(kafka)
    try:
        await admin.start()
        committed = {
            (tp.topic, tp.partition): meta.offset
            for tp, meta in (await _group_offsets(admin, group)).items()
            if meta is not None and meta.offset >= 0
        }
        names = sorted(set(topics) if topics else {t for t, _p in committed})
        if not names:
            return []
        await consumer.start()
        tps: list[TopicPartition] = []
        for name in names:
            partitions = consumer.partitions_for_topic(name)
            if not partitions:
                await consumer._client.force_metadata_update()
                partitions = consumer.partitions_for_topic(name)
            if not partitions:
                raise BrokerError(
                    f"topic {name!r} does not exist on {kafka.describe()}: create it, or fix"
                    " the topic name (--topic, or the app's ConsumerConfig.topics)",
                    fault=Fault.ENVIRONMENT,
                    kind="UnknownTopicOrPartitionError",
                )
            tps.extend(TopicPartition(name, p) for p in sorted(partitions))
        high = await consumer.end_offsets(tps)
        low = await consumer.beginning_offsets(tps)
    except (KafkaError, OSError) as exc:
        raise BrokerError.translate(
            exc, f"reading the lag of group {group!r}", servers=kafka.bootstrap_servers
        ) from exc
    finally:
        await consumer.stop()
        await admin.close()
    return [
        Lag(tp.topic, tp.partition, committed.get((tp.topic, tp.partition)), low[tp], high[tp])
        for tp in sorted(tps, key=lambda t: (t.topic, t.partition))
    ]


async def group_names(kafka: KafkaSettings) -> list[str]:
    """The consumer groups the brokers know (any state, sorted): what to offer an operator
    who named a group that committed nothing.

    Raises
    ------
    ledgerbox.BrokerError
        Kafka unreachable or not authorized (DescribeGroup/ListGroups).
    """
    admin = admin_client(kafka)
    try:
        await admin.start()
        listed = await admin.list_consumer_groups()
    except (KafkaError, OSError) as exc:
        raise BrokerError.translate(
            exc, "listing the consumer groups", servers=kafka.bootstrap_servers
        ) from exc
    finally:
        await admin.close()
    return sorted({str(g[0]) for g in listed})


async def no_offsets_line(kafka: KafkaSettings, group: str) -> str:
    """What ``ledgerbox consumer lag`` and ``check --group`` say of a group that has
    committed no offset on any topic (a misspelt name, or a group that never committed):
    ONE line that names the groups the brokers know (at most :data:`GROUPS_SHOWN`) and says
    to give ``--topic`` for a group that has not committed yet.

    Raises
    ------
    ledgerbox.BrokerError
        Kafka unreachable or refusing to list the groups.
    """
    others = [g for g in await group_names(kafka) if g != group]
    known = ", ".join(others[:GROUPS_SHOWN]) or "none"
    if len(others) > GROUPS_SHOWN:
        known += f" (and {len(others) - GROUPS_SHOWN} more)"
    return (
        f"consumer group {group!r} has committed no offsets on any topic (a misspelt name, "
        f"or a group that never committed): check the name (the groups on "
        f"{kafka.describe()}: {known}), or give its topics with --topic to see the lag of a "
        "group that has not committed yet"
    )


async def _group_offsets(admin: AIOKafkaAdminClient, group: str) -> dict[TopicPartition, Any]:
    deadline = time.monotonic() + COORDINATOR_WAIT_S
    while True:
        try:
            return dict(await admin.list_consumer_group_offsets(group))
        except (GroupCoordinatorNotAvailableError, CoordinatorLoadInProgressError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)
