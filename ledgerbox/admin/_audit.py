"""The operator API's storage seam: the ONLY module of ``ledgerbox.admin`` that runs SQL.

It writes the audit trail (``ledgerbox_ops_audit``: one row per operator action, dry runs
too) and the state of dead-letter records (``ledgerbox_dlq_action``), and asks the inbox
for a replay (the inbox store's own statement ``REQUEST_REPLAY``, run here so that it
commits in the same transaction as the audit row). Reads and writes of the outbox go
through the relay store (:class:`ledgerbox.relay._pgstore.PgRelayStore`). Driver errors
become :class:`ledgerbox.DatabaseError` here.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, LiteralString

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from ledgerbox._core.database_url import connect_args, sqlalchemy_url
from ledgerbox._core.errors import DatabaseError
from ledgerbox._core.faults import Fault
from ledgerbox.admin._table import AUDIT_TABLE, DLQ_ACTION_TABLE
from ledgerbox.admin._types import ActionResult, AuditEntry, Database
from ledgerbox.inbox._store import APPLIED, CANCEL_REPLAY, REQUEST_REPLAY

__all__ = ["AdminStore", "Audited", "async_url", "list_audit", "log_action"]

log = logging.getLogger("ledgerbox.admin")

INSERT_AUDIT: LiteralString = """
INSERT INTO {audit} (actor, action, dry_run, filters, ids, changed)
VALUES (:actor, :action, :dry_run, CAST(:filters AS jsonb), CAST(:ids AS jsonb), :changed)
RETURNING id, at
"""
# Raises undefined_table (42P01) when the table is missing; false without INSERT privilege.
CAN_AUDIT: LiteralString = """
SELECT has_table_privilege(CAST(:audit AS text), 'INSERT')
"""
# The same for the inbox table a DLQ replay updates (its group's row: REPLAY_REQUESTED).
CAN_UPDATE: LiteralString = """
SELECT has_table_privilege(CAST(:table AS text), 'UPDATE')
"""
LIST_AUDIT: LiteralString = """
SELECT id, at, actor, action, dry_run, filters, ids, changed FROM {audit}
WHERE CAST(:action AS text) IS NULL OR action = CAST(:action AS text)
ORDER BY id DESC LIMIT :limit
"""
DLQ_STATES: LiteralString = """
SELECT "partition", "offset", state FROM {dlq_action} WHERE dlq_topic = :topic
"""
# A discard is final; a replayed record may be replayed again (the inbox recognises an
# applied event by its id) or discarded.
MARK_DLQ: LiteralString = """
INSERT INTO {dlq_action} AS a (dlq_topic, "partition", "offset", consumer_group, state, audit_id)
SELECT :topic, v.p, v.o, v.g, :state, :audit_id
FROM unnest(CAST(:partitions AS integer[]), CAST(:offsets AS bigint[]), CAST(:groups AS text[]))
  AS v(p, o, g)
ON CONFLICT (dlq_topic, "partition", "offset") DO UPDATE
SET state = EXCLUDED.state, audit_id = EXCLUDED.audit_id, at = now()
WHERE a.state <> 'discarded'
"""


class Audited:
    """What :meth:`AdminStore.audit` wrote: the audit row's ``id`` and ``at`` (UTC)."""

    __slots__ = ("at", "id")

    def __init__(self, id: int, at: dt.datetime) -> None:
        self.id = id
        self.at = at


def async_url(url: str) -> str:
    """``url`` for SQLAlchemy's async psycopg driver
    (:func:`ledgerbox._core.database_url.sqlalchemy_url`)."""
    return sqlalchemy_url(url)


def log_action(result: ActionResult, filters: dict[str, Any]) -> None:
    """The one INFO line of an operator action (logger ``ledgerbox.admin``)."""
    log.info(
        "operator action %s by %s: ids=%s changed=%d dry_run=%s filters=%s audit_id=%d",
        result.action,
        result.actor,
        result.ids,
        result.changed,
        result.dry_run,
        json.dumps(filters, sort_keys=True, default=str),
        result.audit_id,
    )


class AdminStore:
    """The operator tables of one database (:class:`~ledgerbox.admin.Database`).

    Every method raises :class:`ledgerbox.DatabaseError` when the database call fails
    (within :meth:`begin`, nothing of the transaction is committed).
    """

    def __init__(self, db: Database) -> None:
        self.db = db
        prefix = f"{db.schema}." if db.schema else ""  # validated identifiers
        names = {
            "audit": f"{prefix}{AUDIT_TABLE}",
            "dlq_action": f"{prefix}{DLQ_ACTION_TABLE}",
            "table": f"{prefix}{db.inbox_table}",
        }
        self._audit_name = names["audit"]
        self._inbox_name = names["table"]
        self._can_audit = sa.text(CAN_AUDIT)
        self._can_update = sa.text(CAN_UPDATE)
        self._insert_audit = sa.text(INSERT_AUDIT.format(**names))
        self._list_audit = sa.text(LIST_AUDIT.format(**names))
        self._dlq_states = sa.text(DLQ_STATES.format(**names))
        self._mark_dlq = sa.text(MARK_DLQ.format(**names))
        self._request_replay = sa.text(REQUEST_REPLAY.format(**names))
        self._cancel_replay = sa.text(CANCEL_REPLAY.format(**names))
        self._applied = sa.text(APPLIED.format(**names))
        self._engine: AsyncEngine = create_async_engine(
            async_url(db.url), poolclass=sa.pool.NullPool, connect_args=connect_args(db.url)
        )

    @contextlib.asynccontextmanager
    async def begin(self, what: str) -> AsyncIterator[AsyncConnection]:
        """One transaction (committed when the block ends without an exception)."""
        try:
            async with self._engine.begin() as conn:
                yield conn
        except DatabaseError:
            raise
        except sa.exc.SQLAlchemyError as exc:
            error = DatabaseError.translate(exc, what)
            if error is None:
                raise
            raise error from exc

    async def check_audit(self) -> None:
        """Raise unless an audit row can be written: call it before an action changes
        anything.

        Raises
        ------
        ledgerbox.DatabaseError
            The audit table is missing (``sqlstate`` 42P01; the message says to run
            ``ledgerbox migrate``), the role may not insert into it (``sqlstate`` 42501), or
            the database call failed.
        """
        try:
            async with self.begin("audit check") as conn:
                allowed = (
                    await conn.execute(self._can_audit, {"audit": self._audit_name})
                ).scalar()
        except DatabaseError as exc:
            if exc.sqlstate != "42P01":
                raise
            raise DatabaseError(
                f"the operator audit table {self._audit_name} does not exist in "
                f"{self.db.label} (schema revision 0003 missing): run `ledgerbox migrate`; "
                "nothing was changed",
                fault=exc.fault,
                sqlstate=exc.sqlstate,
            ) from exc
        if not allowed:
            raise DatabaseError(
                f"this role may not insert into {self._audit_name} in {self.db.label}: grant "
                'it INSERT (docs/operations.md, "The audit trail"); nothing was changed',
                fault=Fault.ENVIRONMENT,
                sqlstate="42501",
            )

    async def check_inbox(self) -> None:
        """Raise unless the inbox table a replay updates exists and this role may update it:
        call it before a replay (a dry run too) writes its audit row.

        Raises
        ------
        ledgerbox.DatabaseError
            The inbox table is missing (``sqlstate`` 42P01: a wrong ``--inbox-table`` or
            ``--schema``, or the tables not migrated), the role may not update it (42501),
            or the database call failed. The message names the table and the fix.
        """
        try:
            async with self.begin("inbox table check") as conn:
                allowed = (
                    await conn.execute(self._can_update, {"table": self._inbox_name})
                ).scalar()
        except DatabaseError as exc:
            if exc.sqlstate != "42P01":
                raise
            raise DatabaseError(
                f"the inbox table {self._inbox_name} does not exist in {self.db.label}: give "
                "the consumer's table with --inbox-table and --schema (or run `ledgerbox "
                "migrate`); nothing was changed, nothing audited",
                fault=exc.fault,
                sqlstate=exc.sqlstate,
            ) from exc
        if not allowed:
            raise DatabaseError(
                f"this role may not update the inbox table {self._inbox_name} in "
                f'{self.db.label}: grant it UPDATE (docs/security.md, "Least privilege"); '
                "nothing was changed, nothing audited",
                fault=Fault.ENVIRONMENT,
                sqlstate="42501",
            )

    async def audit(
        self,
        conn: AsyncConnection,
        *,
        actor: str,
        action: str,
        dry_run: bool,
        filters: dict[str, Any],
        ids: Sequence[str],
        changed: int,
    ) -> Audited:
        """Insert the audit row of one action in ``conn``'s transaction (the caller logs
        the action with :func:`log_action` once it committed)."""
        params = {
            "actor": actor,
            "action": action,
            "dry_run": dry_run,
            "filters": json.dumps(filters, sort_keys=True, default=str),
            "ids": json.dumps(list(ids)),
            "changed": changed,
        }
        row = (await conn.execute(self._insert_audit, params)).one()
        return Audited(int(row[0]), row[1])

    async def list_audit(self, limit: int, action: str | None) -> list[AuditEntry]:
        """The newest ``limit`` audit rows (of ``action`` only, if given), newest first."""
        async with self.begin("list audit") as conn:
            rows = (await conn.execute(self._list_audit, {"limit": limit, "action": action})).all()
        return [
            AuditEntry(
                id=int(r[0]),
                at=r[1],
                actor=r[2],
                action=r[3],
                dry_run=bool(r[4]),
                filters=dict(r[5]),
                ids=[str(i) for i in r[6]],
                changed=int(r[7]),
            )
            for r in rows
        ]

    async def dlq_states(self, dlq_topic: str) -> dict[tuple[int, int], str]:
        """``(partition, offset) -> "replayed" | "discarded"`` of ``dlq_topic``'s records an
        operator acted on."""
        async with self.begin("read dead-letter states") as conn:
            rows = (await conn.execute(self._dlq_states, {"topic": dlq_topic})).all()
        return {(int(p), int(o)): str(s) for p, o, s in rows}

    async def mark_dlq(
        self,
        conn: AsyncConnection,
        dlq_topic: str,
        records: Sequence[tuple[int, int, str | None]],
        state: str,
        audit_id: int,
    ) -> int:
        """Record ``(partition, offset, group)`` of ``dlq_topic`` as ``state`` (a discarded
        record stays discarded); returns the rows written."""
        params = {
            "topic": dlq_topic,
            "state": state,
            "audit_id": audit_id,
            "partitions": [p for p, _o, _g in records],
            "offsets": [o for _p, o, _g in records],
            "groups": [g for _p, _o, g in records],
        }
        return int((await conn.execute(self._mark_dlq, params)).rowcount)

    async def request_replay(
        self, conn: AsyncConnection, group: str, event_ids: Sequence[uuid.UUID]
    ) -> int:
        """The inbox's replay hook in ``conn``'s transaction: ``group``'s DEAD_LETTERED rows
        of ``event_ids`` become REPLAY_REQUESTED; returns how many."""
        params = {"group": group, "event_ids": list(event_ids)}
        return int((await conn.execute(self._request_replay, params)).rowcount)

    async def cancel_replay(
        self, conn: AsyncConnection, group: str, event_ids: Sequence[uuid.UUID]
    ) -> int:
        """A discard's hook in ``conn``'s transaction: ``group``'s REPLAY_REQUESTED rows of
        ``event_ids`` go back to DEAD_LETTERED; returns how many."""
        params = {"group": group, "event_ids": list(event_ids)}
        return int((await conn.execute(self._cancel_replay, params)).rowcount)

    async def applied(
        self, conn: AsyncConnection, group: str, event_ids: Sequence[uuid.UUID]
    ) -> list[uuid.UUID]:
        """Which of ``event_ids`` ``group`` applied (its inbox row is DONE)."""
        params = {"group": group, "event_ids": list(event_ids)}
        return [uuid.UUID(str(e)) for e in (await conn.execute(self._applied, params)).scalars()]

    async def aclose(self) -> None:
        """Release the engine."""
        await self._engine.dispose()


async def list_audit(
    db: Database, *, limit: int = 50, action: str | None = None
) -> list[AuditEntry]:
    """The audit rows of operator actions, newest first.

    Parameters
    ----------
    db : Database
    limit : int
        At most this many rows.
    action : str | None
        Only this action (``relay.dead.replay``, ...); ``None``: all.

    Raises
    ------
    ledgerbox.DatabaseError
        If the read failed (e.g. the operator tables are missing: run ``ledgerbox
        migrate``).
    """
    store = AdminStore(db)
    try:
        return await store.list_audit(limit, action)
    finally:
        await store.aclose()
