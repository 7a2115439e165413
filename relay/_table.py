"""Relay bookkeeping tables: shard leases (with fencing numbers) and live relay members."""

from __future__ import annotations

import sqlalchemy as sa

from ledgerbox._core.identifiers import sql_identifier

__all__ = ["RelayTables"]


class RelayTables:
    """The relay's lease and member tables, named after the outbox table they serve.

    ``<outbox>_relay_lease``: one row per shard; ``owner`` holds it until ``expires_at``;
    ``fence`` grows by one at every change of owner (a fencing number: writes made under an
    older fence are refused).
    ``<outbox>_relay_member``: one row per live relay, refreshed by its heartbeat; used to
    split shards fairly and to elect the maintenance leader.

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
        base = sql_identifier(outbox_table, "outbox table name")
        self.schema = None if schema is None else sql_identifier(schema, "schema")
        self.metadata = metadata if metadata is not None else sa.MetaData()
        self.lease = sa.Table(
            sql_identifier(f"{base}_relay_lease", "lease table name"),
            self.metadata,
            sa.Column("shard", sa.SmallInteger, primary_key=True, autoincrement=False),
            sa.Column("owner", sa.Text, nullable=True),
            sa.Column("fence", sa.BigInteger, nullable=False, server_default=sa.text("0")),
            sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
            schema=self.schema,
        )
        self.member = sa.Table(
            sql_identifier(f"{base}_relay_member", "member table name"),
            self.metadata,
            sa.Column("relay_id", sa.Text, primary_key=True),
            sa.Column(
                "started_at",
                sa.DateTime(timezone=True),
                nullable=False,
                server_default=sa.func.now(),
            ),
            sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
            schema=self.schema,
        )
