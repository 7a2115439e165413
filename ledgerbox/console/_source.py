"""Where the console's data comes from: the :class:`ConsoleSource` Protocol (one method per
thing the page shows or does) and :class:`AdminSource`, its real implementation over the
operator API :mod:`ledgerbox.admin` (the same functions as ``ledgerbox relay dead ...``,
``ledgerbox consumer dlq ...`` and ``ledgerbox consumer lag``) and the relay's status
(:func:`ledgerbox.admin.relay_status`, what ``ledgerbox relay status`` prints). The in-memory
twin is :class:`ledgerbox.console.testing.InMemorySource`.

Nothing here runs SQL or builds a Kafka client itself: the admin API does.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ledgerbox import admin
from ledgerbox._core.errors import ConfigurationError
from ledgerbox.admin import ActionResult, DeadEvent, DlqRecord, HeldKey, PartitionLag
from ledgerbox.console._config import ConsoleConfig, ServiceTarget

__all__ = ["AdminSource", "ConsoleSource", "RelayPanel", "ShardOwners", "shard_ranges"]

_PUBLISHED = re.compile(r"^ledgerbox_relay_published_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)


def shard_ranges(values: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (as ``ledgerbox relay status`` prints shards)."""
    ordered = sorted(values)
    parts: list[str] = []
    for _, run in itertools.groupby(enumerate(ordered), key=lambda p: p[1] - p[0]):
        members = [v for _, v in run]
        parts.append(str(members[0]) if len(members) == 1 else f"{members[0]}-{members[-1]}")
    return ",".join(parts)


@dataclass(frozen=True, slots=True)
class ShardOwners:
    """The shards one relay holds (or that are free), as ``relay status`` prints them.

    Attributes
    ----------
    owner : str | None
        The relay's member id; ``None``: no live owner (free).
    shards : str
        Ranges, e.g. ``"0-31"``; ``"leader"`` for the leader lease.
    count : int
    """

    owner: str | None
    shards: str
    count: int


@dataclass(frozen=True, slots=True)
class RelayPanel:
    """The relay status of one service (``ledgerbox relay status``).

    Attributes
    ----------
    pending : int
        Committed events not yet published.
    oldest_pending_age_s : float | None
        Seconds; ``None``: nothing pending.
    dead_lettered, held : int
        Dead-lettered rows; rows held behind one of their key.
    owners : list[ShardOwners]
    refused : list[str]
        ``"<shards>: <reason>"`` of shards the relays refuse (``ledgerbox relay rebase``).
    """

    pending: int
    oldest_pending_age_s: float | None
    dead_lettered: int
    held: int
    owners: list[ShardOwners] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


class ConsoleSource(Protocol):
    """What the console reads and does, per service. Every method raises
    :class:`ledgerbox.LedgerboxError` subclasses only (one-line messages: the page shows
    them in the section that failed)."""

    async def relay_status(self, service: ServiceTarget) -> RelayPanel:
        """Pending, oldest age, dead, held, shard owners."""
        ...

    async def published_total(self, service: ServiceTarget) -> float | None:
        """Sum of ``ledgerbox_relay_published_total`` of the service's relays (``None``: no
        relay metrics configured or none answered)."""
        ...

    async def held_keys(self, service: ServiceTarget) -> list[HeldKey]:
        """Keys held behind a dead event."""
        ...

    async def dead_events(self, service: ServiceTarget) -> list[DeadEvent]:
        """Dead-lettered outbox events (oldest first)."""
        ...

    async def dlq_records(self, service: ServiceTarget, dlq_topic: str) -> list[DlqRecord]:
        """Records of ``dlq_topic`` not yet replayed or discarded."""
        ...

    async def lag(self, service: ServiceTarget, group: str) -> list[PartitionLag]:
        """Lag per partition of ``group``."""
        ...

    async def replay_dead(
        self, service: ServiceTarget, ids: Sequence[int], *, actor: str, dry_run: bool
    ) -> ActionResult:
        """Replay dead events (``ledgerbox relay dead replay``)."""
        ...

    async def discard_dead(
        self, service: ServiceTarget, ids: Sequence[int], *, actor: str, dry_run: bool
    ) -> ActionResult:
        """Discard dead events (``ledgerbox relay dead discard``)."""
        ...

    async def replay_dlq(
        self, service: ServiceTarget, refs: Sequence[str], *, actor: str, dry_run: bool
    ) -> ActionResult:
        """Replay DLQ records to their group (``ledgerbox consumer dlq replay``)."""
        ...

    async def discard_dlq(
        self, service: ServiceTarget, refs: Sequence[str], *, actor: str, dry_run: bool
    ) -> ActionResult:
        """Discard DLQ records (``ledgerbox consumer dlq discard``)."""
        ...


class AdminSource:
    """:class:`ConsoleSource` over :mod:`ledgerbox.admin`.

    Parameters
    ----------
    config : ConsoleConfig
        The services and the Kafka settings.
    list_limit : int
        At most this many dead events / DLQ records / held keys per section (default 200).
    metrics_timeout_s : float
        Bound of one scrape of a relay's metrics endpoint, in seconds (default 2).
    """

    def __init__(
        self, config: ConsoleConfig, *, list_limit: int = 200, metrics_timeout_s: float = 2.0
    ) -> None:
        self._config = config
        self._limit = list_limit
        self._metrics_timeout_s = metrics_timeout_s

    @staticmethod
    def _db(service: ServiceTarget) -> admin.Database:
        return admin.Database(
            url=service.url,
            schema=service.schema,
            outbox_table=service.outbox_table,
            inbox_table=service.inbox_table,
        )

    def _kafka(self) -> admin.KafkaSettings:
        if self._config.kafka is None:
            raise ConfigurationError(
                "no Kafka settings: start the console with --kafka-bootstrap-servers "
                "(or KAFKA_BOOTSTRAP_SERVERS)",
                setting="kafka_bootstrap_servers",
            )
        return self._config.kafka

    async def relay_status(self, service: ServiceTarget) -> RelayPanel:
        status = await admin.relay_status(self._db(service), shard_count=service.shard_count)
        groups: dict[tuple[str | None, bool], list[int]] = {}
        for lease in status.owners:
            owner = lease.owner if lease.live else None
            groups.setdefault((owner, lease.shard < 0), []).append(lease.shard)
        owners = [
            ShardOwners(owner, "leader" if leader else shard_ranges(shards), len(shards))
            for (owner, leader), shards in sorted(
                groups.items(), key=lambda kv: (kv[0][1], kv[0][0] or "~")
            )
        ]
        refused = (
            [f"{shard_ranges([s for s, _ in status.refused])}: {status.refused[0][1]}"]
            if status.refused
            else []
        )
        return RelayPanel(
            pending=status.pending,
            oldest_pending_age_s=status.oldest_pending_age_s,
            dead_lettered=status.dead_lettered,
            held=status.held,
            owners=owners,
            refused=refused,
        )

    async def published_total(self, service: ServiceTarget) -> float | None:
        if not service.relay_metrics:
            return None
        import httpx

        async def scrape(client: httpx.AsyncClient, url: str) -> float | None:
            try:
                response = await client.get(url)
            except httpx.HTTPError:
                return None
            if response.status_code != 200:
                return None
            match = _PUBLISHED.search(response.text)
            return float(match.group(1)) if match else None

        async with httpx.AsyncClient(timeout=self._metrics_timeout_s) as client:
            found = await asyncio.gather(*(scrape(client, u) for u in service.relay_metrics))
        values = [v for v in found if v is not None]
        return sum(values) if values else None

    async def held_keys(self, service: ServiceTarget) -> list[HeldKey]:
        return await admin.held_keys(self._db(service), limit=self._limit)

    async def dead_events(self, service: ServiceTarget) -> list[DeadEvent]:
        return await admin.list_dead_events(self._db(service), admin.DeadFilter(limit=self._limit))

    async def dlq_records(self, service: ServiceTarget, dlq_topic: str) -> list[DlqRecord]:
        return await admin.list_dlq_records(
            self._kafka(),
            self._db(service),
            admin.DlqFilter(dlq_topic=dlq_topic, limit=self._limit),
        )

    async def lag(self, service: ServiceTarget, group: str) -> list[PartitionLag]:
        return await admin.consumer_lag(self._kafka(), group)

    async def replay_dead(
        self, service: ServiceTarget, ids: Sequence[int], *, actor: str, dry_run: bool
    ) -> ActionResult:
        return await admin.replay_dead_events(self._db(service), ids, actor=actor, dry_run=dry_run)

    async def discard_dead(
        self, service: ServiceTarget, ids: Sequence[int], *, actor: str, dry_run: bool
    ) -> ActionResult:
        return await admin.discard_dead_events(self._db(service), ids, actor=actor, dry_run=dry_run)

    async def replay_dlq(
        self, service: ServiceTarget, refs: Sequence[str], *, actor: str, dry_run: bool
    ) -> ActionResult:
        return await admin.replay_dlq_records(
            self._kafka(), self._db(service), refs, actor=actor, dry_run=dry_run
        )

    async def discard_dlq(
        self, service: ServiceTarget, refs: Sequence[str], *, actor: str, dry_run: bool
    ) -> ActionResult:
        return await admin.discard_dlq_records(
            self._kafka(), self._db(service), refs, actor=actor, dry_run=dry_run
        )
