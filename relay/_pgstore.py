"""The relay's storage seam on PostgreSQL: the ONLY module of ``relay`` that runs SQL.

:class:`PgRelayStore` implements the :class:`~ledgerbox.relay._store.RelayStore` Protocol.
One method per query; the SQL text is kept in named constants. psycopg 3 ``AsyncConnection``
in autocommit mode (every statement is its own transaction unless a method says otherwise;
nothing is held open between calls). Driver errors are translated into
:class:`ledgerbox.relay.StoreError` here only, classified by the one table of
:mod:`ledgerbox._core.faults`.

The read design (docs/relay.md, "Read design"): producers stamp every row with their
transaction id (``txid xid8 DEFAULT pg_current_xact_id()``, the top-level id, so savepoints
change nothing); each shard's cursor ``(lo, hi, after_id)`` lives in its lease row. A claim
reads the rows committed after ``lo`` and up to ``hi`` (its own snapshot when the range is
closed) through the index ``(shard, txid, id)``: ``txid`` from ``xmax(lo)`` to ``xmax(hi)``,
plus the transactions ``lo`` saw in progress (``xip(lo)``), keeping those visible in ``hi``.
Neither history nor a long-open transaction widens that scan (PgQ's batch query,
``pgq.batch_event_sql``). Snapshots only ever use ``xid8``/``pg_snapshot`` (64-bit, no
wraparound).

Every time comparison uses the database's ``now()``: clocks of relay machines are never
compared with each other.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import datetime
import logging
import sys
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, LiteralString

import psycopg
from psycopg import pq, sql
from psycopg.conninfo import conninfo_to_dict

from ledgerbox._core.database_url import connect_args
from ledgerbox._core.identifiers import wake_gate_key
from ledgerbox._core.names import SCHEMA_VERSION_TABLE
from ledgerbox.relay._config import RelayConfig
from ledgerbox.relay._errors import StoreError
from ledgerbox.relay._gate import GATE_PAYLOAD, TAKE_PAYLOAD
from ledgerbox.relay._store import (
    Claim,
    ClaimedEvent,
    Cursor,
    CursorWrite,
    DeadLetter,
    DeadQuery,
    DeadRow,
    HeldKeyRow,
    OpenedShard,
    PersistOutcome,
    RebasedShard,
    RelayStats,
    RelayStore,
    SchemaReport,
    ShardRead,
    StoreFactory,
)

__all__ = ["PENDING_COUNT", "PgRelayStore", "claim_params", "pg_store_factory"]

log = logging.getLogger("ledgerbox.relay.store")

# What a Kafka record needs, pre-formatted by PostgreSQL as text where Python would otherwise
# build objects and stringify them again (measured: record building 17 -> ~3 ms per 1000
# rows). The payload comes as UTF-8 bytes (read in binary: no hex), the record's value as is:
# no second copy of it per row in flight (peak RSS). ``occurred_at_ms`` is computed as
# ``outbox.timestamp_ms`` does, with integers only
# (whole seconds * 1000 + the milliseconds of the second, rounded toward the past; a float8
# multiply was 1 ms early for exact-millisecond times outside roughly 2004-2038), and
# ``ce_time`` as ``datetime.isoformat`` prints a UTC time (no fraction when the microseconds
# are 0), so the records are byte-identical to ``kafka_headers``.
_COLUMNS: LiteralString = (
    "o.id, o.shard, o.topic, o.partition_key, convert_to(o.payload::text, 'UTF8'),"
    " o.headers::text, "
    "o.event_id::text, o.idempotency_key, o.event_type, o.source, o.aggregate_type, "
    "o.aggregate_id, o.aggregate_version::text, "
    "extract(epoch FROM date_trunc('second', o.occurred_at))::int8 * 1000"
    " + (extract(microseconds FROM o.occurred_at)::int8 %% 1000000) / 1000, "
    "to_char(o.occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS')"
    " || CASE WHEN date_trunc('second', o.occurred_at) = o.occurred_at THEN ''"
    " ELSE to_char(o.occurred_at AT TIME ZONE 'UTC', '.US') END || '+00:00'"
)

# {outbox}, {lease}, {member}, {tick} are validated identifiers, composed by psycopg.sql.
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
# The pick is a MATERIALIZED CTE, run once. As "shard IN (SELECT ... LIMIT n FOR UPDATE
# SKIP LOCKED)" a nested-loop semi join re-ran it for every lease row, each run skipping the
# rows the statement had already updated: it took every free lease, not n (seen in make test
# under load; tests/integration/test_relay_store_contract.py forces that plan).
ACQUIRE_SHARDS: LiteralString = """
WITH picked AS MATERIALIZED (
  SELECT f.shard FROM {lease} AS f
  WHERE f.shard BETWEEN %(lo)s AND %(hi)s AND (f.owner IS NULL OR f.expires_at < now())
  ORDER BY f.shard LIMIT %(want)s
  FOR UPDATE SKIP LOCKED
)
UPDATE {lease} AS l
SET owner = %(me)s, fence = l.fence + 1, expires_at = now() + make_interval(secs => %(ttl_s)s)
FROM picked
WHERE l.shard = picked.shard AND (l.owner IS NULL OR l.expires_at < now())
RETURNING l.shard, l.fence
"""

RELEASE_SHARDS: LiteralString = """
UPDATE {lease} AS l SET owner = NULL, expires_at = NULL
FROM unnest(%(shards)s::int2[], %(fences)s::int8[]) AS h(shard, fence)
WHERE l.shard = h.shard AND l.fence = h.fence AND l.owner = %(me)s
"""

LEAVE: LiteralString = "DELETE FROM {member} WHERE relay_id = %(me)s"


# -- cursors -------------------------------------------------------------------------------

# Rows of a range: committed after the snapshot `lo` (NULL: nothing published yet) and
# visible in `hi`. Through the index (shard, txid, id): txid in [xmax(lo), xmax(hi)), plus
# the transactions in progress at lo (xip(lo)); never from xmin(lo), which would rescan
# every row committed while a long transaction stays open. Two branches of a UNION ALL so
# that each is a plain index range (with an OR the planner may scan the whole shard and
# filter: seen on a small table, a cost that grows with history); the transactions of
# xip(lo) are looked up one by one (an equality on (shard, txid): "txid = ANY(...)" on the
# index's second column was only used as a filter, and a flattened join was hashed over the
# whole shard). OFFSET 0 keeps these subqueries as they are written, so the plan does not
# depend on statistics. Aborted and still running rows are invisible anyway.
_RANGE_ROWS: LiteralString = """(
       SELECT {select} FROM {outbox} AS o
       WHERE o.shard = {shard} AND o.id > {after} AND o.status = 0
         AND o.txid >= coalesce(pg_snapshot_xmax({lo}), '0'::xid8)
         AND o.txid < pg_snapshot_xmax({hi}) AND pg_visible_in_snapshot(o.txid, {hi})
       UNION ALL
       SELECT {select} FROM unnest({xip}) AS x(txid)
       CROSS JOIN LATERAL (
         SELECT o.* FROM {outbox} AS o
         WHERE o.shard = {shard} AND o.txid = x.txid AND o.id > {after} AND o.status = 0
           AND pg_visible_in_snapshot(o.txid, {hi}) OFFSET 0) AS o)"""

# The same test as a filter, for rows fetched by id.
_RANGE: LiteralString = """
      AND ((o.txid >= coalesce(pg_snapshot_xmax({lo}), '0'::xid8)
            AND o.txid < pg_snapshot_xmax({hi}))
           OR o.txid = ANY(ARRAY(SELECT pg_snapshot_xip({lo}))))
      AND pg_visible_in_snapshot(o.txid, {hi})"""


def _range(lo: LiteralString, hi: LiteralString) -> LiteralString:
    return _RANGE.replace("{lo}", lo).replace("{hi}", hi)


def _range_rows(
    select: LiteralString,
    shard: LiteralString,
    after: LiteralString,
    lo: LiteralString,
    hi: LiteralString,
    xip: LiteralString,
) -> LiteralString:
    names = {
        "{select}": select,
        "{shard}": shard,
        "{after}": after,
        "{lo}": lo,
        "{hi}": hi,
        "{xip}": xip,
    }
    text = _RANGE_ROWS
    for name, value in names.items():
        text = text.replace(name, value)
    return text


# A cursor is ahead of the database when one of its snapshots is beyond the transaction
# counter: nothing can be read of it, and rows written now get ids it counts as published.
OPEN_SHARDS: LiteralString = """
SELECT l.shard, l.fence, l.lo::text, l.hi::text, l.after_id, l.refused,
  coalesce(pg_snapshot_xmax(coalesce(l.hi, l.lo)) > pg_snapshot_xmax(pg_current_snapshot()),
           false),
  coalesce(l.hi, l.lo) IS NOT NULL AND l.sysid IS DISTINCT FROM %(sysid)s
FROM {lease} AS l
JOIN unnest(%(shards)s::int2[], %(fences)s::int8[]) AS h(shard, fence)
  ON h.shard = l.shard AND h.fence = l.fence
WHERE l.owner = %(me)s
"""

# The cursor was written on another cluster (system identifier): a pg_upgrade (the counter
# is kept) or a restore or logical copy (it is not). Sound only if the counter is not behind
# what the last persist saw nor behind any row of the shard, and no row was written after
# the last persist with a transaction id the cursor already counts as published (impossible
# on a live database: a transaction that began after the persist got its id after it). The
# last test reads the shard's history once; it runs only when the system identifier changed.
VALIDATE_SHARD: LiteralString = """
SELECT
  l.seen_xmax IS NULL OR pg_snapshot_xmax(n.cur) >= l.seen_xmax,
  coalesce((SELECT max(o.txid) FROM {outbox} AS o WHERE o.shard = l.shard), '0'::xid8)
    < pg_snapshot_xmax(n.cur),
  NOT EXISTS (
    SELECT 1 FROM {outbox} AS o
    WHERE o.shard = l.shard AND o.txid < pg_snapshot_xmax(coalesce(l.hi, l.lo))
      AND o.created_at > l.persisted_at)
FROM {lease} AS l, (SELECT pg_current_snapshot() AS cur) AS n
WHERE l.shard = %(shard)s
"""

ACCEPT_SHARD: LiteralString = """
UPDATE {lease} SET sysid = %(sysid)s
WHERE shard = %(shard)s AND fence = %(fence)s AND owner = %(me)s AND refused IS NULL
"""

# Sticky: a relay that starts later reads the refusal instead of resuming silently; only
# `relay rebase` clears it.
REFUSE_SHARD: LiteralString = """
UPDATE {lease} SET refused = %(reason)s, refused_at = now()
WHERE shard = %(shard)s AND fence = %(fence)s AND owner = %(me)s AND refused IS NULL
"""

REFUSED_SHARDS: LiteralString = """
SELECT l.shard, coalesce(l.refused, 'cursor ahead of the database')
FROM {lease} AS l, (SELECT pg_current_snapshot() AS cur) AS n
WHERE l.shard >= 0 AND (l.refused IS NOT NULL
  OR pg_snapshot_xmax(coalesce(l.hi, l.lo)) > pg_snapshot_xmax(n.cur)
  OR l.seen_xmax > pg_snapshot_xmax(n.cur))
ORDER BY l.shard
"""

# Id-list paging of a large open range: the range is sorted once (ids only), then read page
# by page by id (CLAIM_BATCH's first part) instead of sorting it again for every page
# (measured: a 20,000-row range costs ~20 ms per top-1000 sort). The ids come as one bytea of
# big-endian int8s per shard: no Python int per id, even transiently (peak RSS).
_RANGE_IDS_HEAD: LiteralString = """
SELECT c.shard, (
  SELECT coalesce(string_agg(int8send(p.id), ''::bytea ORDER BY p.id), ''::bytea)
  FROM (SELECT r.id FROM """
_RANGE_IDS_ROWS: LiteralString = _range_rows(
    "o.id", "c.shard", "c.after_id", "c.lo", "c.hi", "x.xip"
)
_RANGE_IDS_TAIL: LiteralString = """ AS r
  ORDER BY r.id LIMIT %(cap)s) AS p)
FROM unnest(%(shards)s::int2[], %(lo)s::pg_snapshot[], %(hi)s::pg_snapshot[],
            %(after)s::int8[]) AS c(shard, lo, hi, after_id)
CROSS JOIN LATERAL (SELECT ARRAY(SELECT pg_snapshot_xip(c.lo)) AS xip OFFSET 0) AS x
"""
RANGE_IDS: LiteralString = _RANGE_IDS_HEAD + _RANGE_IDS_ROWS + _RANGE_IDS_TAIL

# -- the hot path ----------------------------------------------------------------------------

# One statement, nothing locked or written: the claim's snapshot first (n), then the pages
# of listed ids (exact, by primary key, each re-checked against its range), then per shard
# with a closed range the first rows of [lo, snapshot) in id order (LATERAL top-N through
# the (shard, txid, id) index; the outer LIMIT stops once the batch is full). Shards whose
# cursor is ahead of the database are reported, not read. The snapshot and the ahead list
# come in one row only (NULL in the others: no 1,000 copies of them per claim in the relay's
# memory). The caller sorts by (shard, id).
_CLAIM_HEAD: LiteralString = """
WITH n AS MATERIALIZED (
  SELECT s.cur, ARRAY(
    SELECT a.shard FROM unnest(%(all_shards)s::int2[], %(all_top)s::pg_snapshot[]) AS a(shard, top)
    WHERE pg_snapshot_xmax(a.top) > pg_snapshot_xmax(s.cur)) AS ahead
  FROM (SELECT pg_current_snapshot() AS cur) AS s
)
SELECT CASE WHEN coalesce(x.rn, 1) = 1 THEN n.cur::text END,
       CASE WHEN coalesce(x.rn, 1) = 1 THEN n.ahead END, x.*
FROM n LEFT JOIN LATERAL (
  SELECT y.*, row_number() OVER () AS rn FROM (
  SELECT """
_CLAIM_PAGES: LiteralString = """
  FROM (
    SELECT o.* FROM {outbox} AS o
    JOIN unnest(%(pshards)s::int2[], %(plo)s::pg_snapshot[], %(phi)s::pg_snapshot[])
      AS p(shard, lo, hi) ON p.shard = o.shard
    WHERE o.id = ANY(%(pids)s::int8[]) AND o.status = 0 AND p.shard <> ALL(n.ahead)"""
_RANGE_P: LiteralString = _range("p.lo", "p.hi")
_CLAIM_RANGES: LiteralString = """
    UNION ALL
    (SELECT o.* FROM unnest(%(shards)s::int2[], %(lo)s::pg_snapshot[], %(hi)s::pg_snapshot[],
                            %(after)s::int8[]) AS c(shard, lo, hi, after_id)
     CROSS JOIN LATERAL (
       SELECT coalesce(c.hi, n.cur) AS hi, ARRAY(SELECT pg_snapshot_xip(c.lo)) AS xip
       OFFSET 0) AS h
     CROSS JOIN LATERAL (
       SELECT r.* FROM """
_RANGE_H: LiteralString = _range_rows("o.*", "c.shard", "c.after_id", "c.lo", "h.hi", "h.xip")
_CLAIM_TAIL: LiteralString = """ AS r
       ORDER BY r.id LIMIT %(limit)s
     ) AS o
     WHERE c.shard <> ALL(n.ahead)
     LIMIT %(limit)s)
  ) AS o
  ) AS y
) AS x ON true
"""
_CLAIM_BODY: LiteralString = _CLAIM_PAGES + _RANGE_P + _CLAIM_RANGES + _RANGE_H + _CLAIM_TAIL
# on_dead_letter="hold": the row waits while an earlier row of its key is dead-lettered
# (tiny partial index (partition_key, id) WHERE status IN (2, 3)).
_HELD: LiteralString = """,
    EXISTS (SELECT 1 FROM {outbox} AS d
            WHERE d.status = 2 AND d.partition_key = o.partition_key AND d.id < o.id)"""
CLAIM_BATCH_HOLD: LiteralString = _CLAIM_HEAD + _COLUMNS + _HELD + _CLAIM_BODY
_NOT_HELD: LiteralString = ", false"
CLAIM_BATCH_SKIP: LiteralString = _CLAIM_HEAD + _COLUMNS + _NOT_HELD + _CLAIM_BODY

# Fenced in SQL (owner + fence), on the cluster the cursors were read from (system
# identifier), never ahead of the counter. One UPDATE of a few lease rows per batch (HOT:
# no indexed column changes, fillfactor 50) replaces v1's UPDATE of every published row
# (measured 19.5 ms and 533 KiB of WAL per 1,000 events).
PERSIST_CURSORS: LiteralString = """
UPDATE {lease} AS l
SET lo = h.lo, hi = h.hi, after_id = h.after_id, persisted_at = now(),
    seen_xmax = pg_snapshot_xmax(pg_current_snapshot()), sysid = %(sysid)s
FROM unnest(%(shards)s::int2[], %(fences)s::int8[], %(lo)s::pg_snapshot[],
            %(hi)s::pg_snapshot[], %(after)s::int8[]) AS h(shard, fence, lo, hi, after_id)
WHERE l.shard = h.shard AND l.fence = h.fence AND l.owner = %(me)s AND l.refused IS NULL
  AND (l.sysid = %(sysid)s OR (l.sysid IS NULL AND l.lo IS NULL AND l.hi IS NULL))
  AND pg_snapshot_xmax(coalesce(h.hi, h.lo)) <= pg_snapshot_xmax(pg_current_snapshot())
RETURNING l.shard
"""

PERSIST_DIAGNOSIS: LiteralString = """
SELECT h.shard, coalesce(l.owner = %(me)s AND l.fence = h.fence, false)
FROM unnest(%(shards)s::int2[], %(fences)s::int8[]) AS h(shard, fence)
LEFT JOIN {lease} AS l ON l.shard = h.shard
"""

PERSIST_DEAD: LiteralString = """
UPDATE {outbox} AS o SET status = 2, last_error = d.error, attempts = o.attempts + 1
FROM unnest(%(ids)s::int8[], %(errors)s::text[]) AS d(id, error)
WHERE o.id = d.id AND o.status = 0 AND o.shard = ANY(%(ok)s::int2[])
"""

# After PERSIST_CURSORS locked the lease rows and PERSIST_DEAD wrote this batch's dead rows,
# in a new snapshot of the same transaction: a row is held only while an earlier row of its
# key is still dead-lettered; if an operator replayed or discarded it meanwhile, the row is
# stamped with this transaction's id and read again, after the replayed ones.
PERSIST_HELD: LiteralString = """
UPDATE {outbox} AS o
SET status = CASE WHEN b.blocked THEN 3 ELSE 0 END,
    txid = CASE WHEN b.blocked THEN o.txid ELSE pg_current_xact_id() END
FROM (
  SELECT x.id, EXISTS (SELECT 1 FROM {outbox} AS d
    WHERE d.status = 2 AND d.partition_key = x.partition_key AND d.id < x.id) AS blocked
  FROM {outbox} AS x
  WHERE x.id = ANY(%(ids)s::int8[]) AND x.status = 0 AND x.shard = ANY(%(ok)s::int2[])
) AS b
WHERE o.id = b.id
"""

# -- maintenance -------------------------------------------------------------------------------

# A tick (t, h) says: every row with txid < h was written before t (h = the oldest
# transaction running at t). Cleanup finds rows older than the retention through the
# (shard, txid) index below the horizon of the newest tick older than the retention, so its
# cost does not grow with the rows kept. Ticks older than that one are forgotten.
RECORD_TICK: LiteralString = """
WITH ins AS (
  INSERT INTO {tick} (taken_at, horizon)
  SELECT now(), pg_snapshot_xmin(pg_current_snapshot())
  WHERE NOT EXISTS (
    SELECT 1 FROM {tick} WHERE taken_at > now() - make_interval(secs => %(gap_s)s))
  ON CONFLICT (taken_at) DO NOTHING
  RETURNING 1
), del AS (
  DELETE FROM {tick} WHERE taken_at < (
    SELECT max(taken_at) FROM {tick}
    WHERE taken_at <= now() - make_interval(secs => %(retention_s)s))
  RETURNING 1
)
SELECT (SELECT count(*) FROM ins), (SELECT count(*) FROM del)
"""

# Bounded batches, row locks only (SKIP LOCKED: never waits on, nor blocks, anyone), and the
# outer status re-check. A row goes only when its shard's persisted cursor passed it
# (txid < xmin(lo)), it was committed before a tick older than the retention, it is older
# than the retention by created_at and it is published (0), published under schema v1 (1)
# or discarded (4): never a pending, held (3) or dead-lettered (2) row, never a row of a
# shard without a cursor, and never by a cursor this cluster has not vouched for: refused,
# written on another cluster (system identifier) and not validated here, or ahead of the
# counter (a restore into a cluster behind: every row written since has a txid below that
# cursor and is unpublished; found by an adversarial review, 2026-12-05, which saw cleanup
# delete them before `relay rebase` could send them). ARRAY(subquery) runs once (an
# InitPlan): with "id IN (subquery)" a nested-loop semi join could re-run the LIMIT subquery
# per outer row, deleting more than the limit (seen: 2 rows with limit 1).
CLEANUP_PUBLISHED: LiteralString = """
DELETE FROM {outbox} WHERE id = ANY(ARRAY(
  SELECT c.id
  FROM (SELECT coalesce((
          SELECT t.horizon FROM {tick} AS t
          WHERE t.taken_at <= now() - make_interval(secs => %(retention_s)s)
          ORDER BY t.taken_at DESC LIMIT 1), '0'::xid8) AS horizon) AS k
  CROSS JOIN {lease} AS l
  CROSS JOIN LATERAL (
    SELECT c.id FROM {outbox} AS c
    WHERE c.shard = l.shard AND c.txid < least(pg_snapshot_xmin(l.lo), k.horizon)
      AND c.status IN (0, 1, 4)
      AND c.created_at < now() - make_interval(secs => %(retention_s)s)
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
  ) AS c
  WHERE l.shard >= 0 AND l.lo IS NOT NULL AND l.refused IS NULL
    AND l.sysid = (SELECT system_identifier FROM pg_control_system())
    AND pg_snapshot_xmax(coalesce(l.hi, l.lo)) <= pg_snapshot_xmax(pg_current_snapshot())
  LIMIT %(limit)s
)) AND status IN (0, 1, 4)
"""

CLEANUP_MEMBERS: LiteralString = """
DELETE FROM {member} WHERE expires_at < now() - interval '1 hour'
"""

# Rows a shard's persisted cursor has not passed (status 0: not dead-lettered, held or
# discarded); a shard without a lease row or cursor has passed nothing. The same two index
# ranges as a claim: only rows committed since lo are read, whatever the history.
_ALL_SHARDS: LiteralString = """
  SELECT o.created_at FROM generate_series(0, %(shard_count)s - 1) AS s(shard)"""
_THESE_SHARDS: LiteralString = """
  SELECT o.created_at FROM unnest(%(shards)s::int2[]) AS s(shard)"""
_PENDING_OF_SHARDS: LiteralString = """
  LEFT JOIN {lease} AS l ON l.shard = s.shard
  CROSS JOIN LATERAL (SELECT ARRAY(SELECT pg_snapshot_xip(l.lo)) AS xip OFFSET 0) AS x
  CROSS JOIN LATERAL (
    SELECT o.created_at FROM {outbox} AS o
    WHERE o.shard = s.shard AND o.status = 0
      AND o.txid >= coalesce(pg_snapshot_xmax(l.lo), '0'::xid8)
      AND NOT coalesce(pg_visible_in_snapshot(o.txid, l.hi) AND o.id <= l.after_id, false)
    UNION ALL
    SELECT o.created_at FROM {outbox} AS o
    WHERE o.shard = s.shard AND o.status = 0
      AND o.txid = ANY(x.xip)
      AND NOT coalesce(pg_visible_in_snapshot(o.txid, l.hi) AND o.id <= l.after_id, false)
  ) AS o"""

_PENDING_COUNT_HEAD: LiteralString = "SELECT count(*) FROM ("
_PENDING_COUNT_TAIL: LiteralString = ") AS p"
_PENDING_ROWS: LiteralString = _ALL_SHARDS + _PENDING_OF_SHARDS
PENDING_COUNT: LiteralString = _PENDING_COUNT_HEAD + _PENDING_ROWS + _PENDING_COUNT_TAIL

_STATS_HEAD: LiteralString = "WITH p AS ("
# Stray rows: rows no cursor has passed in a shard no relay with this shard_count claims (the
# writers' OutboxTable.shard_count is larger), counted up to STRAY_COUNT_CAP (10,000). The
# shards from shard_count to the largest one in the table (max(shard): one index probe; none
# when the settings agree), each read as a claim reads it: only rows past its cursor, if a
# relay with a larger shard_count once published it (a review found a seq scan over the
# published rows of those shards with "status = 0" alone, and counted them as waiting).
_STRAY_SHARDS: LiteralString = """
  SELECT o.created_at
  FROM generate_series(%(shard_count)s::int, (SELECT max(shard) FROM {outbox})::int) AS s(shard)"""
_STATS_TAIL: LiteralString = """
)
SELECT
  (SELECT count(*) FROM p),
  (SELECT extract(epoch FROM now() - min(p.created_at))::float8 FROM p),
  (SELECT count(*) FROM {outbox} WHERE status = 2),
  (SELECT count(*) FROM {outbox} WHERE status = 3),
  (SELECT count(*) FROM ("""
_STRAY_TAIL: LiteralString = """
     LIMIT 10000) AS stray)
"""
STATS: LiteralString = (
    _STATS_HEAD + _PENDING_ROWS + _STATS_TAIL + _STRAY_SHARDS + _PENDING_OF_SHARDS + _STRAY_TAIL
)

# The same rows for the shards this relay holds (its own gauges).
_OWNED_STATS_TAIL: LiteralString = """
)
SELECT (SELECT count(*) FROM p),
  (SELECT extract(epoch FROM now() - min(p.created_at))::float8 FROM p)
"""
OWNED_STATS: LiteralString = _STATS_HEAD + _THESE_SHARDS + _PENDING_OF_SHARDS + _OWNED_STATS_TAIL

#: Columns the relay reads or writes, per table (relay check: "schema behind").
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "outbox": (
        "id", "event_id", "idempotency_key", "topic", "partition_key", "shard", "event_type",
        "source", "aggregate_type", "aggregate_id", "aggregate_version", "payload", "headers",
        "occurred_at", "created_at", "status", "last_error", "txid",
    ),
    "lease": (
        "shard", "owner", "fence", "expires_at", "lo", "hi", "after_id", "persisted_at",
        "seen_xmax", "sysid", "refused", "refused_at",
    ),
    "member": ("relay_id", "started_at", "expires_at"),
    "tick": ("taken_at", "horizon"),
}  # fmt: skip
#: Privileges the relay needs, per table (each checked on its own: has_table_privilege with
#: a list is true when ANY of them is held).
REQUIRED_PRIVILEGES: dict[str, tuple[str, ...]] = {
    "outbox": ("SELECT", "UPDATE", "DELETE"),
    "lease": ("SELECT", "INSERT", "UPDATE"),
    "member": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "tick": ("SELECT", "INSERT", "DELETE"),
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
  coalesce(has_table_privilege(to_regclass(%(version_table)s), 'SELECT'), false),
  current_user
"""
SCHEMA_VERSION_NUM: LiteralString = "SELECT version_num FROM {version_table}"
# Topics of rows not yet published (a sample: relay check tells missing topics apart).
PENDING_TOPICS: LiteralString = """
SELECT DISTINCT p.topic FROM (
  SELECT o.topic FROM {outbox} AS o
  JOIN {lease} AS l ON l.shard = o.shard
  WHERE o.status = 0 AND (l.lo IS NULL OR o.txid >= pg_snapshot_xmax(l.lo))
  LIMIT 10000) AS p
LIMIT 100
"""

SHARD_OWNERS: LiteralString = """
SELECT shard, owner, fence, owner IS NOT NULL AND expires_at > now(), refused FROM {lease}
ORDER BY shard
"""

# -- operations --------------------------------------------------------------------------------

FIND_DEAD: LiteralString = """
SELECT shard, partition_key FROM {outbox} WHERE id = %(id)s AND status = 2
"""

# Operator reads (ledgerbox relay dead list/show, relay status): dead-lettered rows through the
# partial index (partition_key, id) WHERE status IN (2, 3); each with the count of its key's
# held rows up to the key's next dead row (the rows a replay or discard of it releases).
DEAD_LETTERED: LiteralString = """
SELECT o.id, o.event_id::text, o.partition_key, o.event_type, o.topic, o.shard, o.attempts,
  o.last_error, o.created_at, o.occurred_at,
  (SELECT count(*) FROM {outbox} AS h
    WHERE h.partition_key = o.partition_key AND h.status = 3 AND h.id > o.id
      AND h.id < coalesce((SELECT min(d.id) FROM {outbox} AS d
                           WHERE d.partition_key = o.partition_key AND d.status = 2
                             AND d.id > o.id), 9223372036854775807)),
  CASE WHEN %(body)s THEN o.payload::text END,
  CASE WHEN %(body)s THEN o.headers::text END
FROM {outbox} AS o
WHERE o.status = 2
  AND (%(ids)s::int8[] IS NULL OR o.id = ANY(%(ids)s::int8[]))
  AND (%(key)s::text IS NULL OR o.partition_key = %(key)s::text)
  AND (%(event_type)s::text IS NULL OR o.event_type = %(event_type)s::text)
  AND (%(topic)s::text IS NULL OR o.topic = %(topic)s::text)
  AND (%(older)s::float8 IS NULL
       OR o.created_at < now() - make_interval(secs => %(older)s::float8))
  AND (%(error)s::text IS NULL
       OR strpos(lower(coalesce(o.last_error, '')), lower(%(error)s::text)) > 0)
ORDER BY o.id
LIMIT %(limit)s
"""
HELD_KEYS: LiteralString = """
WITH d AS (SELECT partition_key, min(id) AS dead_id, count(*) AS dead_count
           FROM {outbox} WHERE status = 2 GROUP BY partition_key),
     h AS (SELECT partition_key, count(*) AS held
           FROM {outbox} WHERE status = 3 GROUP BY partition_key)
SELECT d.partition_key, d.dead_id, o.event_id::text, d.dead_count, coalesce(h.held, 0),
  o.created_at
FROM d JOIN {outbox} AS o ON o.id = d.dead_id LEFT JOIN h ON h.partition_key = d.partition_key
ORDER BY d.dead_id
LIMIT %(limit)s
"""

# Serializes with PERSIST_HELD of the same shard (it locks the lease row first).
LOCK_LEASE: LiteralString = """
SELECT lo::text FROM {lease} WHERE shard = %(shard)s FOR UPDATE
"""

# The dead row (status 0: replayed, 4: discarded) and the held rows of its key up to its next
# dead-lettered row, through the partial index (partition_key, id) WHERE status IN (2, 3).
RELEASE_HELD: LiteralString = """
UPDATE {outbox} AS o
SET status = CASE WHEN o.id = %(id)s THEN %(status)s ELSE 0 END,
    txid = CASE WHEN o.id = %(id)s AND %(status)s = 4 THEN o.txid ELSE pg_current_xact_id() END
WHERE o.partition_key = %(key)s AND o.status IN (2, 3) AND o.id >= %(id)s
  AND (o.id = %(id)s OR o.status = 3)
  AND o.id < coalesce((SELECT min(d.id) FROM {outbox} AS d
                       WHERE d.partition_key = %(key)s AND d.status = 2 AND d.id > %(id)s),
                      9223372036854775807)
"""

# The rows of the key not yet published (a claim may have read them just now, without the
# dead row in the way): they follow the released rows, in id order.
RELEASE_PENDING: LiteralString = """
UPDATE {outbox} AS o SET txid = pg_current_xact_id()
FROM (SELECT lo, hi, after_id FROM {lease} WHERE shard = %(shard)s
      UNION ALL SELECT NULL::pg_snapshot, NULL::pg_snapshot, 0::int8 LIMIT 1) AS l
WHERE o.shard = %(shard)s AND o.partition_key = %(key)s AND o.status = 0 AND o.id > %(id)s
  AND o.txid >= coalesce(pg_snapshot_xmin(l.lo), '0'::xid8)
  AND NOT coalesce(pg_visible_in_snapshot(o.txid, l.lo)
                   OR (pg_visible_in_snapshot(o.txid, l.hi) AND o.id <= l.after_id), false)
  AND o.id < coalesce((SELECT min(d.id) FROM {outbox} AS d
                       WHERE d.partition_key = %(key)s AND d.status = 2 AND d.id > %(id)s),
                      9223372036854775807)
"""

# on_dead_letter="skip": rows a "hold" relay held are published (read again).
RELEASE_ALL_HELD: LiteralString = """
UPDATE {outbox} SET status = 0, txid = pg_current_xact_id()
WHERE status = 3 AND shard = ANY(%(shards)s::int2[])
"""

SNAPSHOT: LiteralString = "SELECT pg_current_snapshot()::text"

REBASE_LOCK: LiteralString = """
SELECT lo::text, hi::text, after_id, persisted_at FROM {lease}
WHERE shard = %(shard)s FOR UPDATE
"""

# Per row of the shard: sent again (the rebase transaction's id) if the old cursor had not
# passed it or it was created after the last persist minus the margin; else, if S0 does not
# see it (an id from another cluster's counter, which future ranges would cover), stamped
# '2' (FrozenTransactionId: visible to every snapshot).
_REBASE_AGAIN: LiteralString = """(o.status = 0 AND (
      NOT coalesce(pg_visible_in_snapshot(o.txid, %(lo)s::pg_snapshot)
                   OR (pg_visible_in_snapshot(o.txid, %(hi)s::pg_snapshot)
                       AND o.id <= %(after)s), false)
      OR o.created_at > %(since)s::timestamptz))"""
_REBASE_WHERE_HEAD: LiteralString = """
WHERE o.shard = %(shard)s AND ("""
_REBASE_WHERE_TAIL: LiteralString = """
  OR (o.txid >= pg_snapshot_xmin(%(s0)s::pg_snapshot) AND o.txid <> '2'::xid8))"""
_REBASE_WHERE: LiteralString = _REBASE_WHERE_HEAD + _REBASE_AGAIN + _REBASE_WHERE_TAIL
_REBASE_ROWS_HEAD: LiteralString = """
WITH u AS (
  UPDATE {outbox} AS o
  SET txid = CASE WHEN """
_REBASE_ROWS_MID: LiteralString = """ THEN pg_current_xact_id() ELSE '2'::xid8 END"""
_REBASE_ROWS_TAIL: LiteralString = """
  RETURNING o.txid = '2'::xid8 AS frozen
)
SELECT count(*) FILTER (WHERE NOT frozen), count(*) FILTER (WHERE frozen) FROM u
"""
REBASE_ROWS: LiteralString = (
    _REBASE_ROWS_HEAD + _REBASE_AGAIN + _REBASE_ROWS_MID + _REBASE_WHERE + _REBASE_ROWS_TAIL
)
_REBASE_COUNT_HEAD: LiteralString = """
SELECT count(*) FILTER (WHERE q.again), count(*) FILTER (WHERE NOT q.again)
FROM (SELECT coalesce("""
_REBASE_COUNT_MID: LiteralString = """, false) AS again
      FROM {outbox} AS o"""
_REBASE_COUNT_TAIL: LiteralString = """) AS q
"""
REBASE_COUNT: LiteralString = (
    _REBASE_COUNT_HEAD + _REBASE_AGAIN + _REBASE_COUNT_MID + _REBASE_WHERE + _REBASE_COUNT_TAIL
)

REBASE_LEASE: LiteralString = """
UPDATE {lease}
SET lo = %(s0)s::pg_snapshot, hi = NULL, after_id = 0, fence = fence + 1, owner = NULL,
    expires_at = NULL, refused = NULL, refused_at = NULL, sysid = %(sysid)s,
    persisted_at = now(), seen_xmax = pg_snapshot_xmax(%(s0)s::pg_snapshot)
WHERE shard = %(shard)s
"""

SYSTEM_ID: LiteralString = "SELECT system_identifier FROM pg_control_system()"

#: :meth:`PgRelayStore.connected` pings a connection idle for longer than this (s).
CONNECTED_CHECK_S = 1.0

#: The wake gate (docs/relay.md "Wake gate"): take it EXCLUSIVE without waiting; if that
#: failed, probe whether another session holds it EXCLUSIVE: a SHARE try fails only then
#: (writers hold it in SHARE mode; advisory locks belong to this database, pg_locks would
#: show every database's), and the probe's SHARE lock is let go at once.
GATE_TRY: LiteralString = """
SELECT taken,
       CASE WHEN taken THEN true
            WHEN pg_try_advisory_lock_shared(%(k1)s, %(k2)s)
                 THEN NOT pg_advisory_unlock_shared(%(k1)s, %(k2)s)
            ELSE true END,
       CASE WHEN taken THEN pg_notify(%(channel)s, %(take)s)::text END
FROM (SELECT pg_try_advisory_lock(%(k1)s, %(k2)s) AS taken) AS attempt"""
#: Release the gate (every advisory lock of this dedicated connection: a count above one
#: can never stay behind); the notification (delivered at this statement's commit, after
#: the unlock) tells covered relays that their cover is gone.
GATE_RELEASE: LiteralString = "SELECT pg_advisory_unlock_all(), pg_notify(%(channel)s, %(payload)s)"
GATE_PING: LiteralString = "SELECT 1"


class PgRelayStore:
    """:class:`~ledgerbox.relay._store.RelayStore` on PostgreSQL: the relay's SQL on one
    psycopg connection, opened on first use, reopened after a connection error.

    Parameters
    ----------
    config : RelayConfig
    role : str
        Name used in ``application_name`` (``ledgerbox-relay-<role>``). The persist
        connections (``mark...``) commit asynchronously (``synchronous_commit = off``: a
        persist lost in a crash only makes the relay send the same events again); the
        ``rebase`` connection has no statement timeout.
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
            "tick": ident(f"{config.outbox_table}_relay_tick"),
        }
        prefix = f"{schema}." if schema else ""
        self._qualified = {
            "outbox": f"{prefix}{config.outbox_table}",
            "lease": f"{prefix}{config.outbox_table}_relay_lease",
            "member": f"{prefix}{config.outbox_table}_relay_member",
            "version_table": f"{prefix}{SCHEMA_VERSION_TABLE}",
            "tick": f"{prefix}{config.outbox_table}_relay_tick",
        }
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._channel = f"{config.outbox_table}_{schema or 'default'}_ledgerbox"
        self._gate_key = wake_gate_key(self._channel)  # computed once: used every 50 ms
        self._epoch = 0
        self._sysid = 0
        self._rendered: dict[str, bytes] = {}
        self._used_at = 0.0  # time.monotonic() of the last statement started
        self._opening = asyncio.Lock()  # one connect at a time (a claim's and a persist's)

    @property
    def epoch(self) -> int:
        """Connections opened so far (see :attr:`RelayStore.epoch`)."""
        return self._epoch

    async def connected(self) -> int:
        """Open the connection if it is not open; return :attr:`epoch` (see
        :meth:`RelayStore.connected`). A connection idle for more than
        :data:`CONNECTED_CHECK_S` is pinged first: one the server closed meanwhile
        (``idle_session_timeout``, a proxy's idle timeout) is replaced now, before the
        claim, not found by the persist (whose cursors it would then refuse: every sparse
        event sent twice; a review, 2026-12-05). Raises StoreError when it cannot be opened."""
        conn = self._conn
        idle_s = time.monotonic() - self._used_at
        if conn is not None and not conn.closed and idle_s > CONNECTED_CHECK_S:
            with contextlib.suppress(StoreError):
                await self.ping()  # a broken connection is dropped: reopened below
        await self._connection()
        return self._epoch

    def _q(self, template: LiteralString) -> sql.Composed:
        return sql.SQL(template).format(**self._names)

    def _b(self, template: LiteralString, conn: psycopg.AsyncConnection[Any]) -> bytes:
        """The statement's text with the table names in, rendered once per template (the
        hot path runs a few hundred statements a second: composing them each time was a
        measurable share of the relay's CPU)."""
        found = self._rendered.get(template)
        if found is None:
            found = self._rendered[template] = self._q(template).as_bytes(conn)
        return found

    def _options(self) -> str:
        # random_page_cost 1.1 (SSD / cached data): index scans are costed as what they are,
        # not as random disk reads. jit off: every statement of the relay is short, but
        # PostgreSQL compiles a statement once its estimated cost passes jit_above_cost, and
        # the estimates grow with the rows kept (history): the gauges' pending count over a
        # table of 300,000 published rows took 311 ms, of which 310 ms JIT compilation, for a
        # 0.6 ms query - every 5 s, on the database the relay drains (docs/performance.md).
        # The URL's own ``options`` (``?options=-c search_path=...``) are kept, ours after
        # them: psycopg's keyword argument replaces the URL's value (they were dropped).
        options = [str(conninfo_to_dict(self.config.libpq_url).get("options") or "")]
        options += ["-c TimeZone=UTC", "-c random_page_cost=1.1", "-c jit=off"]
        options.append(
            "-c statement_timeout=0" if self.role == "rebase" else "-c statement_timeout=60000"
        )
        if self.role.startswith("mark"):
            options.append("-c synchronous_commit=off")
        return " ".join(o for o in options if o)

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        self._used_at = time.monotonic()
        if self._conn is not None and not self._conn.closed:
            return self._conn
        async with self._opening:
            return await self._open()

    async def _open(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self.config.libpq_url,
                    autocommit=True,
                    **connect_args(self.config.libpq_url),
                    application_name=f"ledgerbox-relay-{self.role}",
                    options=self._options(),
                )
                cur = await conn.execute(SYSTEM_ID)
                row = await cur.fetchone()
            except psycopg.Error as exc:
                raise _translate(exc, "connect") from exc
            assert row is not None
            self._conn, self._sysid = conn, int(row[0])
            self._epoch += 1
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
        self, template: LiteralString, params: dict[str, Any], what: str, *, binary: bool = False
    ) -> list[tuple[Any, ...]]:
        conn = await self._connection()
        try:
            cur = await conn.execute(self._b(template, conn), params, binary=binary)
            return await cur.fetchall() if _has_rows(cur) else []
        except psycopg.Error as exc:
            await self._after_error()
            raise _translate(exc, what) from exc

    async def _run(self, template: LiteralString, params: dict[str, Any], what: str) -> int:
        conn = await self._connection()
        try:
            cur = await conn.execute(self._b(template, conn), params)
            return cur.rowcount
        except psycopg.Error as exc:
            await self._after_error()
            raise _translate(exc, what) from exc

    @contextlib.asynccontextmanager
    async def _transaction(self, what: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """One transaction on the connection (BEGIN ... COMMIT; ROLLBACK on any error)."""
        conn = await self._connection()
        try:
            async with conn.transaction():
                yield conn
        except psycopg.Error as exc:
            await self._after_error()
            raise _translate(exc, what) from exc

    async def _in(
        self,
        conn: psycopg.AsyncConnection[Any],
        template: LiteralString,
        params: dict[str, Any],
    ) -> list[tuple[Any, ...]]:
        cur = await conn.execute(self._b(template, conn), params)
        return await cur.fetchall() if _has_rows(cur) else []

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
            "shards": _ints(s for s, _ in held),
            "fences": _ints(f for _, f in held),
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
        params = {
            "me": self.me,
            "shards": _ints(s for s, _ in held),
            "fences": _ints(f for _, f in held),
        }
        return await self._run(RELEASE_SHARDS, params, "release_shards")

    async def leave(self) -> None:
        """Delete this relay's member row."""
        await self._run(LEAVE, {"me": self.me}, "leave")

    # -- cursors -------------------------------------------------------------------------------

    async def open_shards(
        self, held: Sequence[tuple[int, int]], *, release_held: bool = False
    ) -> list[OpenedShard]:
        """The validated cursors of the shards held under the given fences (see
        :meth:`RelayStore.open_shards`); refusals are recorded in the lease rows."""
        if not held:
            return []
        await self._connection()  # the system identifier of this connection's cluster
        params = {
            "me": self.me,
            "sysid": self._sysid,
            "shards": _ints(s for s, _ in held),
            "fences": _ints(f for _, f in held),
        }
        rows = await self._fetch(OPEN_SHARDS, params, "open_shards")
        opened: list[OpenedShard] = []
        for shard, fence, lo, hi, after_id, refused, ahead, moved in rows:
            shard, fence = int(shard), int(fence)
            reason: str | None = refused
            if reason is None and ahead:
                reason = _AHEAD
            elif reason is None and moved:
                reason = await self._validate(shard, fence)
            if reason is not None:
                if refused is None:
                    await self._refuse(shard, fence, reason)
                opened.append(OpenedShard(shard, fence, None, reason))
            else:
                opened.append(OpenedShard(shard, fence, Cursor(lo, hi, int(after_id))))
        usable = [o.shard for o in opened if o.cursor is not None]
        if release_held and usable:
            await self._run(RELEASE_ALL_HELD, {"shards": _ints(usable)}, "release_held")
        return sorted(opened, key=lambda o: o.shard)

    async def _validate(self, shard: int, fence: int) -> str | None:
        """The reason to refuse a cursor written on another cluster, else ``None`` (and the
        lease row now names this cluster)."""
        ((counter_ok, rows_ok, no_strays),) = await self._fetch(
            VALIDATE_SHARD, {"shard": shard}, "validate_shard"
        )
        if not counter_ok:
            return "database behind the cursor (transaction counter lower than at the last persist)"
        if not rows_ok:
            return "database behind the cursor (a row has a transaction id above the counter)"
        if not no_strays:
            return "rows written after the last persist with ids the cursor counts as published"
        params = {"me": self.me, "sysid": self._sysid, "shard": shard, "fence": fence}
        await self._run(ACCEPT_SHARD, params, "accept_shard")
        log.info("shard %d: cursor valid on this cluster (system identifier changed)", shard)
        return None

    async def _refuse(self, shard: int, fence: int, reason: str) -> None:
        params = {"me": self.me, "shard": shard, "fence": fence, "reason": reason}
        await self._run(REFUSE_SHARD, params, "refuse_shard")

    async def refused_shards(self) -> list[tuple[int, str]]:
        """``(shard, reason)`` of every shard refused, or whose cursor is ahead of the
        database now (not yet refused by a relay)."""
        rows = await self._fetch(REFUSED_SHARDS, {}, "refused_shards")
        return [(int(s), str(r)) for s, r in rows]

    async def range_ids(self, reads: Sequence[ShardRead], cap: int) -> dict[int, Sequence[int]]:
        """The next ``cap`` ids of each open range, in id order (id-list paging), as compact
        arrays (8 bytes an id: with 8 lanes over large ranges a list of Python ints took
        several MB of the relay's RSS)."""
        if not reads:
            return {}
        params = {
            "cap": cap,
            "shards": _ints(r.shard for r in reads),
            "lo": _snapshots(r.cursor.lo for r in reads),
            "hi": _snapshots(r.cursor.hi for r in reads),
            "after": _ints(r.cursor.after_id for r in reads),
        }
        rows = await self._fetch(RANGE_IDS, params, "range_ids")
        listed: dict[int, Sequence[int]] = {}
        for shard, packed in rows:
            ids = array.array("q")
            ids.frombytes(packed)
            if sys.byteorder == "little":
                ids.byteswap()  # int8send is big-endian (network order)
            listed[int(shard)] = ids
        return listed

    async def persist(
        self,
        cursors: Sequence[CursorWrite],
        dead: Sequence[DeadLetter] = (),
        held: Sequence[tuple[int, int]] = (),
    ) -> dict[int, PersistOutcome]:
        """Write cursors, dead-lettered and held rows in one fenced transaction (see
        :meth:`RelayStore.persist`); one statement when there are neither."""
        if not cursors:
            return {}
        await self._connection()
        # No await from here to the statement: the connection checked is the one it runs on.
        reopened = [c for c in cursors if c.epoch is not None and c.epoch != self._epoch]
        if reopened:
            log.warning(
                "%d cursors of shards %s not persisted: the database connection was reopened"
                " since their claim (the server may have restarted or failed over and given"
                " their transaction ids out again); their events are read again and sent again",
                len(reopened),
                ",".join(str(c.shard) for c in reopened),
            )
            stale = {c.shard for c in reopened}
            cursors = [c for c in cursors if c.shard not in stale]
            dead = [d for d in dead if d.shard not in stale]
            held = [h for h in held if h[1] not in stale]
            if not cursors:
                return dict.fromkeys(stale, PersistOutcome.RECHECK)
        else:
            stale = set()
        params: dict[str, Any] = {
            "me": self.me,
            "sysid": self._sysid,
            "shards": _ints(c.shard for c in cursors),
            "fences": _ints(c.fence for c in cursors),
            "lo": _snapshots(c.cursor.lo for c in cursors),
            "hi": _snapshots(c.cursor.hi for c in cursors),
            "after": _ints(c.cursor.after_id for c in cursors),
        }
        if not dead and not held:
            rows = await self._fetch(PERSIST_CURSORS, params, "persist")
            written = {int(r[0]) for r in rows}
        else:
            async with self._transaction("persist") as conn:
                written = {int(r[0]) for r in await self._in(conn, PERSIST_CURSORS, params)}
                ok = _ints(sorted(written))
                if dead:
                    dead_params = {
                        "ok": ok,
                        "ids": _ints(d.id for d in dead),
                        "errors": [d.error[:2000] for d in dead],
                    }
                    await self._in(conn, PERSIST_DEAD, dead_params)
                if held:
                    await self._in(conn, PERSIST_HELD, {"ok": ok, "ids": _ints(i for i, _ in held)})
        outcomes = {c.shard: PersistOutcome.OK for c in cursors if c.shard in written}
        outcomes.update(dict.fromkeys(stale, PersistOutcome.RECHECK))
        if len(outcomes) < len(cursors) + len(stale):
            missing = [c for c in cursors if c.shard not in written]
            diag = {
                "me": self.me,
                "shards": _ints(c.shard for c in missing),
                "fences": _ints(c.fence for c in missing),
            }
            for shard, owned in await self._fetch(PERSIST_DIAGNOSIS, diag, "persist"):
                outcomes[int(shard)] = PersistOutcome.RECHECK if owned else PersistOutcome.LOST
        return outcomes

    # -- the hot path ----------------------------------------------------------------------

    async def claim_batch(self, reads: Sequence[ShardRead], limit: int, *, hold: bool) -> Claim:
        """Read up to ``limit`` rows of the given shards' ranges, sorted by (shard, id); with
        ``hold``, a row behind a dead-lettered row of its key comes with ``held = True``.
        Nothing is locked: a shard has one owner at a time (lease)."""
        params = claim_params(reads, limit)
        template = CLAIM_BATCH_HOLD if hold else CLAIM_BATCH_SKIP
        rows = await self._fetch(template, params, "claim", binary=True)
        head = next(row for row in rows if row[0] is not None)
        snapshot, ahead = str(head[0]), [int(s) for s in head[1]]
        events = [_event(row) for row in rows if row[2] is not None]
        del rows
        events.sort(key=_shard_and_id)
        return Claim(events, snapshot, ahead)

    # -- maintenance -------------------------------------------------------------------------

    async def record_tick(self, min_gap_s: float, retention_s: float) -> bool:
        """Record a cleanup tick unless one is younger than ``min_gap_s``; forget the ticks
        cleanup no longer needs."""
        params = {"gap_s": min_gap_s, "retention_s": retention_s}
        rows = await self._fetch(RECORD_TICK, params, "record_tick")
        return bool(rows[0][0])

    async def cleanup_published(self, retention_s: float, limit: int) -> int:
        """Delete up to ``limit`` published rows older than ``retention_s``; returns the count."""
        params = {"retention_s": retention_s, "limit": limit}
        return await self._run(CLEANUP_PUBLISHED, params, "cleanup_published")

    async def cleanup_members(self) -> int:
        """Delete member rows expired for more than an hour."""
        return await self._run(CLEANUP_MEMBERS, {}, "cleanup_members")

    async def stats(self, shard_count: int) -> RelayStats:
        """Pending, held and dead counts, age of the oldest pending row, owners, refusals."""
        counts = await self._fetch(STATS, {"shard_count": shard_count}, "stats")
        owners = await self._fetch(SHARD_OWNERS, {}, "shard_owners")
        pending, age, dead, held, stray = counts[0]
        return RelayStats(
            pending=int(pending),
            dead_lettered=int(dead),
            oldest_pending_age_s=None if age is None else float(age),
            owners=[(int(s), o, int(f), bool(live)) for s, o, f, live, _ in owners],
            held=int(held),
            refused=[(int(s), str(r)) for s, _, _, _, r in owners if r is not None],
            stray=int(stray),
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
        ((read_only, versioned, role),) = await self._fetch(
            SCHEMA_SESSION, {"version_table": self._qualified["version_table"]}, "schema check"
        )
        revision = None
        if versioned:
            found = await self._fetch(SCHEMA_VERSION_NUM, {}, "schema check")
            revision = str(found[0][0]) if found else ""
        topics: list[str] = []
        # Waiting topics only where the role may read the outbox: a refused SELECT is reported
        # as a missing privilege (with the GRANT), not as the check's own failure.
        readable = not any(r == "outbox" and p == "SELECT" and not ok for r, p, ok in privileges)
        if present.get("outbox") and readable and not {"status", "topic"} - columns["outbox"]:
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
            role=str(role),
        )

    async def ping(self) -> None:
        """Round trip to the database; raises :class:`StoreError` if it fails."""
        conn = await self._connection()
        try:
            await conn.execute("SELECT 1")
        except psycopg.Error as exc:
            await self._after_error()
            raise _translate(exc, "ping") from exc

    # -- operations ----------------------------------------------------------------------------

    async def replay_dead_lettered(self, row_id: int) -> int:
        """Send a dead-lettered row again, with the held and unpublished rows of its key
        behind it, in id order (one transaction); returns the rows stamped."""
        return await self._release(row_id, 0, "replay_dead_lettered")

    async def dead_lettered(self, query: DeadQuery) -> list[DeadRow]:
        """The dead-lettered rows ``query`` selects, in id order."""
        params = {
            "ids": None if query.ids is None else _ints(query.ids),
            "key": query.key,
            "event_type": query.event_type,
            "topic": query.topic,
            "older": query.older_than_s,
            "error": query.error,
            "limit": query.limit,
            "body": query.with_body,
        }
        rows = await self._fetch(DEAD_LETTERED, params, "dead_lettered")
        return [
            DeadRow(
                id=int(r[0]),
                event_id=str(r[1]),
                key=str(r[2]),
                event_type=str(r[3]),
                topic=str(r[4]),
                shard=int(r[5]),
                attempts=int(r[6]),
                last_error=r[7],
                created_at=r[8],
                occurred_at=r[9],
                held_behind=int(r[10]),
                payload=r[11],
                headers=r[12],
            )
            for r in rows
        ]

    async def held_keys(self, limit: int) -> list[HeldKeyRow]:
        """Keys with a dead-lettered row, by their first dead row's id."""
        rows = await self._fetch(HELD_KEYS, {"limit": limit}, "held_keys")
        return [
            HeldKeyRow(
                key=str(r[0]),
                dead_id=int(r[1]),
                dead_event_id=str(r[2]),
                dead_count=int(r[3]),
                held=int(r[4]),
                since=r[5],
            )
            for r in rows
        ]

    async def discard_dead_lettered(self, row_id: int) -> int:
        """Give up a dead-lettered row (``status = 4``); release its key's held rows."""
        return await self._release(row_id, 4, "discard_dead_lettered")

    async def _release(self, row_id: int, status: int, what: str) -> int:
        async with self._transaction(what) as conn:
            found = await self._in(conn, FIND_DEAD, {"id": row_id})
            if not found:
                return 0
            shard, key = int(found[0][0]), str(found[0][1])
            await self._in(conn, LOCK_LEASE, {"shard": shard})
            params = {"id": row_id, "status": status, "key": key, "shard": shard}
            # Pending rows first: after RELEASE_HELD the released rows are pending too.
            cur = await conn.execute(self._b(RELEASE_PENDING, conn), params)
            pending = cur.rowcount
            cur = await conn.execute(self._b(RELEASE_HELD, conn), params)
            return pending + cur.rowcount

    async def rebase(self, margin_s: float, *, dry_run: bool) -> list[RebasedShard]:
        """Re-seat every shard's cursor after a restore, one transaction per shard (see
        :meth:`RelayStore.rebase`)."""
        await self.ensure_leases(self.config.shard_count)
        await self._connection()
        done: list[RebasedShard] = []
        for shard in range(self.config.shard_count):
            async with self._transaction("rebase") as conn:
                # First statement, before the transaction has an id: S0 does not see it, so
                # the rows stamped with its id below are read after lo = S0.
                ((s0,),) = await self._in(conn, SNAPSHOT, {})
                ((lo, hi, after_id, persisted_at),) = await self._in(
                    conn, REBASE_LOCK, {"shard": shard}
                )
                since = (
                    None
                    if persisted_at is None
                    else persisted_at - datetime.timedelta(seconds=margin_s)
                )
                params = {
                    "shard": shard,
                    "s0": s0,
                    "lo": lo,
                    "hi": hi,
                    "after": after_id,
                    "since": since,
                    "sysid": self._sysid,
                }
                rows = await self._in(conn, REBASE_COUNT if dry_run else REBASE_ROWS, params)
                again, frozen = rows[0]
                if not dry_run:
                    await self._in(conn, REBASE_LEASE, params)
            done.append(RebasedShard(shard, int(again), int(frozen)))
        return done

    # -- wake gate (role "gate", docs/relay.md "Wake gate") --------------------------------------

    def _gate_params(self) -> dict[str, Any]:
        return {"k1": self._gate_key[0], "k2": self._gate_key[1]}

    async def gate_try(self) -> tuple[bool, bool]:
        """``(taken, held)``: ``pg_try_advisory_lock`` of the wake gate on this connection
        (a session lock: never taken twice by one store, see :class:`WakeGate`), and whether
        it is held EXCLUSIVE after the attempt (by this session, or another session of this
        database: a SHARE probe fails)."""
        params = {**self._gate_params(), "channel": self._channel, "take": TAKE_PAYLOAD}
        rows = await self._fetch(GATE_TRY, params, "gate")
        return bool(rows[0][0]), bool(rows[0][1])

    async def gate_release(self) -> None:
        """Release the wake gate and notify the channel with payload ``"gate"``."""
        params = {"channel": self._channel, "payload": GATE_PAYLOAD}
        await self._fetch(GATE_RELEASE, params, "gate")

    async def gate_ping(self) -> None:
        """One round trip on the gate connection (raises if it, and the lock, are gone)."""
        await self._fetch(GATE_PING, {}, "gate")

    # -- wake-up -------------------------------------------------------------------------------

    async def notifications(self) -> AsyncIterator[str | None]:
        """LISTEN on the outbox channel; yields ``None`` once as soon as LISTEN is active (a
        commit just before it sent no notification the caller could see), then each
        notification's payload (``""`` from the write path, ``"gate"`` from a relay
        releasing the wake gate). A hint only.

        Raises :class:`StoreError` when the connection drops; the caller reconnects.
        """
        conn = await self._connection()
        try:
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
            yield None
            async for notice in conn.notifies():
                yield notice.payload
        except psycopg.Error as exc:
            await self._after_error()
            raise _translate(exc, "listen") from exc


_AHEAD = "cursor ahead of the database (transaction counter behind the cursor's snapshot)"


def claim_params(reads: Sequence[ShardRead], limit: int) -> dict[str, Any]:
    """The parameters of ``CLAIM_BATCH_HOLD`` / ``CLAIM_BATCH_SKIP`` for ``reads`` (pages of
    listed ids first; the closed ranges share what is left of ``limit``).

    Built in one pass over ``reads`` (a claim names every shard of the lane, 64 by default,
    ~140 times a second at 1,000 events/s): in the steady state every range is closed at the
    same snapshot, so the arrays that repeat an earlier one reuse its text."""
    all_shards: list[int] = []
    all_top: list[str | None] = []
    pshards: list[int] = []
    plo: list[str | None] = []
    phi: list[str | None] = []
    page_ids: list[int] = []
    shards: list[int] = []
    lo: list[str | None] = []
    hi: list[str | None] = []
    after: list[int] = []
    for read in reads:
        cursor = read.cursor
        all_shards.append(read.shard)
        all_top.append(cursor.hi or cursor.lo)
        if read.ids is not None:
            pshards.append(read.shard)
            plo.append(cursor.lo)
            phi.append(cursor.hi)
            page_ids.extend(read.ids)
        else:
            shards.append(read.shard)
            lo.append(cursor.lo)
            hi.append(cursor.hi)
            after.append(cursor.after_id)
    room = limit - len(page_ids)
    if room <= 0:
        shards, lo, hi, after = [], [], [], []
    all_shards_text, all_top_text = _ints(all_shards), _snapshots(all_top)
    return {
        "all_shards": all_shards_text,
        "all_top": all_top_text,
        "pshards": _ints(pshards),
        "plo": _snapshots(plo),
        "phi": _snapshots(phi),
        "pids": _ints(page_ids),
        "shards": all_shards_text if shards == all_shards else _ints(shards),
        "lo": all_top_text if lo == all_top else _snapshots(lo),
        "hi": _snapshots(hi),
        "after": _ints(after),
        "limit": max(room, 0),
    }


# Arrays go as array literals in one text parameter each (cast in the SQL): psycopg dumps a
# list element by element in Python, which cost more than the claim's other client work.
def _ints(values: Iterable[int]) -> str:
    return "{" + ",".join(map(str, values)) + "}"


def _snapshots(values: Iterable[str | None]) -> str:
    # A snapshot's text is digits, ':' and ',': safe inside double quotes.
    return "{" + ",".join(["NULL" if v is None else '"' + v + '"' for v in values]) + "}"


def pg_store_factory(config: RelayConfig) -> StoreFactory:
    """The default :data:`~ledgerbox.relay._store.StoreFactory`: a :class:`PgRelayStore` of
    ``config`` per role (each its own connection, ``application_name`` naming the role)."""

    def build(role: str) -> RelayStore:
        return PgRelayStore(config, role)

    return build


def _event(row: tuple[Any, ...]) -> ClaimedEvent:
    """A claimed row (after the claim's snapshot and ahead columns, before ``rn``). The few
    values that repeat across rows (topic, event type, source, aggregate type) are interned:
    one object each instead of one per row held in a batch or a prefetch (peak RSS)."""
    intern = sys.intern
    (row_id, shard, topic, key, payload, headers, event_id, idem, event_type, source,
     aggregate_type, aggregate_id, version, at_ms, at_iso, held) = row[2:-1]  # fmt: skip
    return ClaimedEvent(
        row_id, shard, intern(topic), key, payload, headers, event_id, idem, intern(event_type),
        intern(source), intern(aggregate_type), aggregate_id, version, at_ms, at_iso, held,
    )  # fmt: skip


def _has_rows(cur: psycopg.AsyncCursor[Any]) -> bool:
    """The statement returned rows (a result set, possibly empty): what ``description is not
    None`` says, without building a column object per column on every claim."""
    result = cur.pgresult
    return result is not None and (result.nfields > 0 or result.status == pq.ExecStatus.TUPLES_OK)


def _shard_and_id(event: ClaimedEvent) -> tuple[int, int]:
    return event.shard, event.id


def _translate(exc: psycopg.Error, what: str) -> StoreError:
    # The one classification table (ledgerbox._core.faults): a psycopg error always has a fault.
    error = StoreError.translate(exc, what)
    assert error is not None
    return error
