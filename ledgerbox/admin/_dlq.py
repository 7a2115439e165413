"""The inbox side of the operator API: records of a dead-letter topic, replayed to the one
consumer group that dead-lettered them, or discarded (docs/operations.md)."""

from __future__ import annotations

from collections.abc import Sequence

from ledgerbox._core.kafka import KafkaSettings
from ledgerbox.admin._types import ActionResult, Database, DlqFilter, DlqRecord

__all__ = ["discard_dlq_records", "list_dlq_records", "replay_dlq_records", "show_dlq_record"]


async def list_dlq_records(
    kafka: KafkaSettings, db: Database, filter: DlqFilter
) -> list[DlqRecord]:
    """Records of ``filter.dlq_topic`` matching the filter."""
    raise NotImplementedError


async def show_dlq_record(kafka: KafkaSettings, db: Database, ref: str) -> DlqRecord:
    """One record with its value."""
    raise NotImplementedError


async def replay_dlq_records(
    kafka: KafkaSettings,
    db: Database,
    refs: Sequence[str] = (),
    *,
    filter: DlqFilter | None = None,
    actor: str | None = None,
    dry_run: bool = False,
) -> ActionResult:
    """Republish records to their source topic for their group only."""
    raise NotImplementedError


async def discard_dlq_records(
    kafka: KafkaSettings,
    db: Database,
    refs: Sequence[str] = (),
    *,
    filter: DlqFilter | None = None,
    actor: str | None = None,
    dry_run: bool = False,
) -> ActionResult:
    """Record records as discarded (Kafka cannot delete one)."""
    raise NotImplementedError
