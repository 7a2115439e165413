"""What ``ledgerbox relay status`` reads, as a function: the pending, held and dead-lettered
counts, the oldest pending age and the shard owners of one outbox (docs/relay.md, "CLI").

For dashboards, health endpoints and soak observers that want the relay's own view of
"pending" without running the CLI: under the snapshot cursor a published row keeps
``status = 0``, so a ``count(*) WHERE status = 0`` counts every row ever written; only the
shards' cursors say which rows are still to publish.
"""

from __future__ import annotations

from ledgerbox._core.names import DEFAULT_SHARD_COUNT
from ledgerbox.relay._config import RelayConfig
from ledgerbox.relay._pgstore import PgRelayStore
from ledgerbox.relay._store import RelayStats

__all__ = ["UNUSED_KAFKA", "database_only_config", "relay_stats"]

#: A Kafka address the database-only reads never use (RelayConfig requires one).
UNUSED_KAFKA = "unused-by-database-reads:0"


def database_only_config(
    database_url: str,
    *,
    outbox_table: str = "outbox",
    schema: str | None = None,
    shard_count: int = DEFAULT_SHARD_COUNT,
) -> RelayConfig:
    """A :class:`RelayConfig` for the reads and repairs that touch the database only
    (``status``, ``rebase``, the operator commands): no Kafka address is needed, nor used."""
    return RelayConfig(
        database_url=database_url,
        kafka_bootstrap_servers=UNUSED_KAFKA,
        outbox_table=outbox_table,
        schema=schema,
        shard_count=shard_count,
    )


async def relay_stats(
    database_url: str,
    *,
    outbox_table: str = "outbox",
    schema: str | None = None,
    shard_count: int = DEFAULT_SHARD_COUNT,
) -> RelayStats:
    """Read the relay's view of one outbox in one short read-only statement pair.

    Parameters
    ----------
    database_url : str
        SQLAlchemy URL of the outbox's database (``postgresql+psycopg://...``).
    outbox_table, schema : str, str | None
        As the relay's ``RelayConfig`` names them.
    shard_count : int
        The writers' ``OutboxTable.shard_count`` (default 64).

    Returns
    -------
    RelayStats
        ``pending`` (rows no shard cursor has passed, neither dead-lettered, held nor
        discarded), ``dead_lettered``, ``held``, ``oldest_pending_age_s`` (seconds, ``None``
        when nothing is pending), ``owners`` (``(shard, owner, fence, live)``; shard ``-1``
        is the leader) and ``refused`` shards.

    Raises
    ------
    ledgerbox.ConfigurationError
        A setting is invalid (e.g. an outbox table name that is not an identifier).
    ledgerbox.relay.StoreError
        The database refused or could not be reached (one line, the cause).

    Changes nothing; needs SELECT on the outbox and lease tables (docs/security.md).
    """
    config = database_only_config(
        database_url, outbox_table=outbox_table, schema=schema, shard_count=shard_count
    )
    store = PgRelayStore(config, "status")
    try:
        return await store.stats(shard_count)
    finally:
        await store.aclose()
