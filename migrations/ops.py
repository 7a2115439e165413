"""Frozen DDL steps of the ledgerbox schema, callable from any Alembic revision.

Use them from your own Alembic environment::

    from ledgerbox.migrations import ops
    def upgrade():
        ops.create_outbox_v1(op, table="outbox", schema=None)
        ops.create_inbox_v1(op, table="inbox", schema=None)
        ops.create_relay_v1(op, outbox_table="outbox", schema=None)
        ops.upgrade_outbox_v1_to_v2(op, table="outbox", schema=None)
        ops.upgrade_relay_v1_to_v2(op, outbox_table="outbox", schema=None)
        ops.create_ops_v3(op, schema=None)
        ops.upgrade_outbox_v3_to_v4(op, table="outbox", schema=None)

Each function is one step of the schema's history and never changes; later versions add new
functions (``create_*_v1`` for revision 1, ``upgrade_*_v1_to_v2`` / ``downgrade_*_v2_to_v1``
for revision 2, ``create_ops_v3`` / ``drop_ops_v3`` for revision 3,
``upgrade_outbox_v3_to_v4`` / ``downgrade_outbox_v4_to_v3`` for revision 4: docs/migrations.md).
Names are validated as SQL identifiers before they reach any DDL.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from ledgerbox._core.identifiers import inbox_table_name, outbox_table_name, sql_identifier
from ledgerbox.outbox._table import OutboxTable
from ledgerbox.outbox._types import PgSnapshot, Xid8

__all__ = [
    "create_inbox_v1",
    "create_ops_v3",
    "create_outbox_v1",
    "create_relay_v1",
    "downgrade_outbox_v2_to_v1",
    "downgrade_outbox_v4_to_v3",
    "downgrade_relay_v2_to_v1",
    "drop_inbox_v1",
    "drop_ops_v3",
    "drop_outbox_v1",
    "drop_relay_v1",
    "upgrade_outbox_v1_to_v2",
    "upgrade_outbox_v3_to_v4",
    "upgrade_relay_v1_to_v2",
]

_TZ = sa.DateTime(timezone=True)


def create_outbox_v1(op: Any, table: str = "outbox", schema: str | None = None) -> None:
    """Create the outbox table, its indexes and its NOTIFY trigger."""
    name = outbox_table_name(table)
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
    for statement in OutboxTable(name, schema=schema).notify_ddl(gated=False):
        op.execute(statement)


def drop_outbox_v1(op: Any, table: str = "outbox", schema: str | None = None) -> None:
    """Drop what :func:`create_outbox_v1` created."""
    name = outbox_table_name(table)
    for statement in OutboxTable(name, schema=schema).drop_notify_ddl():
        op.execute(statement)
    op.drop_table(name, schema=schema)


def create_inbox_v1(op: Any, table: str = "inbox", schema: str | None = None) -> None:
    """Create the inbox table."""
    name = inbox_table_name(table)
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
    op.drop_table(inbox_table_name(table), schema=schema)


def create_relay_v1(op: Any, outbox_table: str = "outbox", schema: str | None = None) -> None:
    """Create the relay's shard-lease and member tables."""
    base = outbox_table_name(outbox_table)
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
    base = outbox_table_name(outbox_table)
    op.drop_table(f"{base}_relay_member", schema=schema)
    op.drop_table(f"{base}_relay_lease", schema=schema)


# -- revision 2: the relay reads through a snapshot cursor (docs/relay.md, "Read design") ----


def upgrade_outbox_v1_to_v2(op: Any, table: str = "outbox", schema: str | None = None) -> None:
    """Stamp every row with its writer's transaction id and swap the relay's indexes; online.

    ``ADD COLUMN txid xid8 NOT NULL DEFAULT pg_current_xact_id()`` is a fast default (the
    function is STABLE: no table rewrite; existing rows all read the migration's id, which
    the relay's first range covers). The new indexes are built and the v1-only ones
    dropped ``CONCURRENTLY``, outside the migration's transaction (``autocommit_block``), so
    producers keep writing: ``(shard, txid, id)`` replaces ``ix_<table>_pending`` (which
    would now index every row) and ``ix_<table>_published_at`` (v2 writes no
    ``published_at``); ``(partition_key, id) WHERE status IN (2, 3)`` replaces the dead-only
    index. Stop the v1 relays before, start the v2 relays after (docs/migrations.md). If a
    concurrent build fails it leaves an INVALID index: drop it and run the migration again.
    """
    name = outbox_table_name(table)
    op.add_column(
        name,
        sa.Column("txid", Xid8(), nullable=False, server_default=sa.text("pg_current_xact_id()")),
        schema=schema,
    )
    with op.get_context().autocommit_block():
        op.create_index(
            f"ix_{name}_shard_txid",
            name,
            ["shard", "txid", "id"],
            schema=schema,
            postgresql_concurrently=True,
            if_not_exists=True,
        )
        op.create_index(
            f"ix_{name}_held",
            name,
            ["partition_key", "id"],
            schema=schema,
            postgresql_where=sa.text("status IN (2, 3)"),
            postgresql_concurrently=True,
            if_not_exists=True,
        )
        for old in ("pending", "dead", "published_at"):
            op.drop_index(
                f"ix_{name}_{old}",
                table_name=name,
                schema=schema,
                postgresql_concurrently=True,
                if_exists=True,
            )


def downgrade_outbox_v2_to_v1(op: Any, table: str = "outbox", schema: str | None = None) -> None:
    """Back to status marking: rows the relay's cursors passed become ``status = 1``, held
    rows pending again (v1's claim skips them), discarded ones ``status = 1``; the v1
    indexes come back and ``txid`` goes. Run before :func:`downgrade_relay_v2_to_v1` (it
    reads the cursors), with the relays stopped."""
    name = outbox_table_name(table)
    qualified = f"{schema}.{name}" if schema else name
    lease = f"{qualified}_relay_lease"
    op.execute(
        f"UPDATE {qualified} AS o SET status = 1, published_at = coalesce(o.published_at, now())"  # noqa: S608
        f" FROM {lease} AS l WHERE l.shard = o.shard AND o.status = 0"
        " AND (pg_visible_in_snapshot(o.txid, l.lo)"
        " OR (pg_visible_in_snapshot(o.txid, l.hi) AND o.id <= l.after_id))"
    )
    op.execute(f"UPDATE {qualified} SET status = 0 WHERE status = 3")  # noqa: S608
    op.execute(f"UPDATE {qualified} SET status = 1 WHERE status = 4")  # noqa: S608
    with op.get_context().autocommit_block():
        for index, columns, where in (
            (f"ix_{name}_pending", ["shard", "id"], "status = 0"),
            (f"ix_{name}_dead", ["partition_key", "id"], "status = 2"),
            (f"ix_{name}_published_at", ["published_at"], "status = 1"),
        ):
            op.create_index(
                index,
                name,
                columns,
                schema=schema,
                postgresql_where=sa.text(where),
                postgresql_concurrently=True,
                if_not_exists=True,
            )
        for new in ("shard_txid", "held"):
            op.drop_index(
                f"ix_{name}_{new}",
                table_name=name,
                schema=schema,
                postgresql_concurrently=True,
                if_exists=True,
            )
    op.drop_column(name, "txid", schema=schema)


def upgrade_relay_v1_to_v2(
    op: Any, outbox_table: str = "outbox", schema: str | None = None
) -> None:
    """Give each lease row its shard's cursor and the restore guard's columns (all empty:
    a relay's first range of a shard then holds every committed, not yet published row),
    ``fillfactor = 50`` so the per-batch cursor update stays HOT, and the cleanup's tick
    table."""
    base = outbox_table_name(outbox_table)
    lease = f"{base}_relay_lease"
    for column in (
        sa.Column("lo", PgSnapshot(), nullable=True),
        sa.Column("hi", PgSnapshot(), nullable=True),
        sa.Column("after_id", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("persisted_at", _TZ, nullable=True),
        sa.Column("seen_xmax", Xid8(), nullable=True),
        sa.Column("sysid", sa.BigInteger, nullable=True),
        sa.Column("refused", sa.Text, nullable=True),
        sa.Column("refused_at", _TZ, nullable=True),
    ):
        op.add_column(lease, column, schema=schema)
    op.execute(f"ALTER TABLE {f'{schema}.' if schema else ''}{lease} SET (fillfactor = 50)")
    op.create_table(
        f"{base}_relay_tick",
        sa.Column("taken_at", _TZ, primary_key=True),
        sa.Column("horizon", Xid8(), nullable=False),
        schema=schema,
    )


def downgrade_relay_v2_to_v1(
    op: Any, outbox_table: str = "outbox", schema: str | None = None
) -> None:
    """Drop what :func:`upgrade_relay_v1_to_v2` added."""
    base = outbox_table_name(outbox_table)
    lease = f"{base}_relay_lease"
    op.drop_table(f"{base}_relay_tick", schema=schema)
    for column in (
        "refused_at",
        "refused",
        "sysid",
        "seen_xmax",
        "persisted_at",
        "after_id",
        "hi",
        "lo",
    ):
        op.drop_column(lease, column, schema=schema)
    op.execute(f"ALTER TABLE {f'{schema}.' if schema else ''}{lease} RESET (fillfactor)")


def create_ops_v3(op: Any, schema: str | None = None) -> None:
    """Create the operator tables (revision 3): ``ledgerbox_ops_audit`` (one row per
    operator action) and ``ledgerbox_dlq_action`` (dead-letter records replayed or
    discarded); docs/operations.md."""
    schema = None if schema is None else sql_identifier(schema, "schema")
    op.create_table(
        "ledgerbox_ops_audit",
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
        sa.Column("at", _TZ, nullable=False, server_default=sa.func.now()),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("dry_run", sa.Boolean, nullable=False),
        sa.Column("filters", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("ids", pg.JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
        sa.Column("changed", sa.Integer, nullable=False, server_default=sa.text("0")),
        schema=schema,
    )
    op.create_index("ix_ledgerbox_ops_audit_at", "ledgerbox_ops_audit", ["at"], schema=schema)
    op.create_table(
        "ledgerbox_dlq_action",
        sa.Column("dlq_topic", sa.Text, primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("offset", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("consumer_group", sa.Text, nullable=True),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("audit_id", sa.BigInteger, nullable=False),
        sa.Column("at", _TZ, nullable=False, server_default=sa.func.now()),
        schema=schema,
    )


def drop_ops_v3(op: Any, schema: str | None = None) -> None:
    """Drop what :func:`create_ops_v3` created (the audit trail with it)."""
    schema = None if schema is None else sql_identifier(schema, "schema")
    op.drop_table("ledgerbox_dlq_action", schema=schema)
    op.drop_table("ledgerbox_ops_audit", schema=schema)


def upgrade_outbox_v3_to_v4(op: Any, table: str = "outbox", schema: str | None = None) -> None:
    """Revision 4: the outbox trigger function notifies only while a relay waits for a
    notification (the wake gate, docs/relay.md "Wake gate"). One ``CREATE OR REPLACE
    FUNCTION``: online, takes effect for transactions that insert after it commits."""
    name = outbox_table_name(table)
    op.execute(OutboxTable(name, schema=schema).notify_function_ddl(gated=True))


def downgrade_outbox_v4_to_v3(op: Any, table: str = "outbox", schema: str | None = None) -> None:
    """Undo :func:`upgrade_outbox_v3_to_v4`: every transaction that inserts notifies again."""
    name = outbox_table_name(table)
    op.execute(OutboxTable(name, schema=schema).notify_function_ddl(gated=False))
