"""Consumer lag: a group's committed offsets against the partitions' high watermarks (the
inbox's own reading, :func:`ledgerbox.inbox._lag.group_lag`)."""

from __future__ import annotations

from collections.abc import Sequence

from ledgerbox._core.kafka import KafkaSettings
from ledgerbox.admin._errors import InvalidFilterError, NotFoundError
from ledgerbox.admin._types import PartitionLag
from ledgerbox.inbox._lag import group_lag, no_offsets_line

__all__ = ["consumer_lag", "no_offsets_error"]


async def consumer_lag(
    kafka: KafkaSettings, group: str, topics: Sequence[str] | None = None
) -> list[PartitionLag]:
    """Lag in records of consumer group ``group`` per partition, sorted by (topic,
    partition).

    Parameters
    ----------
    kafka : KafkaSettings
    group : str
        The consumer group (``ConsumerConfig.group_id``).
    topics : Sequence[str] | None
        Topics to read; ``None``: the topics the group has committed offsets on (a group
        that committed nothing yet then has no rows: give its topics).

    Returns
    -------
    list[PartitionLag]
        ``lag = high_watermark - committed``; with nothing committed on a partition,
        ``committed`` is ``None`` and the lag counts from its first offset still in the log.
        A read: no group is joined, nothing is committed. With ``topics`` given, a group
        that committed nothing on them yet gets its rows (all ``committed=None``); without,
        none (``ledgerbox consumer lag`` then says so: :func:`no_offsets_error`).

    Raises
    ------
    ledgerbox.admin.InvalidFilterError
        An empty group name.
    ledgerbox.BrokerError
        Kafka unreachable, not authorized, or a topic does not exist.
    """
    if not group:
        raise InvalidFilterError("the consumer group must not be empty", setting="group")
    found = await group_lag(kafka, group, list(topics) if topics else None)
    return [
        PartitionLag(
            topic=lag.topic,
            partition=lag.partition,
            committed=lag.committed,
            high_watermark=lag.high,
            lag=lag.lag,
        )
        for lag in found
    ]


async def no_offsets_error(kafka: KafkaSettings, group: str) -> NotFoundError:
    """The error of ``ledgerbox consumer lag --group <group>`` when the group has committed
    no offset on any topic (:func:`ledgerbox.inbox._lag.no_offsets_line`: the groups the
    brokers know, and to give ``--topic`` for a group that has not committed yet).

    Raises
    ------
    ledgerbox.BrokerError
        Kafka unreachable or refusing to list the groups.
    """
    return NotFoundError(await no_offsets_line(kafka, group))
