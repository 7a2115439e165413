"""The relay's storage seam on PostgreSQL: the ONLY module of ``relay`` that runs SQL.

:class:`PgRelayStore` implements the :class:`~ledgerbox.relay._store.RelayStore` Protocol.
One method per query; the SQL text is kept in named constants. psycopg 3 ``AsyncConnection``
in autocommit mode (every statement is its own transaction; nothing is held open between
calls). Driver errors are translated into :class:`ledgerbox.relay.StoreError` here only,
classified by the one table of :mod:`ledgerbox._core.faults`.

Every time comparison uses the database's ``now()``: clocks of relay machines are never
compared with each other.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, LiteralString

import psycopg
from psycopg import sql

from ledgerbox._core.names import SCHEMA_VERSION_TABLE
from ledgerbox.relay._config import RelayConfig
from ledgerbox.relay._errors import StoreError
from ledgerbox.relay._store import ClaimedEvent, RelayStats, RelayStore, SchemaReport, StoreFactory

__all__ = ["PgRelayStore", "pg_store_factory"]

log = logging.getLogger("ledgerbox.relay.store")

# What a Kafka record needs, pre-formatted by PostgreSQL as text where Python would otherwise
# build objects and stringify them again (measured: record building 17 -> ~3 ms per 1000
# rows). ``occurred_at_ms`` is computed as ``outbox.timestamp_ms`` does, with integers only
# (whole seconds * 1000 + the milliseconds of the second, rounded toward the past; a float8
# multiply was 1 ms early for exact-millisecond times outside roughly 2004-2038), and
# ``ce_time`` as ``datetime.isoformat`` prints a UTC time (no fraction when the microseconds
# are 0), so the records are byte-identical to ``kafka_headers``.
_COLUMNS: LiteralString = (
    "o.id, o.shard, o.topic, o.partition_key, o.payload::text, o.headers::text, "
    "o.event_id::text, o.idempotency_key, o.event_type, o.source, o.aggregate_type, "
    "o.aggregate_id, o.aggregate_version::text, "
    "extract(epoch FROM date_trunc('second', o.occurred_at))::int8 * 1000"
    " + (extract(microseconds FROM o.occurred_at)::int8 %% 1000000) / 1000, "
    "to_char(o.occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS')"
    " || CASE WHEN date_trunc('second', o.occurred_at) = o.occurred_at THEN ''"
    " ELSE to_char(o.occurred_at AT TIME ZONE 'UTC', '.US') END || '+00:00'"
)

# {outbox}, {lease}, {member} are validated identifiers, composed by psycopg.sql.
ENSURE_LEASES: LiteralString = """
INSERT INTO {lease} (shard, fence)
SELECT s, 0 FROM generate_series(-1, %(shard_count)s - 1) AS s
ON CONFLICT (shard) DO NOTHING
"""

HEARTBEAT: LiteralString = """
WITH up AS (
  INSERT INTO {member} AS m (relay_id, started_at, expires_at)
  VALUES (%(me)s, now(), now() + make_interval(secs => %(ttl_s)s))
  ON CONFLICT (relay_id) DO UPDATE SET expires_at = EXCLUDED.expires_at
  RETURNING m.relay_id
)
SELECT 1 + count(*) FROM {member} WHERE expires_at > now() AND relay_id <> %(me)s
"""

RENEW_SHARDS: LiteralString = """
UPDATE {lease} AS l SET expires_at = now() + make_interval(secs => %(ttl_s)s)
FROM unnest(%(shards)s::int2[], %(fences)s::int8[]) AS h(shard, fence)
WHERE l.shard = h.shard AND l.fence = h.fence AND l.owner = %(me)s
RETURNING l.shard, l.fence
"""

# SKIP LOCKED in the subselect: two relays acquiring at once never get the same shard; the
# outer condition is re-checked on the locked row version (READ COMMITTED, EvalPlanQual).
ACQUIRE_SHARDS: LiteralString = """
UPDATE {lease} AS l
SET owner = %(me)s, fence = l.fence + 1, expires_at = now() + make_interval(secs => %(ttl_s)s)
WHERE l.shard IN (
  SELECT f.shard FROM {lease} AS f
  WHERE f.shard BETWEEN %(lo)s AND %(hi)s AND (f.owner IS NULL OR f.expires_at < now())
  ORDER BY f.shard LIMIT %(want)s
  FOR UPDATE SKIP LOCKED
) AND (l.owner IS NULL OR l.expires_at < now())
RETURNING l.shard, l.fence
"""

RELEASE_SHARDS: LiteralString = """
UPDATE {lease} AS l SET owner = NULL, expires_at = NULL
FROM unnest(%(shards)s::int2[], %(fences)s::int8[]) AS h(shard, fence)
WHERE l.shard = h.shard AND l.fence = h.fence AND l.owner = %(me)s
"""

LEAVE: LiteralString = "DELETE FROM {member} WHERE relay_id = %(me)s"

# Per owned shard, the oldest pending rows through the partial index (shard, id) WHERE
# status = 0; the outer LIMIT stops the nested loop once the batch is full. Rows of one
# shard come in id order; the caller sorts by (shard, id) as SQL does not promise the order
# of the nested loop's output.
# Why "shard >= s AND shard <= s ... ORDER BY shard, id" and not "shard = s ORDER BY id":
# with an equality the planner may pick the primary key (perfectly correlated) and filter,
# which on a backlog of few hot keys walks every published row for each empty shard
# (measured: 1.6 s per claim with 200k published + 200k pending rows of one key). Only the
# partial index yields (shard, id) order for a range, so it is always used (7.8 ms).
_CLAIM_HEAD: LiteralString = """
SELECT """
_CLAIM_FROM: LiteralString = """
FROM unnest(%(shards)s::int2[]) AS s(shard)
CROSS JOIN LATERAL (
  SELECT o.* FROM {outbox} AS o
  WHERE o.shard >= s.shard AND o.shard <= s.shard AND o.status = 0
    AND o.id <> ALL(%(exclude)s::int8[])"""
_CLAIM_HOLD: LiteralString = """
    AND NOT EXISTS (
      SELECT 1 FROM {outbox} AS d
      WHERE d.status = 2 AND d.partition_key = o.partition_key AND d.id < o.id)"""
_CLAIM_TAIL: LiteralString = """
  ORDER BY o.shard, o.id LIMIT %(limit)s
) AS o
LIMIT %(limit)s
"""
CLAIM_BATCH_HOLD: LiteralString = _CLAIM_HEAD + _COLUMNS + _CLAIM_FROM + _CLAIM_HOLD + _CLAIM_TAIL
CLAIM_BATCH_SKIP: LiteralString = _CLAIM_HEAD + _COLUMNS + _CLAIM_FROM + _CLAIM_TAIL

# Fencing in SQL: a row is marked only while this relay still holds its shard under the
# fence it claimed it with; otherwise it stays pending and the new owner sends it again.
# The lease check runs once per statement (the shards still held, as an array) instead of a
# join per row: measured 20 ms vs 205 ms for 1000 rows.
MARK_PUBLISHED: LiteralString = """
UPDATE {outbox} AS o SET status = 1, published_at = now(), attempts = o.attempts + 1
WHERE o.id = ANY(%(ids)s::int8[]) AND o.status = 0
  AND o.shard = ANY(ARRAY(
    SELECT l.shard FROM {lease} AS l
    JOIN unnest(%(shards)s::int2[], %(fences)s::int8[]) AS h(shard, fence)
      ON h.shard = l.shard AND h.fence = l.fence
    WHERE l.owner = %(me)s))
"""

MARK_DEAD_LETTERED: LiteralString = """
UPDATE {outbox} AS o SET status = 2, last_error = %(error)s, attempts = o.attempts + 1
FROM {lease} AS l
WHERE o.id = %(id)s AND o.status = 0 AND l.shard = o.shard AND l.owner = %(me)s
  AND l.fence = %(fence)s
"""

# Bounded batches, row locks only (SKIP LOCKED: never waits on, nor blocks, anyone), and the
# outer status re-check: a pending or dead row is never deleted. ARRAY(subquery) runs once
# (an InitPlan): with "id IN (subquery)" the planner may pick a nested-loop semi join that
# re-runs the LIMIT subquery per outer row, each run skipping the rows already deleted, so
# one statement deleted more than the limit (seen: 2 rows with limit 1 on a small table).
CLEANUP_PUBLISHED: LiteralString = """
DELETE FROM {outbox} WHERE id = ANY(ARRAY(
  SELECT c.id FROM {outbox} AS c
  WHERE c.status = 1 AND c.published_at < now() - make_interval(secs => %(retention_s)s)
  LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED
)) AND status = 1
"""

CLEANUP_MEMBERS: LiteralString = """
DELETE FROM {member} WHERE expires_at < now() - interval '1 hour'
"""

STATS: LiteralString = """
SELECT
  (SELECT count(*) FROM {outbox} WHERE status = 0),
  (SELECT count(*) FROM {outbox} WHERE status = 2),
  (SELECT extract(epoch FROM now() - min(p.created_at))::float8
     FROM generate_series(0, %(shard_count)s - 1) AS s(shard)
     CROSS JOIN LATERAL (
       SELECT o.created_at FROM {outbox} AS o
       WHERE o.shard = s.shard AND o.status = 0 ORDER BY o.id LIMIT 1) AS p)
"""

# The shards this relay holds: the same per-shard LATERAL over the pending index as STATS.
OWNED_STATS: LiteralString = """
SELECT
  (SELECT count(*) FROM {outbox} WHERE status = 0 AND shard = ANY(%(shards)s::int2[])),
  (SELECT extract(epoch FROM now() - min(p.created_at))::float8
     FROM unnest(%(shards)s::int2[]) AS s(shard)
     CROSS JOIN LATERAL (
       SELECT o.created_at FROM {outbox} AS o
       WHERE o.shard = s.shard AND o.status = 0 ORDER BY o.id LIMIT 1) AS p)
"""

#: Columns the relay reads or writes, per table (relay check: "schema behind").
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "outbox": (
        "id", "event_id", "idempotency_key", "topic", "partition_key", "shard", "event_type",
        "source", "aggregate_type", "aggregate_id", "aggregate_version", "payload", "headers",
        "occurred_at", "created_at", "status", "attempts", "published_at", "last_error",
    ),
    "lease": ("shard", "owner", "fence", "expires_at"),
    "member": ("relay_id", "started_at", "expires_at"),
}  # fmt: skip
#: Privileges the relay needs, per table (each checked on its own: has_table_privilege with
#: a list is true when ANY of them is held).
REQUIRED_PRIVILEGES: dict[str, tuple[str, ...]] = {
    "outbox": ("SELECT", "UPDATE", "DELETE"),
    "lease": ("SELECT", "INSERT", "UPDATE"),
    "member": ("SELECT", "INSERT", "UPDATE", "DELETE"),
}

# One row per (table, column-or-privilege) the relay needs; regclass resolves the (search
# path or schema-qualified) names, so nothing here depends on current_schema().
SCHEMA_TABLES: LiteralString = """
SELECT t.role, to_regclass(t.qualified) IS NOT NULL
FROM unnest(%(roles)s::text[], %(qualified)s::text[]) AS t(role, qualified)
"""
SCHEMA_COLUMNS: LiteralString = """
SELECT t.role, a.attname
FROM unnest(%(roles)s::text[], %(qualified)s::text[]) AS t(role, qualified)
JOIN pg_attribute AS a ON a.attrelid = to_regclass(t.qualified)
WHERE a.attnum > 0 AND NOT a.attisdropped
"""
SCHEMA_PRIVILEGES: LiteralString = """
SELECT t.role, t.privilege, has_table_privilege(to_regclass(t.qualified), t.privilege)
FROM unnest(%(roles)s::text[], %(qualified)s::text[], %(privileges)s::text[])
  AS t(role, qualified, privilege)
WHERE to_regclass(t.qualified) IS NOT NULL
"""
SCHEMA_SESSION: LiteralString = """
SELECT current_setting('transaction_read_only') = 'on',
  coalesce(has_table_privilege(to_regclass(%(version_table)s), 'SELECT'), false)
"""
SCHEMA_VERSION_NUM: LiteralString = "SELECT version_num FROM {version_table}"
PENDING_TOPICS: LiteralString = """
SELECT DISTINCT p.topic FROM (SELECT topic FROM {outbox} WHERE status = 0 LIMIT 10000) AS p
LIMIT 100
"""

SHARD_OWNERS: LiteralString = """
SELECT shard, owner, fence, owner IS NOT NULL AND expires_at > now() FROM {lease}
ORDER BY shard
"""


class PgRelayStore:
    """:class:`~ledgerbox.relay._store.RelayStore` on PostgreSQL: the relay's SQL on one
    psycopg connection, opened on first use, reopened after a connection error.

    Parameters
    ----------
    config : RelayConfig
    role : str
        Name used in ``application_name`` (``ledgerbox-relay-<role>``).
    """

    def __init__(self, config: RelayConfig, role: str = "main") -> None:
        self.config = config
        self.role = role
        self.me = config.member_id
        schema = config.schema

        def ident(name: str) -> sql.Identifier:
            return sql.Identifier(schema, name) if schema else sql.Identifier(name)

        self._names = {
            "outbox": ident(config.outbox_table),
            "lease": ident(f"{config.outbox_table}_relay_lease"),
            "member": ident(f"{config.outbox_table}_relay_member"),
            "version_table": ident(SCHEMA_VERSION_TABLE),
        }
        prefix = f"{schema}." if schema else ""
        self._qualified = {
            "outbox": f"{prefix}{config.outbox_table}",
            "lease": f"{prefix}{config.outbox_table}_relay_lease",
            "member": f"{prefix}{config.outbox_table}_relay_member",
            "version_table": f"{prefix}{SCHEMA_VERSION_TABLE}",
        }
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._channel = f"{config.outbox_table}_{schema or 'default'}_ledgerbox"

    def _q(self, template: LiteralString) -> sql.Composed:
        return sql.SQL(template).format(**self._names)

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            try:
                self._conn = await psycopg.AsyncConnection.connect(
                    self.config.libpq_url,
                    autocommit=True,
                    connect_timeout=5,
                    application_name=f"ledgerbox-relay-{self.role}",
                    # random_page_cost 1.1 (SSD / cached data): index scans of the partial
                    # indexes are costed as what they are, not as random disk reads.
                    options=("-c TimeZone=UTC -c statement_timeout=60000 -c random_page_cost=1.1"),
                    keepalives=1,
                    keepalives_idle=10,
                    keepalives_interval=5,
                    keepalives_count=3,
                )
            except psycopg.Error as exc:
                raise _translate(exc, "connect") from exc
        return self._conn

    async def aclose(self) -> None:
        """Close the connection (idempotent)."""
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            try:
                await conn.close()
            except psycopg.Error as exc:  # closing a broken connection
                log.debug("close failed: %r", exc)

    async def _fetch(
        self, template: LiteralString, params: dict[str, Any], what: str
    ) -> list[tuple[Any, ...]]:
        conn = await self._connection()
        try:
            cur = await conn.execute(self._q(template), params)
            return await cur.fetchall() if cur.description is not None else []
        except psycopg.Error as exc:
            await self._after_error()
            raise _translate(exc, what) from exc

    async def _run(self, template: LiteralString, params: dict[str, Any], what: str) -> int:
        conn = await self._connection()
        try:
            cur = await conn.execute(self._q(template), params)
            return cur.rowcount
        except psycopg.Error as exc:
            await self._after_error()
            raise _translate(exc, what) from exc

    async def _after_error(self) -> None:
        # A broken connection is dropped so that the next call reconnects.
        if self._conn is not None and (self._conn.closed or self._conn.broken):
            await self.aclose()

    # -- leases and membership ---------------------------------------------------------------

    async def ensure_leases(self, shard_count: int) -> None:
        """Create the lease rows ``-1 .. shard_count-1`` that do not exist yet."""
        await self._run(ENSURE_LEASES, {"shard_count": shard_count}, "ensure_leases")

    async def heartbeat(self, ttl_s: float) -> int:
        """Refresh this relay's member row; returns the number of live members (self incl.)."""
        rows = await self._fetch(HEARTBEAT, {"me": self.me, "ttl_s": ttl_s}, "heartbeat")
        return int(rows[0][0])

    async def renew_shards(
        self, held: Sequence[tuple[int, int]], ttl_s: float
    ) -> list[tuple[int, int]]:
        """Extend the leases still held under the given fences; returns ``(shard, fence)``
        of those renewed. Shards missing from the result are lost."""
        if not held:
            return []
        params = {
            "me": self.me,
            "ttl_s": ttl_s,
            "shards": [s for s, _ in held],
            "fences": [f for _, f in held],
        }
        rows = await self._fetch(RENEW_SHARDS, params, "renew_shards")
        return [(int(s), int(f)) for s, f in rows]

    async def acquire_shards(
        self, want: int, ttl_s: float, *, lo: int, hi: int
    ) -> list[tuple[int, int]]:
        """Take up to ``want`` free or expired leases with ``lo <= shard <= hi`` (fence + 1)."""
        if want <= 0:
            return []
        params = {"me": self.me, "ttl_s": ttl_s, "want": want, "lo": lo, "hi": hi}
        rows = await self._fetch(ACQUIRE_SHARDS, params, "acquire_shards")
        return [(int(s), int(f)) for s, f in rows]

    async def release_shards(self, held: Sequence[tuple[int, int]]) -> int:
        """Give up leases held under the given fences; returns how many were released."""
        if not held:
            return 0
        params = {"me": self.me, "shards": [s for s, _ in held], "fences": [f for _, f in held]}
        return await self._run(RELEASE_SHARDS, params, "release_shards")

    async def leave(self) -> None:
        """Delete this relay's member row."""
        await self._run(LEAVE, {"me": self.me}, "leave")

    # -- the hot path ----------------------------------------------------------------------

    async def claim_batch(
        self,
        shards: Sequence[int],
        limit: int,
        *,
        hold: bool,
        exclude: Sequence[int] = (),
    ) -> list[ClaimedEvent]:
        """Read up to ``limit`` pending rows of ``shards``, sorted by (shard, id).

        With ``hold``, a row is skipped while an earlier row of its partition key is dead.
        ``exclude``: ids already sent whose mark is still running (pipelining). Nothing is
        locked: a shard has one owner at a time (lease).
        """
        if not shards:
            return []
        template = CLAIM_BATCH_HOLD if hold else CLAIM_BATCH_SKIP
        params = {"shards": list(shards), "limit": limit, "exclude": list(exclude)}
        rows = await self._fetch(template, params, "claim")
        rows.sort(key=_shard_and_id)
        return [ClaimedEvent(*row) for row in rows]

    async def mark_published(self, ids: Sequence[int], fences: Sequence[tuple[int, int]]) -> int:
        """Mark rows published (``status = 1, published_at = now()``) in ONE statement, only
        where this relay still holds the row's shard under the given fence; returns the count."""
        if not ids:
            return 0
        params = {
            "me": self.me,
            "ids": sorted(ids),
            "shards": [s for s, _ in fences],
            "fences": [f for _, f in fences],
        }
        return await self._run(MARK_PUBLISHED, params, "mark_published")

    async def mark_dead_lettered(self, event_id: int, shard_fence: int, error: str) -> int:
        """Dead-letter one row (``status = 2``) with a readable reason (fenced)."""
        params = {"me": self.me, "id": event_id, "fence": shard_fence, "error": error[:2000]}
        return await self._run(MARK_DEAD_LETTERED, params, "mark_dead_lettered")

    # -- maintenance -------------------------------------------------------------------------

    async def cleanup_published(self, retention_s: float, limit: int) -> int:
        """Delete up to ``limit`` published rows older than ``retention_s``; returns the count."""
        params = {"retention_s": retention_s, "limit": limit}
        return await self._run(CLEANUP_PUBLISHED, params, "cleanup_published")

    async def cleanup_members(self) -> int:
        """Delete member rows expired for more than an hour."""
        return await self._run(CLEANUP_MEMBERS, {}, "cleanup_members")

    async def stats(self, shard_count: int) -> RelayStats:
        """Pending and dead counts, age of the oldest pending row, lease owners."""
        counts = await self._fetch(STATS, {"shard_count": shard_count}, "stats")
        owners = await self._fetch(SHARD_OWNERS, {}, "shard_owners")
        pending, dead, age = counts[0]
        return RelayStats(
            pending=int(pending),
            dead_lettered=int(dead),
            oldest_pending_age_s=None if age is None else float(age),
            owners=[(int(s), o, int(f), bool(live)) for s, o, f, live in owners],
        )

    async def owned_stats(self, shards: Sequence[int]) -> tuple[int, float | None]:
        """Rows not yet published in ``shards`` and the age of the oldest, in seconds."""
        if not shards:
            return 0, None
        rows = await self._fetch(OWNED_STATS, {"shards": list(shards)}, "owned_stats")
        pending, age = rows[0]
        return int(pending), None if age is None else float(age)

    async def schema_report(self) -> SchemaReport:
        """Tables, columns, revision, privileges and read-only state (catalog reads only)."""
        roles = list(REQUIRED_COLUMNS)
        qualified = [self._qualified[r] for r in roles]
        names = {r: q.rsplit(".", 1)[-1] for r, q in zip(roles, qualified, strict=True)}
        args = {"roles": roles, "qualified": qualified}
        present = dict(await self._fetch(SCHEMA_TABLES, args, "schema check"))
        columns: dict[str, set[str]] = {r: set() for r in roles}
        for role, column in await self._fetch(SCHEMA_COLUMNS, args, "schema check"):
            columns[role].add(column)
        wanted = [(r, p) for r in roles for p in REQUIRED_PRIVILEGES[r]]
        privileges = await self._fetch(
            SCHEMA_PRIVILEGES,
            {
                "roles": [r for r, _ in wanted],
                "qualified": [self._qualified[r] for r, _ in wanted],
                "privileges": [p for _, p in wanted],
            },
            "schema check",
        )
        ((read_only, versioned),) = await self._fetch(
            SCHEMA_SESSION, {"version_table": self._qualified["version_table"]}, "schema check"
        )
        revision = None
        if versioned:
            found = await self._fetch(SCHEMA_VERSION_NUM, {}, "schema check")
            revision = str(found[0][0]) if found else ""
        topics: list[str] = []
        if present.get("outbox") and not {"status", "topic"} - columns["outbox"]:
            topics = [str(t) for (t,) in await self._fetch(PENDING_TOPICS, {}, "schema check")]
        return SchemaReport(
            missing_tables=[names[r] for r in roles if not present.get(r)],
            missing_columns=[
                f"{names[r]}.{c}"
                for r in roles
                if present.get(r)
                for c in REQUIRED_COLUMNS[r]
                if c not in columns[r]
            ],
            revision=revision,
            missing_privileges=[f"{p} on {names[r]}" for r, p, ok in privileges if not ok],
            read_only=bool(read_only),
            pending_topics=sorted(topics),
        )

    async def ping(self) -> None:
        """Round trip to the database; raises :class:`StoreError` if it fails."""
        conn = await self._connection()
        try:
            await conn.execute("SELECT 1")
        except psycopg.Error as exc:
            await self._after_error()
            raise _translate(exc, "ping") from exc

    # -- wake-up -------------------------------------------------------------------------------

    async def notifications(self) -> AsyncIterator[None]:
        """LISTEN on the outbox channel; yields once as soon as LISTEN is active (a commit
        just before it sent no notification the caller could see), then once per
        notification. A hint only.

        Raises :class:`StoreError` when the connection drops; the caller reconnects.
        """
        conn = await self._connection()
        try:
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
            yield None
            async for _ in conn.notifies():
                yield None
        except psycopg.Error as exc:
            await self._after_error()
            raise _translate(exc, "listen") from exc


def pg_store_factory(config: RelayConfig) -> StoreFactory:
    """The default :data:`~ledgerbox.relay._store.StoreFactory`: a :class:`PgRelayStore` of
    ``config`` per role (each its own connection, ``application_name`` naming the role)."""

    def build(role: str) -> RelayStore:
        return PgRelayStore(config, role)

    return build


def _shard_and_id(row: tuple[Any, ...]) -> tuple[int, int]:
    return row[1], row[0]


def _translate(exc: psycopg.Error, what: str) -> StoreError:
    # The one classification table (ledgerbox._core.faults): a psycopg error always has a fault.
    error = StoreError.translate(exc, what)
    assert error is not None
    return error
