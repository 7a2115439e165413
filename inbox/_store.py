"""The inbox's storage seam: the only module of the consumer that writes inbox SQL.

Every statement is built once per store (named attributes) and run through a :class:`Tx`, so
the same query serves async and sync handlers.
"""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncEngine

from inbox._table import InboxStatus, InboxTable
from inbox._tx import Tx

__all__ = ["InboxStore"]

#: ``last_error`` is cut to this many characters; the full text goes to the dead-letter topic.
MAX_ERROR_CHARS = 2000


class InboxStore:
    """Inbox queries of one consumer group.

    Parameters
    ----------
    table : InboxTable
        The inbox table.
    group : str
        The consumer group all rows belong to.
    """

    def __init__(self, table: InboxTable, group: str) -> None:
        self.table = table
        self.group = group
        t = table.table
        #: PostgreSQL's default name of the primary key: 23505 on it is a duplicate (C05).
        self.pk_constraint = f"{table.name}_pkey"
        self._key = [t.c.consumer_group, t.c.event_id]
        # Claim: insert DONE; a conflict on a DONE row returns nothing (duplicate), a conflict
        # on a FAILED row (a dead-lettered event replayed) takes it over. A concurrent claimant
        # waits on the unique index until the first commits or rolls back (C05).
        claim = pg_insert(t)
        self._claim = claim.on_conflict_do_update(
            index_elements=self._key,
            set_={
                "status": int(InboxStatus.DONE),
                "attempts": t.c.attempts + 1,
                "last_seen_at": sa.func.now(),
                "topic": claim.excluded.topic,
                "partition": claim.excluded.partition,
                "offset": claim.excluded.offset,
                "last_error": None,
            },
            where=t.c.status == int(InboxStatus.FAILED),
        ).returning(t.c.event_id)
        # A dead-lettered event: FAILED with its error, unless its effect already committed.
        fail = pg_insert(t)
        self._fail = fail.on_conflict_do_update(
            index_elements=self._key,
            set_={
                "status": int(InboxStatus.FAILED),
                "attempts": t.c.attempts + fail.excluded.attempts,
                "last_seen_at": sa.func.now(),
                "last_error": fail.excluded.last_error,
            },
            where=t.c.status != int(InboxStatus.DONE),
        )
        older = sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, sa.bindparam("age_s"))
        victims = (
            sa.select(t.c.event_id)
            .where(t.c.consumer_group == self.group, t.c.first_seen_at < older)
            .limit(sa.bindparam("batch"))
            .scalar_subquery()
        )
        self._purge = sa.delete(t).where(
            t.c.consumer_group == self.group, t.c.event_id.in_(victims)
        )

    def _values(self, event_id: uuid.UUID, event_type: str | None, record: Any) -> dict[str, Any]:
        return {
            "consumer_group": self.group,
            "event_id": event_id,
            "event_type": event_type,
            "topic": record.topic,
            "partition": record.partition,
            "offset": record.offset,
        }

    async def claim(self, tx: Tx, event_id: uuid.UUID, event_type: str, record: Any) -> bool:
        """Insert the event's inbox row as DONE in ``tx``; False if its effect already committed.

        The row commits or rolls back with the handler's changes (same transaction).
        """
        values = self._values(event_id, event_type, record)
        values["status"] = int(InboxStatus.DONE)
        return bool((await tx.execute(self._claim, values)).rows)

    async def claim_many(self, tx: Tx, items: list[tuple[uuid.UUID, str, Any]]) -> set[uuid.UUID]:
        """Insert the inbox rows of several distinct events in ONE statement in ``tx``.

        ``items`` are ``(event_id, event_type, record)`` with distinct event ids. Returns the
        ids whose row was inserted (or taken over from FAILED): their handlers must run in
        ``tx``; the others already committed their effect.
        """
        rows = []
        for event_id, event_type, record in items:
            values = self._values(event_id, event_type, record)
            values["status"] = int(InboxStatus.DONE)
            rows.append(values)
        result = await tx.execute(self._claim.values(rows))
        return {row[0] for row in result.rows}

    async def record_failure(
        self,
        tx: Tx,
        event_id: uuid.UUID,
        event_type: str | None,
        record: Any,
        error: str,
        attempts: int,
    ) -> None:
        """Upsert the row as FAILED with ``error`` (never over a DONE row). Caller commits."""
        values = self._values(event_id, event_type, record)
        values.update(
            status=int(InboxStatus.FAILED), attempts=attempts, last_error=error[:MAX_ERROR_CHARS]
        )
        await tx.execute(self._fail, values)

    async def purge_batch(self, engine: AsyncEngine, older_than_s: float, batch: int) -> int:
        """Delete at most ``batch`` rows of this group first seen more than ``older_than_s``
        seconds ago, in one short transaction. Returns how many were deleted."""
        async with engine.begin() as conn:
            result = await conn.execute(self._purge, {"age_s": older_than_s, "batch": batch})
            return int(result.rowcount)
