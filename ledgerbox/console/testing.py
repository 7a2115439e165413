"""Test helpers of the console: :class:`InMemorySource`, the in-memory twin of
:class:`~ledgerbox.console.ConsoleSource` (no database, no Kafka), for tests of pages and
access rules and for trying the page out.

Its replay and discard follow the operator API's rules where a page can see them: a replayed
or discarded dead event leaves the list, the events held behind it are released; unknown ids
raise :class:`ledgerbox.admin.NotFoundError`; every action (dry runs too) gets an audit id
and is kept in :attr:`InMemorySource.actions`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ledgerbox.admin import (
    ActionResult,
    DeadEvent,
    DlqRecord,
    HeldKey,
    NotFoundError,
    PartitionLag,
    RefusedError,
)
from ledgerbox.console._config import ServiceTarget
from ledgerbox.console._source import RelayPanel

__all__ = ["InMemorySource", "ServiceData"]


@dataclass
class ServiceData:
    """What :class:`InMemorySource` shows for one service (mutable: tests set it up)."""

    status: RelayPanel = field(default_factory=lambda: RelayPanel(0, None, 0, 0))
    published_total: float | None = None
    dead: list[DeadEvent] = field(default_factory=list)
    dlq: dict[str, list[DlqRecord]] = field(default_factory=dict)
    lag: dict[str, list[PartitionLag]] = field(default_factory=dict)
    fail: dict[str, Exception] = field(default_factory=dict)
    """Section name (``status``, ``dead``, ``held``, ``dlq``, ``lag``) -> error it raises."""


class InMemorySource:
    """A :class:`~ledgerbox.console.ConsoleSource` over :class:`ServiceData` per service name.

    Parameters
    ----------
    services : dict[str, ServiceData] | None
        By service name; a name not in it shows empty sections.
    """

    def __init__(self, services: dict[str, ServiceData] | None = None) -> None:
        self.services: dict[str, ServiceData] = services or {}
        self.actions: list[ActionResult] = []
        self._audit = itertools.count(1)

    def _data(self, service: ServiceTarget, section: str) -> ServiceData:
        data = self.services.setdefault(service.name, ServiceData())
        if section in data.fail:
            raise data.fail[section]
        return data

    async def relay_status(self, service: ServiceTarget) -> RelayPanel:
        return self._data(service, "status").status

    async def published_total(self, service: ServiceTarget) -> float | None:
        return self._data(service, "status").published_total

    async def held_keys(self, service: ServiceTarget) -> list[HeldKey]:
        held: dict[str, HeldKey] = {}
        for d in sorted(self._data(service, "held").dead, key=lambda d: d.id):
            first = held.get(d.key)
            if first is None:
                held[d.key] = HeldKey(
                    key=d.key,
                    dead_id=d.id,
                    dead_event_id=d.event_id,
                    dead_count=1,
                    held=d.held_behind,
                    since=d.created_at,
                )
            else:
                held[d.key] = HeldKey(
                    key=d.key,
                    dead_id=first.dead_id,
                    dead_event_id=first.dead_event_id,
                    dead_count=first.dead_count + 1,
                    held=first.held + d.held_behind,
                    since=first.since,
                )
        return [h for h in held.values() if h.held or h.dead_count]

    async def dead_events(self, service: ServiceTarget) -> list[DeadEvent]:
        return sorted(self._data(service, "dead").dead, key=lambda d: d.id)

    async def dlq_records(self, service: ServiceTarget, dlq_topic: str) -> list[DlqRecord]:
        records = self._data(service, "dlq").dlq.get(dlq_topic, [])
        return [r for r in records if r.state == "dead"]

    async def lag(self, service: ServiceTarget, group: str) -> list[PartitionLag]:
        return self._data(service, "lag").lag.get(group, [])

    def _result(
        self, action: str, actor: str, dry_run: bool, ids: list[str], changed: int
    ) -> ActionResult:
        result = ActionResult(
            action=action,
            actor=actor,
            dry_run=dry_run,
            ids=ids,
            changed=0 if dry_run else changed,
            audit_id=next(self._audit),
            at=datetime.now(UTC),
        )
        self.actions.append(result)
        return result

    async def _dead_action(
        self, service: ServiceTarget, ids: Sequence[int], actor: str, dry_run: bool, verb: str
    ) -> ActionResult:
        data = self._data(service, "dead")
        by_id = {d.id: d for d in data.dead}
        for row_id in ids:
            if row_id not in by_id:
                raise NotFoundError(
                    f"no dead event {row_id}: list them with `ledgerbox relay dead list`"
                )
        changed = sum(1 + by_id[i].held_behind if verb == "replay" else 1 for i in ids)
        if not dry_run:
            data.dead = [d for d in data.dead if d.id not in set(ids)]
        return self._result(f"relay.dead.{verb}", actor, dry_run, [str(i) for i in ids], changed)

    async def replay_dead(
        self, service: ServiceTarget, ids: Sequence[int], *, actor: str, dry_run: bool
    ) -> ActionResult:
        return await self._dead_action(service, ids, actor, dry_run, "replay")

    async def discard_dead(
        self, service: ServiceTarget, ids: Sequence[int], *, actor: str, dry_run: bool
    ) -> ActionResult:
        return await self._dead_action(service, ids, actor, dry_run, "discard")

    async def _dlq_action(
        self, service: ServiceTarget, refs: Sequence[str], actor: str, dry_run: bool, verb: str
    ) -> ActionResult:
        data = self._data(service, "dlq")
        by_ref = {r.ref: (topic, r) for topic, rs in data.dlq.items() for r in rs}
        for ref in refs:
            if ref not in by_ref:
                raise NotFoundError(f"no DLQ record {ref}")
            record = by_ref[ref][1]
            if record.state == "discarded":
                raise RefusedError(f"DLQ record {ref} was discarded: it cannot be replayed")
            if verb == "replay" and record.group is None:
                raise RefusedError(f"DLQ record {ref} has no consumer group header")
        if not dry_run:
            state = "replayed" if verb == "replay" else "discarded"
            for ref in refs:
                topic, record = by_ref[ref]
                data.dlq[topic] = [
                    _with_state(r, state) if r.ref == ref else r for r in data.dlq[topic]
                ]
        return self._result(f"consumer.dlq.{verb}", actor, dry_run, list(refs), len(refs))

    async def replay_dlq(
        self, service: ServiceTarget, refs: Sequence[str], *, actor: str, dry_run: bool
    ) -> ActionResult:
        return await self._dlq_action(service, refs, actor, dry_run, "replay")

    async def discard_dlq(
        self, service: ServiceTarget, refs: Sequence[str], *, actor: str, dry_run: bool
    ) -> ActionResult:
        return await self._dlq_action(service, refs, actor, dry_run, "discard")


def _with_state(record: DlqRecord, state: str) -> DlqRecord:
    import dataclasses

    return dataclasses.replace(record, state=state)
