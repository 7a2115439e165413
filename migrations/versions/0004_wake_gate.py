"""The wake gate: the outbox trigger sends its NOTIFY only while a relay waits for one.

One ``CREATE OR REPLACE FUNCTION`` of the trigger function: online, no daemon needs to stop.
Relays of ledgerbox before revision 4 hold no gate: against this revision they publish on
their poll (``poll_interval_s``, default 1 s) instead of at once, so deploy the new relays
first (they work against revision 3, where every transaction notifies) and migrate after
(docs/migrations.md, "Revision 4").

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04
"""

from alembic import context, op

from ledgerbox.migrations import ops
from ledgerbox.migrations._names import Names

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _names() -> Names:
    names: Names = context.config.attributes["ledgerbox_names"]
    return names


def upgrade() -> None:
    names = _names()
    ops.upgrade_outbox_v3_to_v4(op, names.outbox_table, names.schema)


def downgrade() -> None:
    names = _names()
    ops.downgrade_outbox_v4_to_v3(op, names.outbox_table, names.schema)
