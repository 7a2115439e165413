"""The relay side of the operator API: dead-lettered outbox rows and the keys they hold.

Built on the relay store's own operator calls (:meth:`ledgerbox.relay._store.RelayStore.
replay_dead_lettered` / ``discard_dead_lettered``): no second mechanism (docs/relay.md,
"Dead-lettered events"; docs/operations.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from ledgerbox.admin._types import ActionResult, Database, DeadEvent, DeadFilter, HeldKey

__all__ = [
    "discard_dead_events",
    "held_keys",
    "list_dead_events",
    "replay_dead_events",
    "show_dead_event",
]


async def list_dead_events(db: Database, filter: DeadFilter | None = None) -> list[DeadEvent]:
    """Dead-lettered outbox rows matching ``filter``, in id order."""
    raise NotImplementedError


async def show_dead_event(db: Database, row_id: int) -> DeadEvent:
    """One dead-lettered row with its payload and headers."""
    raise NotImplementedError


async def held_keys(db: Database, *, limit: int = 100) -> list[HeldKey]:
    """Keys held behind a dead-lettered row."""
    raise NotImplementedError


async def replay_dead_events(
    db: Database,
    ids: Sequence[int] = (),
    *,
    filter: DeadFilter | None = None,
    actor: str | None = None,
    dry_run: bool = False,
) -> ActionResult:
    """Send dead-lettered rows again, in per-key order, with their original event ids."""
    raise NotImplementedError


async def discard_dead_events(
    db: Database,
    ids: Sequence[int] = (),
    *,
    filter: DeadFilter | None = None,
    actor: str | None = None,
    dry_run: bool = False,
) -> ActionResult:
    """Give up dead-lettered rows (never sent); release the rows their keys held."""
    raise NotImplementedError
