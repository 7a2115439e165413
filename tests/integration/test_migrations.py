"""Migrations vs models: after ``upgrade head`` Alembic's autogenerate finds no difference."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.engine import Engine

from ledgerbox import migrations


def _diff(engine: Engine, names: migrations.Names) -> list[object]:
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn,
            opts={
                "compare_type": True,
                "compare_server_default": True,
                "include_schemas": names.schema is not None,
                "include_name": lambda name, type_, parent: (
                    type_ != "schema" or name == names.schema
                ),
                "version_table": migrations.VERSION_TABLE,
                "version_table_schema": names.schema,
            },
        )
        return list(compare_metadata(context, migrations.target_metadata(names)))


def test_head_matches_the_models(engine: Engine) -> None:
    # The module database was created from the template migrated to head.
    assert _diff(engine, migrations.Names()) == []


def test_custom_names_downgrade_and_upgrade_again(engine: Engine, database_url: str) -> None:
    names = migrations.Names(schema="svc", outbox_table="svc_outbox", inbox_table="svc_inbox")
    config = migrations.alembic_config(database_url, names)
    command.upgrade(config, "head")
    assert _diff(engine, names) == []
    command.downgrade(config, "base")
    with engine.connect() as conn:
        tables = set(sa.inspect(conn).get_table_names(schema="svc"))
    assert tables <= {migrations.VERSION_TABLE}
    command.upgrade(config, "head")
    assert _diff(engine, names) == []
