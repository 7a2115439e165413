"""Frozen DDL steps of the ledgerbox schema, callable from any Alembic revision.

Use them from your own Alembic environment::

    from ledgerbox.migrations import ops
    def upgrade():
        ops.create_outbox_v1(op, table="outbox", schema=None)

Each function is the schema as of that version and never changes; later versions add new
functions. Names are validated as SQL identifiers before they reach any DDL.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from ledgerbox._core.identifiers import sql_identifier
from ledgerbox.outbox._table import OutboxTable

__all__ = [
    "create_inbox_v1",
    "create_outbox_v1",
    "create_relay_v1",
    "drop_inbox_v1",
    "drop_outbox_v1",
    "drop_relay_v1",
]

_TZ = sa.DateTime(timezone=True)


def create_outbox_v1(op: Any, table: str = "outbox", schema: str | None = None) -> None:
    """Create the outbox table, its indexes and its NOTIFY trigger."""
    name = sql_identifier(table, "outbox table name")
    op.create_table(
        name,
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
        sa.Column("event_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("idempotency_key", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition_key", sa.Text, nullable=False),
        sa.Column("shard", sa.SmallInteger, nullable=False),
        sa.Column("event_type", sa.Text, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("aggregate_type", sa.Text, nullable=False),
        sa.Column("aggregate_id", sa.Text, nullable=False),
        sa.Column("aggregate_version", sa.BigInteger, nullable=True),
        sa.Column("payload", pg.JSONB, nullable=False),
        sa.Column("headers", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("occurred_at", _TZ, nullable=False),
        sa.Column("created_at", _TZ, nullable=False, server_default=sa.func.now()),
        sa.Column("status", sa.SmallInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("published_at", _TZ, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.UniqueConstraint("event_id", name=f"uq_{name}_event_id"),
        sa.UniqueConstraint("idempotency_key", name=f"uq_{name}_idempotency_key"),
        schema=schema,
    )
    op.create_index(
        f"ix_{name}_pending",
        name,
        ["shard", "id"],
        schema=schema,
        postgresql_where=sa.text("status = 0"),
    )
    op.create_index(
        f"ix_{name}_dead",
        name,
        ["partition_key", "id"],
        schema=schema,
        postgresql_where=sa.text("status = 2"),
    )
    op.create_index(
        f"ix_{name}_published_at",
        name,
        ["published_at"],
        schema=schema,
        postgresql_where=sa.text("status = 1"),
    )
    for statement in OutboxTable(name, schema=schema).notify_ddl():
        op.execute(statement)


def drop_outbox_v1(op: Any, table: str = "outbox", schema: str | None = None) -> None:
    """Drop what :func:`create_outbox_v1` created."""
    name = sql_identifier(table, "outbox table name")
    for statement in OutboxTable(name, schema=schema).drop_notify_ddl():
        op.execute(statement)
    op.drop_table(name, schema=schema)


def create_inbox_v1(op: Any, table: str = "inbox", schema: str | None = None) -> None:
    """Create the inbox table."""
    name = sql_identifier(table, "inbox table name")
    op.create_table(
        name,
        sa.Column("consumer_group", sa.Text, primary_key=True),
        sa.Column("event_id", pg.UUID(as_uuid=True), primary_key=True),
        sa.Column("status", sa.SmallInteger, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("1")),
        sa.Column("event_type", sa.Text, nullable=True),
        sa.Column("first_seen_at", _TZ, nullable=False, server_default=sa.func.now()),
        sa.Column("last_seen_at", _TZ, nullable=False, server_default=sa.func.now()),
        sa.Column("topic", sa.Text, nullable=True),
        sa.Column("partition", sa.Integer, nullable=True),
        sa.Column("offset", sa.BigInteger, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        schema=schema,
    )
    op.create_index(f"ix_{name}_first_seen_at", name, ["first_seen_at"], schema=schema)


def drop_inbox_v1(op: Any, table: str = "inbox", schema: str | None = None) -> None:
    """Drop what :func:`create_inbox_v1` created."""
    op.drop_table(sql_identifier(table, "inbox table name"), schema=schema)


def create_relay_v1(op: Any, outbox_table: str = "outbox", schema: str | None = None) -> None:
    """Create the relay's shard-lease and member tables."""
    base = sql_identifier(outbox_table, "outbox table name")
    op.create_table(
        f"{base}_relay_lease",
        sa.Column("shard", sa.SmallInteger, primary_key=True, autoincrement=False),
        sa.Column("owner", sa.Text, nullable=True),
        sa.Column("fence", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("expires_at", _TZ, nullable=True),
        schema=schema,
    )
    op.create_table(
        f"{base}_relay_member",
        sa.Column("relay_id", sa.Text, primary_key=True),
        sa.Column("started_at", _TZ, nullable=False, server_default=sa.func.now()),
        sa.Column("expires_at", _TZ, nullable=False),
        schema=schema,
    )


def drop_relay_v1(op: Any, outbox_table: str = "outbox", schema: str | None = None) -> None:
    """Drop what :func:`create_relay_v1` created."""
    base = sql_identifier(outbox_table, "outbox table name")
    op.drop_table(f"{base}_relay_member", schema=schema)
    op.drop_table(f"{base}_relay_lease", schema=schema)
