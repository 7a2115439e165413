"""What Kafka can still deliver to a consumer group, per partition: the bound below which an
inbox row may be purged (docs/inbox.md, "Retention"; C18).

A record of partition P can come back to the group when its offset is at or above the
group's committed offset of P (not yet committed: a crash before the offset commit
redelivers it). With ``auto_offset_reset="earliest"`` it can also come back while it is
still in the log: should the group's committed offsets ever be lost (expired after
``offsets.retention.minutes`` without a member, or deleted by an operator), the group reads
P again from its first offset. The bound of P is therefore the committed offset, lowered to
the partition's log-start offset under ``"earliest"``; a partition without a committed
offset has no bound (nothing of it may go).

This is one of the consumer's Kafka edges: aiokafka errors leave it as
:class:`ledgerbox.BrokerError`.
"""

from __future__ import annotations

import contextlib

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from ledgerbox._core.errors import BrokerError
from ledgerbox.inbox._config import ConsumerConfig

__all__ = ["redelivery_bounds"]


async def redelivery_bounds(config: ConsumerConfig) -> dict[tuple[str, int], int]:
    """``(topic, partition) -> offset`` for every partition of the consumer's topics (or
    its manual assignment) that has a committed offset: inbox rows of that partition below
    the offset can no longer be delivered to ``config.group_id``.

    Joins no group and commits nothing (an offset fetch and a list-offsets request).

    Raises
    ------
    ledgerbox.BrokerError
        If Kafka did not answer or refused the requests.
    """
    kafka = config.kafka_settings.client_kwargs()
    probe = AIOKafkaConsumer(**kafka, group_id=config.group_id, enable_auto_commit=False)
    admin = AIOKafkaAdminClient(**kafka)
    try:
        await probe.start()
        if config.assignment:
            partitions = [TopicPartition(t, p) for t, p in config.assignment]
        else:
            await admin.start()
            described = await admin.describe_topics(list(config.topics))
            partitions = [
                TopicPartition(item["topic"], part["partition"])
                for item in described
                if item.get("error_code", 0) == 0
                for part in item.get("partitions", ())
            ]
        committed: dict[TopicPartition, int] = {}
        for tp in partitions:
            offset = await probe.committed(tp)
            if offset is not None and offset >= 0:
                committed[tp] = int(offset)
        if committed and config.auto_offset_reset == "earliest":
            starts = await probe.beginning_offsets(list(committed))
            committed = {tp: min(c, int(starts[tp])) for tp, c in committed.items()}
        return {(tp.topic, tp.partition): offset for tp, offset in committed.items()}
    except (KafkaError, OSError, TimeoutError) as exc:
        raise BrokerError.translate(
            exc,
            "reading the group's committed offsets",
            servers=config.kafka_settings.bootstrap_servers,
        ) from exc
    finally:
        with contextlib.suppress(Exception):
            await probe.stop()
        with contextlib.suppress(Exception):
            await admin.close()
