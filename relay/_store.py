"""The relay's storage seam: what the relay needs from its database, as a Protocol.

:class:`RelayStore` lists exactly the calls the relay makes (leases and membership, the hot
path, maintenance, the wake-up, health). Two implementations keep the same semantics:

* :class:`ledgerbox.relay._pgstore.PgRelayStore`: PostgreSQL through psycopg 3, the ONLY
  module of the relay that runs SQL (the daemon's store);
* :class:`ledgerbox.relay.testing.InMemoryRelayStore`: the same rules in memory (pending rows
  per shard in id order, fenced marks, dead-lettered rows and the hold rule, leases with fences
  and expiry on an injectable clock), for pure-logic tests of the relay without PostgreSQL.

A :class:`~ledgerbox.relay.Relay` gets every store it uses (each lane's claim and mark store,
leases, maintenance, LISTEN) from ONE :data:`StoreFactory` called with the store's role; the
CLI's ``check`` and ``status`` do the same. Every method raises
:class:`ledgerbox.relay.StoreError` (never a driver error) when the database call fails.

Times are the database's (``now()``): clocks of relay machines are never compared.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["ClaimedEvent", "RelayStats", "RelayStore", "SchemaReport", "StoreFactory"]


@dataclass(frozen=True, slots=True)
class ClaimedEvent:
    """One pending outbox row claimed for publication, its fields as the Kafka record needs
    them: ``payload`` and ``headers`` are the JSON texts as stored, ``event_id`` and
    ``aggregate_version`` their text forms, ``occurred_at_ms`` the event time in ms since the
    epoch and ``occurred_at_iso`` its ISO 8601 form (``datetime.isoformat`` of a UTC time)."""

    id: int
    shard: int
    topic: str
    partition_key: str
    payload: str
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


@dataclass(frozen=True, slots=True)
class RelayStats:
    """What ``relay status`` shows and the leader's gauges read.

    Attributes
    ----------
    pending, dead_lettered : int
        Rows with ``status = 0`` and ``status = 2``.
    oldest_pending_age_s : float | None
        Age of the oldest pending row in seconds (its ``created_at``); ``None``: none pending.
    owners : list[tuple[int, str | None, int, bool]]
        ``(shard, owner, fence, live)`` of every lease row, by shard (``-1``: the leader).
    """

    pending: int
    dead_lettered: int
    oldest_pending_age_s: float | None
    owners: list[tuple[int, str | None, int, bool]]


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
    """

    missing_tables: list[str]
    missing_columns: list[str]
    revision: str | None
    missing_privileges: list[str]
    read_only: bool
    pending_topics: list[str]


class RelayStore(Protocol):
    """The relay's database calls, one method per query, for one member (``relay_id``).

    Leases are rows ``(shard, owner, fence, expires_at)``; a write "under a fence" happens
    only while this member owns the shard with that fence. Every method raises
    :class:`ledgerbox.relay.StoreError` when the call fails; the relay retries.
    """

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

    # -- the hot path ------------------------------------------------------------------------

    async def claim_batch(
        self,
        shards: Sequence[int],
        limit: int,
        *,
        hold: bool,
        exclude: Sequence[int] = (),
    ) -> list[ClaimedEvent]:
        """Up to ``limit`` pending rows of ``shards`` (taken shard after shard in the given
        order, each shard's rows in id order), returned sorted by ``(shard, id)``.

        ``hold``: a row is skipped while an earlier row of its partition key is dead-lettered.
        ``exclude``: ids already sent whose mark is still running. Nothing is locked: a shard
        has one owner at a time (lease).
        """

    async def mark_published(self, ids: Sequence[int], fences: Sequence[tuple[int, int]]) -> int:
        """Mark pending rows published (``status = 1``, ``published_at = now``) in one
        statement, only where this relay still owns the row's shard under the given
        ``(shard, fence)``; returns the count."""

    async def mark_dead_lettered(self, event_id: int, shard_fence: int, error: str) -> int:
        """Dead-letter one pending row (``status = 2``, ``last_error`` = the first 2,000
        characters of ``error``) if its shard is still owned under ``shard_fence``; returns
        0 or 1."""

    # -- maintenance -------------------------------------------------------------------------

    async def cleanup_published(self, retention_s: float, limit: int) -> int:
        """Delete up to ``limit`` rows published more than ``retention_s`` seconds ago (never
        a pending or dead-lettered row); returns the count."""

    async def cleanup_members(self) -> int:
        """Delete member rows expired for more than an hour; returns the count."""

    async def stats(self, shard_count: int) -> RelayStats:
        """Pending and dead-lettered counts, age of the oldest pending row, lease owners."""

    async def owned_stats(self, shards: Sequence[int]) -> tuple[int, float | None]:
        """``(rows not yet published, age in seconds of the oldest of them)`` in ``shards``
        (the shards this relay holds; ``None``: none waiting)."""

    async def schema_report(self) -> SchemaReport:
        """The tables, columns, schema revision and privileges the relay needs (one short
        read-only round of catalog queries)."""

    async def ping(self) -> None:
        """One round trip to the database."""

    # -- wake-up ---------------------------------------------------------------------------

    def notifications(self) -> AsyncIterator[None]:
        """Yield once as soon as listening is active (a commit just before it notified no
        one), then once per committed transaction that wrote outbox rows. A hint only."""

    async def aclose(self) -> None:
        """Release the connection (idempotent); the next call reconnects."""


#: Builds the store of one role (``"main"``, ``"main3"``, ``"mark"``, ``"lease"``, ``"maint"``,
#: ``"listen"``, ``"check"``, ``"status"``); the role names the connection
#: (``application_name = ledgerbox-relay-<role>``).
StoreFactory = Callable[[str], RelayStore]
