"""The operator tables: the audit trail of operator actions (``ledgerbox_ops_audit``) and the
dead-letter records replayed or discarded (``ledgerbox_dlq_action``). New tables only:
online, no daemon needs to stop (docs/migrations.md, "Revision 3").

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from alembic import context, op

from ledgerbox.migrations import ops
from ledgerbox.migrations._names import Names

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _names() -> Names:
    names: Names = context.config.attributes["ledgerbox_names"]
    return names


def upgrade() -> None:
    ops.create_ops_v3(op, _names().schema)


def downgrade() -> None:
    ops.drop_ops_v3(op, _names().schema)
