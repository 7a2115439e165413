"""Consumer lag: a group's committed offsets against the partitions' high watermarks."""

from __future__ import annotations

from collections.abc import Sequence

from ledgerbox._core.kafka import KafkaSettings
from ledgerbox.admin._types import PartitionLag

__all__ = ["consumer_lag"]


async def consumer_lag(
    kafka: KafkaSettings, group: str, topics: Sequence[str] | None = None
) -> list[PartitionLag]:
    """Lag per partition of ``group``, sorted by (topic, partition)."""
    raise NotImplementedError
