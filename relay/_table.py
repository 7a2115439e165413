"""Relay bookkeeping tables: shard leases (with fencing numbers and the shards' cursors), live
relay members and the cleanup's ticks."""

from __future__ import annotations

import sqlalchemy as sa

from ledgerbox._core.identifiers import outbox_table_name, sql_identifier
from ledgerbox.outbox._types import PgSnapshot, Xid8

__all__ = ["RelayTables"]

_TZ = sa.DateTime(timezone=True)


class RelayTables:
    """The relay's lease, member and tick tables, named after the outbox table they serve.

    ``<outbox>_relay_lease``: one row per shard; ``owner`` holds it until ``expires_at``;
    ``fence`` grows by one at every change of owner (a fencing number: writes made under an
    older fence are refused). It also keeps the shard's cursor (``lo``, ``hi``,
    ``after_id``: how far the shard is published, docs/relay.md, "Read design"), written
    once per batch under the fence, with what the restore guard compares: the cluster's
    ``sysid`` (``pg_control_system().system_identifier``), ``persisted_at`` and the
    transaction counter ``seen_xmax`` at that persist; ``refused`` (and ``refused_at``)
    names why the relay refuses the shard, until ``ledgerbox relay rebase``.
    The migration sets ``fillfactor = 50`` (SQLAlchemy has no table storage parameters): the
    per-batch update stays HOT.
    ``<outbox>_relay_member``: one row per live relay, refreshed by its heartbeat; used to
    split shards fairly and to elect the maintenance leader.
    ``<outbox>_relay_tick``: ``(taken_at, horizon)`` samples of the oldest running
    transaction, from which cleanup finds rows older than the retention by index.

    Raises
    ------
    ledgerbox.ConfigurationError
        If a name is not a valid SQL identifier.
    """

    def __init__(
        self,
        outbox_table: str = "outbox",
        *,
        schema: str | None = None,
        metadata: sa.MetaData | None = None,
    ) -> None:
        base = outbox_table_name(outbox_table)
        self.schema = None if schema is None else sql_identifier(schema, "schema")
        self.metadata = metadata if metadata is not None else sa.MetaData()
        self.lease = sa.Table(
            sql_identifier(f"{base}_relay_lease", "lease table name"),
            self.metadata,
            sa.Column("shard", sa.SmallInteger, primary_key=True, autoincrement=False),
            sa.Column("owner", sa.Text, nullable=True),
            sa.Column("fence", sa.BigInteger, nullable=False, server_default=sa.text("0")),
            sa.Column("expires_at", _TZ, nullable=True),
            sa.Column("lo", PgSnapshot(), nullable=True),
            sa.Column("hi", PgSnapshot(), nullable=True),
            sa.Column("after_id", sa.BigInteger, nullable=False, server_default=sa.text("0")),
            sa.Column("persisted_at", _TZ, nullable=True),
            sa.Column("seen_xmax", Xid8(), nullable=True),
            sa.Column("sysid", sa.BigInteger, nullable=True),
            sa.Column("refused", sa.Text, nullable=True),
            sa.Column("refused_at", _TZ, nullable=True),
            schema=self.schema,
        )
        self.member = sa.Table(
            sql_identifier(f"{base}_relay_member", "member table name"),
            self.metadata,
            sa.Column("relay_id", sa.Text, primary_key=True),
            sa.Column("started_at", _TZ, nullable=False, server_default=sa.func.now()),
            sa.Column("expires_at", _TZ, nullable=False),
            schema=self.schema,
        )
        self.tick = sa.Table(
            sql_identifier(f"{base}_relay_tick", "tick table name"),
            self.metadata,
            sa.Column("taken_at", _TZ, primary_key=True),
            sa.Column("horizon", Xid8(), nullable=False),
            schema=self.schema,
        )
