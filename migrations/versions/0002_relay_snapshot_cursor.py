"""The relay reads through a transaction-snapshot cursor: outbox.txid, the (shard, txid, id)
index, the v1-only indexes dropped, cursor columns in the lease rows, the tick table.

Online: the new column is a fast default and the indexes are built and dropped
CONCURRENTLY (outside the revision's transaction). Stop the v1 relays first and start the
v2 relays after (docs/migrations.md, "Revision 2").

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from alembic import context, op

from ledgerbox.migrations import ops
from ledgerbox.migrations._names import Names

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _names() -> Names:
    names: Names = context.config.attributes["ledgerbox_names"]
    return names


def upgrade() -> None:
    names = _names()
    ops.upgrade_outbox_v1_to_v2(op, names.outbox_table, names.schema)
    ops.upgrade_relay_v1_to_v2(op, names.outbox_table, names.schema)


def downgrade() -> None:
    names = _names()
    ops.downgrade_outbox_v2_to_v1(op, names.outbox_table, names.schema)
    ops.downgrade_relay_v2_to_v1(op, names.outbox_table, names.schema)
