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

import enum
import uuid
from typing import Any, LiteralString

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from ledgerbox.inbox._table import InboxStatus, InboxTable
from ledgerbox.inbox._tx import Tx, translate_errors

__all__ = ["ClaimResult", "InboxStore"]


class ClaimResult(enum.Enum):
    """What :meth:`InboxStore.claim` did with the event's inbox row."""

    FINAL = "final"  # a DONE or DEAD_LETTERED row exists: the handler must not run
    NEW = "new"  # inserted as DONE: the first delivery to this group
    REPLAY = "replay"  # a REPLAY_REQUESTED row taken over: an operator's replay runs it


#: ``last_error`` is cut to this many characters; the full text goes to the dead-letter topic.
MAX_ERROR_CHARS = 2000


def _storable(text: str) -> str:
    """``text`` as PostgreSQL ``text`` can hold it: NUL as U+FFFD, a lone surrogate as its
    ``\\udcff`` escape. An error message is any exception's text (a handler's too): with
    either, writing the dead-letter row failed on every retry and stopped the partition."""
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# {table} is the validated (schema-qualified) table name. Status numbers are InboxStatus
# values (1 DONE, 2 DEAD_LETTERED, 3 REPLAY_REQUESTED); a unit test pins them.

# Claim: insert DONE; a conflict on a DONE or DEAD_LETTERED row returns nothing (both are
# final: a duplicate, or a dead-lettered event whose handler must not run again, C17), a
# conflict on a REPLAY_REQUESTED row (an operator asked for a replay) takes it over. A
# concurrent claimant waits on the unique index until the first commits or rolls back (C05).
# ``check_transition`` in ``_policy.py`` states the same transitions. ``replayed``: the row
# was taken over, not inserted (an upserted row's xmax is the updating transaction; a row
# this statement inserted has none): ``ledgerbox_inbox_replayed_total`` counts those.
_CLAIM_CONFLICT: LiteralString = """
ON CONFLICT (consumer_group, event_id) DO UPDATE SET
    status = 1, attempts = t.attempts + 1, last_seen_at = now(),
    topic = EXCLUDED.topic, "partition" = EXCLUDED."partition", "offset" = EXCLUDED."offset",
    last_error = NULL
WHERE t.status = 3
RETURNING t.event_id, (t.xmax <> '0'::xid) AS replayed
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
# Only when a claim returned fewer rows than it was given (the duplicate path, never the
# path of a new event): the state of the rows it conflicted with. READ COMMITTED: this
# statement sees the row whose commit the conflicting insert waited for.
STATUS_OF: LiteralString = """
SELECT event_id, status FROM {table}
WHERE consumer_group = :group AND event_id = ANY(CAST(:event_ids AS uuid[]))
"""
# A dead-lettered event: DEAD_LETTERED with its error. Over an existing row only when an
# operator's replay failed again (REPLAY_REQUESTED); a DONE row is final, and a
# DEAD_LETTERED one keeps its first reason.
FAIL: LiteralString = """
INSERT INTO {table} AS t
    (consumer_group, event_id, status, attempts, event_type, topic, "partition", "offset",
     last_error)
VALUES (:group, :event_id, 2, :attempts, :event_type, :topic, :partition, :offset, :last_error)
ON CONFLICT (consumer_group, event_id) DO UPDATE SET
    status = 2, attempts = t.attempts + EXCLUDED.attempts, last_seen_at = now(),
    last_error = EXCLUDED.last_error
WHERE t.status = 3
"""
# The operator's replay hook (the replay command sets it, then re-delivers the record): a
# DEAD_LETTERED row becomes REPLAY_REQUESTED, which the next claim of the event takes over.
REQUEST_REPLAY: LiteralString = """
UPDATE {table} SET status = 3, last_seen_at = now()
WHERE consumer_group = :group AND event_id = ANY(CAST(:event_ids AS uuid[])) AND status = 2
"""
# An operator's discard of a replayed dead letter (ledgerbox.admin): the REPLAY_REQUESTED
# row goes back to DEAD_LETTERED, so the republished copy is acknowledged without running
# (a discard is final). It waits for a delivery that holds the row (its transaction), and
# then finds the row DONE: APPLIED names those, and the discard is refused.
CANCEL_REPLAY: LiteralString = """
UPDATE {table} SET status = 2, last_seen_at = now()
WHERE consumer_group = :group AND event_id = ANY(CAST(:event_ids AS uuid[])) AND status = 3
"""
APPLIED: LiteralString = """
SELECT event_id FROM {table}
WHERE consumer_group = :group AND event_id = ANY(CAST(:event_ids AS uuid[])) AND status = 1
ORDER BY event_id
"""
# Retention (G8, C18): a row goes only when it is older than the dedup window AND its record
# can no longer come back to the group: below the group's committed offset of its partition
# (and, with auto_offset_reset="earliest", below the partition's first offset still in the
# log). The caller passes one bound per partition (the smaller of the two); a partition it
# does not pass (no committed offset) keeps all its rows. Rows without an offset are kept.
# The subquery walks rows by age (ix_<table>_first_seen_at) and stops at :batch.
PURGE: LiteralString = """
DELETE FROM {table} AS d
WHERE d.consumer_group = :group AND d.event_id IN (
    SELECT t.event_id FROM {table} AS t
    JOIN unnest(
        CAST(:topics AS text[]), CAST(:partitions AS integer[]), CAST(:bounds AS bigint[])
    ) AS b(topic, "partition", bound)
      ON t.topic = b.topic AND t."partition" = b."partition" AND t."offset" < b.bound
    WHERE t.consumer_group = :group
      AND t.first_seen_at < now() - make_interval(secs => :age_s)
    LIMIT :batch
)
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
        #: PostgreSQL's default name of the primary key: 23505 on it is a duplicate (C05).
        self.pk_constraint = f"{table.name}_pkey"
        # The name is a validated identifier (``[a-z_][a-z0-9_]*``), safe to embed.
        name = table.qualified_name
        self._claim = sa.text(CLAIM.format(table=name))
        self._claim_many = sa.text(CLAIM_MANY.format(table=name))
        self._fail = sa.text(FAIL.format(table=name))
        self._status_of = sa.text(STATUS_OF.format(table=name))
        self._request_replay = sa.text(REQUEST_REPLAY.format(table=name))
        self._purge = sa.text(PURGE.format(table=name))

    def _values(self, event_id: uuid.UUID, event_type: str | None, record: Any) -> dict[str, Any]:
        return {
            "group": self.group,
            "event_id": event_id,
            "event_type": event_type,
            "topic": record.topic,
            "partition": record.partition,
            "offset": record.offset,
        }

    async def claim(self, tx: Tx, event_id: uuid.UUID, event_type: str, record: Any) -> ClaimResult:
        """Insert the event's inbox row as DONE in ``tx`` (``NEW``), or take over a
        REPLAY_REQUESTED one (``REPLAY``); ``FINAL`` if a final row exists (DONE or
        DEAD_LETTERED: :meth:`statuses` says which) and the handler must not run.

        The row commits or rolls back with the handler's changes (same transaction).
        """
        rows = (await tx.execute(self._claim, self._values(event_id, event_type, record))).rows
        if not rows:
            return ClaimResult.FINAL
        return ClaimResult.REPLAY if rows[0][1] else ClaimResult.NEW

    async def statuses(self, tx: Tx, event_ids: list[uuid.UUID]) -> dict[uuid.UUID, InboxStatus]:
        """The status of the rows of ``event_ids`` that exist, read in ``tx``. Used only
        after a claim conflicted (the duplicate path) and for an unparseable record."""
        result = await tx.execute(self._status_of, {"group": self.group, "event_ids": event_ids})
        return {row[0]: InboxStatus(row[1]) for row in result.rows}

    async def claim_many(
        self, tx: Tx, items: list[tuple[uuid.UUID, str, Any]]
    ) -> dict[uuid.UUID, bool]:
        """Insert the inbox rows of several distinct events in ONE statement in ``tx``.

        ``items`` are ``(event_id, event_type, record)`` with distinct event ids. Returns the
        ids whose row was inserted (``False``) or taken over from REPLAY_REQUESTED
        (``True``: an operator's replay): their handlers must run in ``tx``; the others have
        a final row (:meth:`statuses` says which).
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
        return {row[0]: bool(row[1]) for row in result.rows}

    async def record_failure(
        self,
        tx: Tx,
        event_id: uuid.UUID,
        event_type: str | None,
        record: Any,
        error: str,
        attempts: int,
    ) -> None:
        """Upsert the row as DEAD_LETTERED with ``error``: a new row, or one whose replay was
        requested; a DONE row and an earlier DEAD_LETTERED one are left as they are. Caller
        commits. The type and the error are stored as PostgreSQL can hold them
        (:func:`_storable`): an unparseable record's ``ce_type`` may carry a NUL, any
        exception's text a NUL or a lone surrogate, and a row that cannot be written would
        be retried without bound, its partition stopped."""
        stored_type = None if event_type is None else _storable(event_type)
        values = self._values(event_id, stored_type, record)
        values.update(attempts=attempts, last_error=_storable(error[:MAX_ERROR_CHARS]))
        await tx.execute(self._fail, values)

    async def request_replay(self, engine: AsyncEngine, event_ids: list[uuid.UUID]) -> int:
        """The operator's replay hook: mark the DEAD_LETTERED rows of ``event_ids`` as
        REPLAY_REQUESTED, in one short transaction, so that the next delivery of each event
        runs its handler again (docs/inbox.md, "A dead-lettered event is final").

        The replay command (to come) calls this, then delivers the records again (from the
        dead-letter topic to the source topic, or by moving the group's offset back); rows
        in any other state are left alone. Returns how many rows were marked.

        Raises
        ------
        ledgerbox.DatabaseError
            If the update failed; nothing was marked.
        """
        with translate_errors("request replay"):
            async with engine.begin() as conn:
                params = {"group": self.group, "event_ids": list(event_ids)}
                result = await conn.execute(self._request_replay, params)
                return int(result.rowcount)

    async def purge_batch(
        self,
        engine: AsyncEngine,
        older_than_s: float,
        bounds: dict[tuple[str, int], int],
        batch: int,
    ) -> int:
        """Delete at most ``batch`` rows of this group first seen more than ``older_than_s``
        seconds ago whose offset is below the bound of their partition, in one short
        transaction. Returns how many were deleted.

        Parameters
        ----------
        older_than_s : float
            The dedup window, in seconds.
        bounds : dict[tuple[str, int], int]
            ``(topic, partition) -> offset``: the first offset Kafka may still deliver to
            the group on that partition; rows of partitions not in it are kept.
        batch : int
            Rows per transaction.

        Raises
        ------
        ledgerbox.DatabaseError
            If the delete failed (nothing of this batch was deleted).
        """
        if not bounds:
            return 0
        keys = sorted(bounds)
        params = {
            "group": self.group,
            "age_s": older_than_s,
            "batch": batch,
            "topics": [topic for topic, _p in keys],
            "partitions": [partition for _t, partition in keys],
            "bounds": [bounds[key] for key in keys],
        }
        with translate_errors("purge"):
            async with engine.begin() as conn:
                result = await conn.execute(self._purge, params)
                return int(result.rowcount)
