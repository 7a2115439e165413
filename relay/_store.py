"""The relay's storage seam: what the relay needs from its database, as a Protocol.

:class:`RelayStore` lists exactly the calls the relay makes (leases and membership, the hot
path, maintenance, the wake-up, health) and the operator's calls on the same tables
(replay, discard, rebase). Two implementations keep the same semantics:

* :class:`ledgerbox.relay._pgstore.PgRelayStore`: PostgreSQL through psycopg 3, the ONLY
  module of the relay that runs SQL (the daemon's store);
* :class:`ledgerbox.relay.testing.InMemoryRelayStore`: the same rules in memory (committed
  rows with a commit sequence standing in for transaction ids, per-shard cursors in lease
  rows, fenced persists, dead-lettered and held rows, leases with fences and expiry on an
  injectable clock), for pure-logic tests of the relay without PostgreSQL.

Read design (docs/relay.md, "Read design"): every outbox row carries the id of the
transaction that wrote it (``txid``); a shard's cursor (:class:`Cursor`, kept in its lease
row) names the snapshot up to which everything is published. A claim returns the rows whose
transaction committed after the cursor's ``lo`` snapshot and before its ``hi`` snapshot
(``hi`` = the claim's own snapshot when the range is closed), in id order per shard; nothing
is written per row.

A :class:`~ledgerbox.relay.Relay` gets every store it uses (each lane's claim and persist
store, leases, maintenance, LISTEN) from ONE :data:`StoreFactory` called with the store's
role; the CLI's ``check``, ``status`` and ``rebase`` do the same. Every method raises
:class:`ledgerbox.relay.StoreError` (never a driver error) when the database call fails.

Times are the database's (``now()``): clocks of relay machines are never compared.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "STRAY_COUNT_CAP",
    "Claim",
    "ClaimedEvent",
    "Cursor",
    "CursorWrite",
    "DeadLetter",
    "DeadQuery",
    "DeadRow",
    "HeldKeyRow",
    "OpenedShard",
    "PersistOutcome",
    "RebasedShard",
    "RelayStats",
    "RelayStore",
    "SchemaReport",
    "ShardRead",
    "StoreFactory",
]


@dataclass(frozen=True, slots=True)
class ClaimedEvent:
    """One committed outbox row claimed for publication, its fields as the Kafka record needs
    them: ``payload`` is the JSON as stored, UTF-8 (the record's value as is), ``headers`` the
    JSON text of the extra headers, ``event_id`` and
    ``aggregate_version`` their text forms, ``occurred_at_ms`` the event time in ms since the
    epoch and ``occurred_at_iso`` its ISO 8601 form (``datetime.isoformat`` of a UTC time).
    ``held``: with ``hold=True`` an earlier row of the same partition key is dead-lettered,
    so this row must not be sent (it is held in the persist that passes it)."""

    id: int
    shard: int
    topic: str
    partition_key: str
    payload: bytes
    headers: str
    event_id: str
    idempotency_key: str
    event_type: str
    source: str
    aggregate_type: str
    aggregate_id: str
    aggregate_version: str | None
    occurred_at_ms: int
    occurred_at_iso: str
    held: bool = False


@dataclass(frozen=True, slots=True)
class Cursor:
    """How far one shard is published: a range of committed transactions and a position in it.

    Snapshots are opaque texts of the store (PostgreSQL's ``pg_snapshot`` text form,
    ``xmin:xmax:xip,...``); the relay never looks inside them.

    Attributes
    ----------
    lo : str | None
        Every row whose transaction is visible in this snapshot is published (or
        dead-lettered, held, discarded). ``None``: nothing is published yet (a new lease
        row, or a table migrated from schema v1): the first range holds every committed row.
    hi : str | None
        ``None``: the range is closed; the next claim reads up to its own snapshot. Else the
        open range ``lo .. hi`` is being read in id order (it held more rows than a batch).
    after_id : int
        In an open range, the rows with ``id <= after_id`` are published; 0 otherwise.
        Invariant: ``after_id > 0`` only with ``hi`` set.
    """

    lo: str | None
    hi: str | None = None
    after_id: int = 0


@dataclass(frozen=True, slots=True)
class ShardRead:
    """What one claim reads of one shard.

    ``ids``: ``None`` reads the range from the cursor in id order (top rows only); a sequence
    reads exactly these ids of the cursor's OPEN range (id-list paging of a large range:
    :meth:`RelayStore.range_ids` listed them), each re-checked against the range.
    """

    shard: int
    cursor: Cursor
    ids: Sequence[int] | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    """Result of :meth:`RelayStore.claim_batch`.

    Attributes
    ----------
    events : list[ClaimedEvent]
        Sorted by ``(shard, id)``.
    snapshot : str
        The claim's snapshot: the ``hi`` of every shard whose range was closed when the claim
        began.
    ahead : list[int]
        Shards whose cursor is ahead of the database (restored from a dump into a cluster
        whose transaction counter is behind): nothing of them was read.
    """

    events: list[ClaimedEvent]
    snapshot: str
    ahead: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class CursorWrite:
    """One shard's cursor to persist under the fence the shard is held with.

    ``epoch``: the persisting store's :attr:`RelayStore.epoch` when the claim that produced
    the cursor ran (its connection open then: :meth:`RelayStore.connected`). The cursor is
    written only while that same connection is the one open: a connection reopened since
    may reach a server that restarted after a crash or a promoted standby, where the
    transaction ids the cursor's snapshot counts as finished can be given out again, and a
    cursor written there would skip the rows of those new transactions (an adversarial
    review, 2026-12-05). ``None``: not checked (stores whose connection never drops).
    """

    shard: int
    fence: int
    cursor: Cursor
    epoch: int | None = None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A row Kafka refused for good: ``status = 2`` with the reason (first 2,000 chars)."""

    id: int
    shard: int
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadQuery:
    """Which dead-lettered rows (``status = 2``) :meth:`RelayStore.dead_lettered` returns;
    ``None`` fields match any row.

    ``ids``: only these row ids; ``key``, ``event_type``, ``topic``: exact;
    ``older_than_s``: created more than this many seconds ago (database clock); ``error``:
    case-insensitive substring of ``last_error``; ``limit``: at most this many, in id
    order; ``with_body``: also the payload and headers (JSON text).
    """

    ids: Sequence[int] | None = None
    key: str | None = None
    event_type: str | None = None
    topic: str | None = None
    older_than_s: float | None = None
    error: str | None = None
    limit: int = 100
    with_body: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadRow:
    """A dead-lettered row as an operator sees it. ``held_behind``: rows of its key held
    (``status = 3``) behind it, up to the key's next dead-lettered row; ``payload`` and
    ``headers`` only with ``DeadQuery.with_body``. Times are UTC."""

    id: int
    event_id: str
    key: str
    event_type: str
    topic: str
    shard: int
    attempts: int
    last_error: str | None
    created_at: dt.datetime
    occurred_at: dt.datetime
    held_behind: int
    payload: str | None = None
    headers: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldKeyRow:
    """A key with a dead-lettered row: later rows of it wait (``on_dead_letter="hold"``).

    ``dead_id`` / ``dead_event_id``: its first dead-lettered row, ``dead_count``: its
    dead-lettered rows, ``held``: its rows with ``status = 3``, ``since``: ``created_at``
    of ``dead_id`` (UTC)."""

    key: str
    dead_id: int
    dead_event_id: str
    dead_count: int
    held: int
    since: dt.datetime


class PersistOutcome(enum.Enum):
    """What :meth:`RelayStore.persist` did with one shard's cursor."""

    #: Written, with the shard's dead-lettered and held rows.
    OK = "ok"
    #: Not written: the shard is no longer held under that fence (its rows are sent again by
    #: the new owner, with the same event ids).
    LOST = "lost"
    #: Not written: the database is not the one the cursor was read from (another cluster,
    #: a counter behind the cursor, a connection reopened since the claim:
    #: :attr:`CursorWrite.epoch`) or the shard is refused; the relay reads it again with
    #: :meth:`RelayStore.open_shards`, which validates it.
    RECHECK = "recheck"


@dataclass(frozen=True, slots=True)
class OpenedShard:
    """A held shard's cursor as :meth:`RelayStore.open_shards` validated it.

    ``cursor`` is ``None`` exactly when ``refused`` names why the shard is refused (sticky
    until ``ledgerbox relay rebase``).
    """

    shard: int
    fence: int
    cursor: Cursor | None
    refused: str | None = None


@dataclass(frozen=True, slots=True)
class RebasedShard:
    """What ``relay rebase`` did (or, with ``dry_run``, would do) to one shard.

    Attributes
    ----------
    shard : int
    restamped : int
        Rows stamped with the rebase transaction's id: published again, in id order.
    frozen : int
        Rows stamped as visible to every snapshot (already published; their old transaction
        ids would otherwise fall into future ranges).
    """

    shard: int
    restamped: int
    frozen: int


#: ``RelayStats.stray`` is counted up to this many rows.
STRAY_COUNT_CAP = 10_000


@dataclass(frozen=True, slots=True)
class RelayStats:
    """What ``relay status`` shows and the leader's gauges read.

    Attributes
    ----------
    pending : int
        Committed rows the shards' persisted cursors have not passed (not dead-lettered,
        held or discarded).
    dead_lettered : int
        Rows with ``status = 2``.
    oldest_pending_age_s : float | None
        Age of the oldest pending row in seconds (its ``created_at``); ``None``: none pending.
    owners : list[tuple[int, str | None, int, bool]]
        ``(shard, owner, fence, live)`` of every lease row, by shard (``-1``: the leader).
    held : int
        Rows with ``status = 3`` (waiting behind a dead-lettered row of their key).
    refused : list[tuple[int, str]]
        ``(shard, reason)`` of the shards the relay refuses (cursor ahead of the database).
    stray : int
        Rows waiting (``status = 0``) in a shard outside ``0..shard_count-1``: no relay with
        this ``shard_count`` ever claims them (the writers' ``OutboxTable.shard_count`` is
        larger). Counted up to 10,000. Not in ``pending``.
    """

    pending: int
    dead_lettered: int
    oldest_pending_age_s: float | None
    owners: list[tuple[int, str | None, int, bool]]
    held: int = 0
    refused: list[tuple[int, str]] = field(default_factory=list)
    stray: int = 0


@dataclass(frozen=True, slots=True)
class SchemaReport:
    """What the relay's startup checks need to know about its tables (``relay check``).

    Attributes
    ----------
    missing_tables : list[str]
        Tables the relay uses that do not exist (not migrated, wrong schema or name).
    missing_columns : list[str]
        ``table.column`` the relay reads or writes that do not exist (schema behind).
    revision : str | None
        The ledgerbox schema revision in ``ledgerbox_alembic_version``; ``None`` when that
        table does not exist (tables created by an embedding Alembic environment).
    missing_privileges : list[str]
        ``"UPDATE on outbox"``: privileges the relay's role lacks.
    read_only : bool
        The session is read-only (a replica, ``default_transaction_read_only``).
    pending_topics : list[str]
        Up to 100 distinct topics of rows waiting to be published.
    role : str | None
        The session's ``current_user`` (named in the GRANT statements of ``relay check``).
    """

    missing_tables: list[str]
    missing_columns: list[str]
    revision: str | None
    missing_privileges: list[str]
    read_only: bool
    pending_topics: list[str]
    role: str | None = None


class RelayStore(Protocol):
    """The relay's database calls, one method per query, for one member (``relay_id``).

    Leases are rows ``(shard, owner, fence, expires_at)`` that also keep the shard's
    :class:`Cursor`; a write "under a fence" happens only while this member owns the shard
    with that fence. Every method raises :class:`ledgerbox.relay.StoreError` when the call
    fails; the relay retries.
    """

    @property
    def epoch(self) -> int:
        """Counts the connections opened so far. When it changes between reading cursors and
        using them, the database may have crashed or failed over: the relay discards what
        it holds in memory and reads the cursors again (:meth:`open_shards`)."""

    async def connected(self) -> int:
        """Open the connection if it is not open; return :attr:`epoch` (the persist
        connection's, stamped on the cursors of a claim: :class:`CursorWrite`)."""

    # -- leases and membership ---------------------------------------------------------------

    async def ensure_leases(self, shard_count: int) -> None:
        """Create the lease rows ``-1 .. shard_count-1`` that do not exist yet."""

    async def heartbeat(self, ttl_s: float) -> int:
        """Refresh this relay's member row (``expires_at = now + ttl_s``); returns the number
        of live members, this one included."""

    async def renew_shards(
        self, held: Sequence[tuple[int, int]], ttl_s: float
    ) -> list[tuple[int, int]]:
        """Extend the leases still owned under the given ``(shard, fence)``; returns those
        renewed. Shards missing from the result are lost."""

    async def acquire_shards(
        self, want: int, ttl_s: float, *, lo: int, hi: int
    ) -> list[tuple[int, int]]:
        """Take up to ``want`` free or expired leases with ``lo <= shard <= hi``, lowest shard
        first, each with ``fence + 1``; returns ``(shard, new fence)``. Two members never get
        the same shard."""

    async def release_shards(self, held: Sequence[tuple[int, int]]) -> int:
        """Give up leases owned under the given fences; returns how many were released."""

    async def leave(self) -> None:
        """Delete this relay's member row."""

    # -- cursors ---------------------------------------------------------------------------

    async def open_shards(
        self, held: Sequence[tuple[int, int]], *, release_held: bool = False
    ) -> list[OpenedShard]:
        """The persisted cursors of the shards held under the given ``(shard, fence)``,
        validated against this database (shards no longer held are left out).

        ``release_held`` (a relay with ``on_dead_letter="skip"``): the held rows of the
        opened shards (``status = 3``, left by a relay that held them) are stamped with this
        transaction's id, so they are read again and published.

        A cursor ahead of the database is refused, and the refusal is recorded in the lease
        row (sticky until ``relay rebase``): its snapshot is beyond the transaction counter,
        or, when the database's system identifier differs from the one the cursor was
        written on (``pg_upgrade``, a restored or copied cluster), the counter is behind the
        one seen at the last persist or behind a row's transaction id, or a row was written
        after the last persist with a transaction id the cursor already counts as published
        (docs/relay.md, "Restore and rebase").
        """

    async def range_ids(self, reads: Sequence[ShardRead], cap: int) -> dict[int, Sequence[int]]:
        """For each shard of ``reads`` (open ranges), the ids of its range after
        ``after_id``, in id order, at most ``cap``: the pages of id-list paging."""

    async def persist(
        self,
        cursors: Sequence[CursorWrite],
        dead: Sequence[DeadLetter] = (),
        held: Sequence[tuple[int, int]] = (),
    ) -> dict[int, PersistOutcome]:
        """Write the shards' cursors after Kafka confirmed what they pass, with the
        dead-lettered rows (``status = 2``) and the held rows (``(id, shard)``: ``status =
        3`` while an earlier row of their key is dead-lettered, else stamped with this
        transaction's id so they are read again) in ONE transaction, fenced: only shards
        still owned under the given fences are written, and only on the database the
        cursors belong to, through the connection open when their claim ran
        (:attr:`CursorWrite.epoch`). May commit asynchronously: a lost persist only makes the relay
        send the same events again (same event ids)."""

    # -- the hot path ----------------------------------------------------------------------

    async def claim_batch(self, reads: Sequence[ShardRead], limit: int, *, hold: bool) -> Claim:
        """Up to ``limit`` rows of the given shards, taken shard after shard in the given
        order, each shard's rows those its cursor's range holds after ``after_id``, in id
        order; returned sorted by ``(shard, id)``. Only rows with ``status = 0``; with
        ``hold``, a row behind a dead-lettered row of its key comes with ``held = True``.
        Nothing is locked or written: a shard has one owner at a time (lease)."""

    # -- maintenance -------------------------------------------------------------------------

    async def record_tick(self, min_gap_s: float, retention_s: float) -> bool:
        """Record ``(now, oldest running transaction)`` unless the newest such tick is less
        than ``min_gap_s`` old, and forget ticks older than the newest one past
        ``retention_s``; returns whether a tick was recorded. Cleanup uses the ticks to
        find old rows through the ``(shard, txid)`` index (cost independent of history)."""

    async def cleanup_published(self, retention_s: float, limit: int) -> int:
        """Delete up to ``limit`` published rows created more than ``retention_s`` seconds
        ago: only rows every cursor has passed, committed before a tick older than the
        retention, never a pending, held or dead-lettered row; returns the count."""

    async def cleanup_members(self) -> int:
        """Delete member rows expired for more than an hour; returns the count."""

    async def stats(self, shard_count: int) -> RelayStats:
        """Pending, held and dead-lettered counts, age of the oldest pending row, lease
        owners, refused shards."""

    async def owned_stats(self, shards: Sequence[int]) -> tuple[int, float | None]:
        """``(rows not yet published, age in seconds of the oldest of them)`` in ``shards``
        (the shards this relay holds; ``None``: none waiting)."""

    async def schema_report(self) -> SchemaReport:
        """The tables, columns, schema revision and privileges the relay needs (one short
        read-only round of catalog queries)."""

    async def ping(self) -> None:
        """One round trip to the database."""

    async def refused_shards(self) -> list[tuple[int, str]]:
        """``(shard, reason)`` of every shard refused, or whose cursor is ahead of the
        database now (a restore a relay has not noticed yet); ``relay check`` reports them."""

    # -- operations (an operator, not the daemon) ----------------------------------------------

    async def replay_dead_lettered(self, row_id: int) -> int:
        """Send a dead-lettered row again: it, the held rows of its key and the rows of its
        key not yet published (up to the key's next dead-lettered row) are stamped with this
        transaction's id, so they are read again in id order; returns the rows stamped (0 if
        the row is not dead-lettered)."""

    async def dead_lettered(self, query: DeadQuery) -> list[DeadRow]:
        """The dead-lettered rows ``query`` selects, in id order (a read; nothing locked)."""

    async def held_keys(self, limit: int) -> list[HeldKeyRow]:
        """Up to ``limit`` keys with a dead-lettered row, by their first dead row's id."""

    async def discard_dead_lettered(self, row_id: int) -> int:
        """Give up a dead-lettered row (``status = 4``, never sent); the held rows of its key
        are released as by :meth:`replay_dead_lettered`; returns the rows changed."""

    async def rebase(self, margin_s: float, *, dry_run: bool) -> list[RebasedShard]:
        """Re-seat every shard's cursor on this database after a restore (relays stopped):
        per shard, in one transaction, take the snapshot S0 first, stamp with the
        transaction's id every row the old cursor had not passed or created after its last
        persist minus ``margin_s`` (sent again: duplicates possible, loss never), stamp the
        other rows that S0 does not see as visible to every snapshot, set ``lo = S0``, bump
        the fence, free the lease and clear the refusal. ``dry_run``: count only."""

    # -- wake-up ---------------------------------------------------------------------------

    def notifications(self) -> AsyncIterator[str | None]:
        """Yield ``None`` once as soon as listening is active (a commit just before it
        notified no one), then each notification's payload: once per committed transaction
        that wrote outbox rows and notified, ``"gate"`` when a relay released the wake gate
        (:mod:`ledgerbox.relay._gate`). A hint only."""

    async def aclose(self) -> None:
        """Release the connection (idempotent); the next call reconnects."""


#: Builds the store of one role (``"main"``, ``"main3"``, ``"mark"``, ``"lease"``, ``"maint"``,
#: ``"listen"``, ``"check"``, ``"status"``, ``"rebase"``); the role names the connection
#: (``application_name = ledgerbox-relay-<role>``).
StoreFactory = Callable[[str], RelayStore]
