"""The relay side of the operator API: dead-lettered outbox rows and the keys they hold.

Built on the relay store's own operator calls (``replay_dead_lettered``: the row, the held
rows of its key and the key's rows not yet published are stamped with the replaying
transaction's id, so they are read again in id order; ``discard_dead_lettered``: the row
gets ``status = 4`` and the held rows of its key go on): no second mechanism (docs/relay.md,
"Dead-lettered events"; docs/operations.md). The event id never changes, so a consumer
that applied the event before recognises the replayed record as a duplicate.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from ledgerbox._core.names import DEFAULT_SHARD_COUNT
from ledgerbox.admin._audit import AdminStore, log_action
from ledgerbox.admin._errors import InvalidFilterError, NotFoundError
from ledgerbox.admin._types import (
    ActionResult,
    Database,
    DeadEvent,
    DeadFilter,
    HeldKey,
    RelayStatus,
    ShardOwner,
    audit_actor,
)
from ledgerbox.relay._config import RelayConfig
from ledgerbox.relay._pgstore import PgRelayStore
from ledgerbox.relay._status import UNUSED_KAFKA
from ledgerbox.relay._store import DeadQuery, DeadRow, HeldKeyRow

__all__ = [
    "discard_dead_events",
    "held_keys",
    "list_dead_events",
    "relay_status",
    "replay_dead_events",
    "show_dead_event",
]

REPLAY = "relay.dead.replay"
DISCARD = "relay.dead.discard"

#: Outbox row ids are ``bigint``: no row has an id outside ``1..MAX_ROW_ID``.
MAX_ROW_ID = 2**63 - 1


def relay_store(db: Database) -> PgRelayStore:
    """The relay store of ``db`` for an operator (``application_name =
    ledgerbox-relay-admin``); it never talks to Kafka."""
    config = RelayConfig(
        database_url=db.url,
        kafka_bootstrap_servers=UNUSED_KAFKA,
        outbox_table=db.outbox_table,
        schema=db.schema,
    )
    return PgRelayStore(config, "admin")


def _query(
    filter: DeadFilter, *, ids: Sequence[int] | None = None, body: bool = False
) -> DeadQuery:
    return DeadQuery(
        ids=ids,
        key=filter.key,
        event_type=filter.event_type,
        topic=filter.topic,
        older_than_s=filter.older_than_s,
        error=filter.error,
        limit=filter.limit,
        with_body=body,
    )


def _event(row: DeadRow) -> DeadEvent:
    return DeadEvent(
        id=row.id,
        event_id=row.event_id,
        key=row.key,
        event_type=row.event_type,
        topic=row.topic,
        shard=row.shard,
        attempts=row.attempts,
        last_error=row.last_error,
        created_at=row.created_at,
        occurred_at=row.occurred_at,
        held_behind=row.held_behind,
        payload=row.payload,
        headers=row.headers,
    )


async def list_dead_events(db: Database, filter: DeadFilter | None = None) -> list[DeadEvent]:
    """Dead-lettered outbox rows (``status = 2``) matching ``filter``, in id order.

    Parameters
    ----------
    db : Database
    filter : DeadFilter | None
        ``None``: the first 100 dead-lettered rows.

    Returns
    -------
    list[DeadEvent]
        Without payload and headers (:func:`show_dead_event` has them). A read: nothing is
        locked or changed.

    Raises
    ------
    ledgerbox.DatabaseError
        If the read failed.
    """
    store = relay_store(db)
    try:
        rows = await store.dead_lettered(_query(filter or DeadFilter()))
    finally:
        await store.aclose()
    return [_event(r) for r in rows]


async def show_dead_event(db: Database, row_id: int) -> DeadEvent:
    """One dead-lettered row with its payload and headers (JSON text).

    Raises
    ------
    ledgerbox.admin.NotFoundError
        No dead-lettered row has this id (unknown, published, replayed or discarded).
    ledgerbox.DatabaseError
        If the read failed.
    """
    if not 0 < row_id <= MAX_ROW_ID:
        raise _not_found(row_id)
    store = relay_store(db)
    try:
        rows = await store.dead_lettered(DeadQuery(ids=[row_id], limit=1, with_body=True))
    finally:
        await store.aclose()
    if not rows:
        raise _not_found(row_id)
    return _event(rows[0])


async def held_keys(db: Database, *, limit: int = 100) -> list[HeldKey]:
    """Keys with a dead-lettered row, by that row's id: with ``on_dead_letter="hold"`` each
    later row of the key waits (``held``) until the row is replayed or discarded.

    Raises
    ------
    ledgerbox.DatabaseError
        If the read failed.
    """
    store = relay_store(db)
    try:
        rows = await store.held_keys(limit)
    finally:
        await store.aclose()
    return _held(rows)


def _held(rows: Sequence[HeldKeyRow]) -> list[HeldKey]:
    return [
        HeldKey(
            key=r.key,
            dead_id=r.dead_id,
            dead_event_id=r.dead_event_id,
            dead_count=r.dead_count,
            held=r.held,
            since=r.since,
        )
        for r in rows
    ]


async def relay_status(
    db: Database, *, shard_count: int = DEFAULT_SHARD_COUNT, held_limit: int = 20
) -> RelayStatus:
    """What ``ledgerbox relay status`` shows, as data (the console's status panel).

    Parameters
    ----------
    db : Database
    shard_count : int
        The relays' ``shard_count`` (default 64).
    held_limit : int
        At most this many held keys.

    Raises
    ------
    ledgerbox.DatabaseError
        If the read failed. A read: nothing is locked or changed.
    """
    store = relay_store(db)
    try:
        stats = await store.stats(shard_count)
        keys = await store.held_keys(held_limit)
    finally:
        await store.aclose()
    return RelayStatus(
        pending=stats.pending,
        oldest_pending_age_s=stats.oldest_pending_age_s,
        dead_lettered=stats.dead_lettered,
        held=stats.held,
        owners=[ShardOwner(shard=s, owner=o, fence=f, live=live) for s, o, f, live in stats.owners],
        refused=list(stats.refused),
        held_keys=_held(keys),
        stray=stats.stray,
    )


async def replay_dead_events(
    db: Database,
    ids: Sequence[int] = (),
    *,
    filter: DeadFilter | None = None,
    actor: str | None = None,
    dry_run: bool = False,
) -> ActionResult:
    """Send dead-lettered rows again: each row, then the rows its key held behind it, in id
    order, with their original event ids (a consumer that applied one already sees a
    duplicate). The relay publishes them at its next claim.

    Parameters
    ----------
    db : Database
    ids : Sequence[int]
        Outbox row ids; or give ``filter`` (exactly one of the two).
    filter : DeadFilter | None
        Replay the rows it selects (up to its ``limit``).
    actor : str | None
        Who acts (audit); ``None``: the OS user; empty or blank: refused
        (:class:`~ledgerbox.admin.InvalidFilterError`).
    dry_run : bool
        Change nothing; the audit row is written, flagged.

    Returns
    -------
    ActionResult
        ``changed``: rows stamped (the dead rows and the held rows released with them).

    Raises
    ------
    ledgerbox.admin.InvalidFilterError
        Both or neither of ``ids`` and ``filter``, or an empty or blank ``actor``.
    ledgerbox.admin.NotFoundError
        An id is not a dead-lettered row, or ``filter`` selects none; nothing was changed,
        no audit row written.
    ledgerbox.DatabaseError
        A database call failed. The audit table is checked first (missing: migration 0003
        not applied; or no INSERT privilege): then nothing is changed. Each row is replayed
        in its own transaction (the relay store's); the rows done before a later failure
        stay replayed and are audited.
    """
    return await _act(db, REPLAY, ids, filter, actor, dry_run)


async def discard_dead_events(
    db: Database,
    ids: Sequence[int] = (),
    *,
    filter: DeadFilter | None = None,
    actor: str | None = None,
    dry_run: bool = False,
) -> ActionResult:
    """Give up dead-lettered rows (``status = 4``: never sent); the rows their keys held go
    on, in id order. Parameters, result and errors as :func:`replay_dead_events`
    (``changed``: the discarded rows and the held rows released)."""
    return await _act(db, DISCARD, ids, filter, actor, dry_run)


async def _act(
    db: Database,
    action: str,
    ids: Sequence[int],
    filter: DeadFilter | None,
    actor: str | None,
    dry_run: bool,
) -> ActionResult:
    actor = audit_actor(actor)
    if bool(ids) == (filter is not None):
        raise InvalidFilterError(
            "give either outbox row ids or a filter, not both and not neither "
            "(command line: ids, or --all-matching with --key/--event-type/--topic/...)",
            setting="ids",
        )
    impossible = sorted(i for i in ids if not 0 < i <= MAX_ROW_ID)
    if impossible:
        raise _not_found(impossible[0])
    filters: dict[str, Any] = {"ids": list(ids)} if filter is None else filter.to_json()
    store = relay_store(db)
    admin = AdminStore(db)
    done: list[str] = []
    changed = 0
    try:
        # Before any row changes: the audit row written at the end must be possible (the
        # operator tables of revision 0003 exist and the role may insert), or a replay would
        # be done, unaudited, and reported as failed.
        await admin.check_audit()
        if filter is None:
            wanted = sorted(set(ids))
            rows = await store.dead_lettered(DeadQuery(ids=wanted, limit=len(wanted)))
            missing = sorted(set(wanted) - {r.id for r in rows})
            if missing:
                raise _not_found(missing[0])
        else:
            rows = await store.dead_lettered(_query(filter))
            if not rows:
                # Nothing to do is not an action: no audit row (docs/operations.md).
                raise NotFoundError(
                    "no dead-lettered event matches the filters "
                    f"{_shown(filter)}: nothing changed, nothing audited; `ledgerbox relay "
                    "dead list` with the same filters shows what they select"
                )
        try:
            if not dry_run:
                for row in rows:  # id order: per key, the earlier dead row first
                    if action == REPLAY:
                        changed += await store.replay_dead_lettered(row.id)
                    else:
                        changed += await store.discard_dead_lettered(row.id)
                    done.append(str(row.id))
            else:
                done = [str(r.id) for r in rows]
        finally:
            # Audited also when a row failed midway: what was done stays done.
            async with admin.begin("audit") as conn:
                audited = await admin.audit(
                    conn,
                    actor=actor,
                    action=action,
                    dry_run=dry_run,
                    filters=filters,
                    ids=done,
                    changed=changed,
                )
    finally:
        await store.aclose()
        await admin.aclose()
    result = ActionResult(
        action=action,
        actor=actor,
        dry_run=dry_run,
        ids=done,
        changed=changed,
        audit_id=audited.id,
        at=audited.at.astimezone(dt.UTC),
    )
    log_action(result, filters)
    return result


def _shown(filter: DeadFilter) -> str:
    given = {k: v for k, v in filter.to_json().items() if v is not None and k != "limit"}
    return " ".join(f"{k}={v!r}" for k, v in sorted(given.items())) or "(none)"


def _not_found(row_id: int) -> NotFoundError:
    return NotFoundError(
        f"outbox row {row_id} is not dead-lettered (unknown, published, replayed or "
        "discarded): `ledgerbox relay dead list` shows the dead-lettered rows"
    )
