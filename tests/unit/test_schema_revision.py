"""The schema revision the daemons check at start equals the head of the migrations."""

from __future__ import annotations

from alembic.script import ScriptDirectory

from ledgerbox import migrations
from ledgerbox._core.names import SCHEMA_REVISION, SCHEMA_REVISIONS


def test_the_daemons_schema_revision_is_the_alembic_head() -> None:
    script = ScriptDirectory.from_config(migrations.alembic_config("postgresql://unused/x"))
    assert script.get_heads() == [SCHEMA_REVISION]
    in_order = [rev.revision for rev in reversed(list(script.walk_revisions()))]
    assert tuple(in_order) == SCHEMA_REVISIONS
