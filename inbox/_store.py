"""The inbox's storage seam: the only module of the consumer that writes inbox SQL.

The hot statements are SQL text kept in named constants (formatted once per store with the
validated table name), not SQLAlchemy ``postgresql.insert(...).on_conflict_do_update(...)``
constructs: SQLAlchemy does not cache the compiled form of the PostgreSQL ``Insert`` (it sets
``inherit_cache = False``), so such a construct was compiled again for every message, which
cost more Python time than the database round trip of the insert itself. A ``text()``
statement is compiled once, and its constant SQL lets psycopg prepare it server-side. Every
statement runs through a :class:`Tx`, so the same query serves async and sync handlers.
"""

from __future__ import annotations

import uuid
from typing import Any, LiteralString

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from ledgerbox.inbox._table import InboxTable
from ledgerbox.inbox._tx import Tx, translate_errors

__all__ = ["InboxStore"]

#: ``last_error`` is cut to this many characters; the full text goes to the dead-letter topic.
MAX_ERROR_CHARS = 2000

# {table} is the validated (schema-qualified) table name. Status numbers are InboxStatus
# values (1 DONE, 2 DEAD_LETTERED); a unit test pins them.

# Claim: insert DONE; a conflict on a DONE row returns nothing (duplicate), a conflict on a
# DEAD_LETTERED row (a dead-lettered event replayed) takes it over. A concurrent claimant waits on
# the unique index until the first commits or rolls back (C05). ``check_transition`` in
# ``_policy.py`` states the same transitions.
_CLAIM_CONFLICT: LiteralString = """
ON CONFLICT (consumer_group, event_id) DO UPDATE SET
    status = 1, attempts = t.attempts + 1, last_seen_at = now(),
    topic = EXCLUDED.topic, "partition" = EXCLUDED."partition", "offset" = EXCLUDED."offset",
    last_error = NULL
WHERE t.status = 2
RETURNING t.event_id
"""
_INSERT: LiteralString = """
INSERT INTO {table} AS t
    (consumer_group, event_id, status, event_type, topic, "partition", "offset")
"""
CLAIM: LiteralString = (
    _INSERT
    + "VALUES (:group, :event_id, 1, :event_type, :topic, :partition, :offset)"
    + _CLAIM_CONFLICT
)
# The same for several events in ONE statement whose text does not depend on their number
# (arrays unnested), so it is prepared once like CLAIM. Rows are inserted in array order.
CLAIM_MANY: LiteralString = (
    _INSERT
    + """SELECT :group, v.event_id, 1, v.event_type, v.topic, v."partition", v."offset"
FROM unnest(
    CAST(:event_ids AS uuid[]), CAST(:event_types AS text[]), CAST(:topics AS text[]),
    CAST(:partitions AS integer[]), CAST(:offsets AS bigint[])
) AS v(event_id, event_type, topic, "partition", "offset")"""
    + _CLAIM_CONFLICT
)
# A dead-lettered event: DEAD_LETTERED with its error, unless its effect already committed.
FAIL: LiteralString = """
INSERT INTO {table} AS t
    (consumer_group, event_id, status, attempts, event_type, topic, "partition", "offset",
     last_error)
VALUES (:group, :event_id, 2, :attempts, :event_type, :topic, :partition, :offset, :last_error)
ON CONFLICT (consumer_group, event_id) DO UPDATE SET
    status = 2, attempts = t.attempts + EXCLUDED.attempts, last_seen_at = now(),
    last_error = EXCLUDED.last_error
WHERE t.status <> 1
"""


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
        # The name is a validated identifier (``[a-z_][a-z0-9_]*``), safe to embed.
        name = table.qualified_name
        self._claim = sa.text(CLAIM.format(table=name))
        self._claim_many = sa.text(CLAIM_MANY.format(table=name))
        self._fail = sa.text(FAIL.format(table=name))
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
            "group": self.group,
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
        return bool(
            (await tx.execute(self._claim, self._values(event_id, event_type, record))).rows
        )

    async def claim_many(self, tx: Tx, items: list[tuple[uuid.UUID, str, Any]]) -> set[uuid.UUID]:
        """Insert the inbox rows of several distinct events in ONE statement in ``tx``.

        ``items`` are ``(event_id, event_type, record)`` with distinct event ids. Returns the
        ids whose row was inserted (or taken over from DEAD_LETTERED): their handlers must run in
        ``tx``; the others already committed their effect.
        """
        params = {
            "group": self.group,
            "event_ids": [event_id for event_id, _t, _r in items],
            "event_types": [event_type for _e, event_type, _r in items],
            "topics": [record.topic for _e, _t, record in items],
            "partitions": [record.partition for _e, _t, record in items],
            "offsets": [record.offset for _e, _t, record in items],
        }
        result = await tx.execute(self._claim_many, params)
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
        """Upsert the row as DEAD_LETTERED with ``error`` (never over DONE). Caller commits."""
        values = self._values(event_id, event_type, record)
        values.update(attempts=attempts, last_error=error[:MAX_ERROR_CHARS])
        await tx.execute(self._fail, values)

    async def purge_batch(self, engine: AsyncEngine, older_than_s: float, batch: int) -> int:
        """Delete at most ``batch`` rows of this group first seen more than ``older_than_s``
        seconds ago, in one short transaction. Returns how many were deleted."""
        with translate_errors("purge"):
            async with engine.begin() as conn:
                result = await conn.execute(self._purge, {"age_s": older_than_s, "batch": batch})
                return int(result.rowcount)
