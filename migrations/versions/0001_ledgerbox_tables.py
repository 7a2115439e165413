"""ledgerbox tables: outbox (+ NOTIFY trigger), inbox, relay leases and members.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from alembic import context, op

from ledgerbox.migrations import ops
from ledgerbox.migrations._names import Names

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _names() -> Names:
    names: Names = context.config.attributes["ledgerbox_names"]
    return names


def upgrade() -> None:
    names = _names()
    if names.schema:
        op.execute(f"CREATE SCHEMA IF NOT EXISTS {names.schema}")
    ops.create_outbox_v1(op, names.outbox_table, names.schema)
    ops.create_inbox_v1(op, names.inbox_table, names.schema)
    ops.create_relay_v1(op, names.outbox_table, names.schema)


def downgrade() -> None:
    names = _names()
    ops.drop_relay_v1(op, names.outbox_table, names.schema)
    ops.drop_inbox_v1(op, names.inbox_table, names.schema)
    ops.drop_outbox_v1(op, names.outbox_table, names.schema)
