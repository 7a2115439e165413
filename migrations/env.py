"""Alembic environment for the ledgerbox tables (sync engine; psycopg 3)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from ledgerbox._core.database_url import connect_args, sqlalchemy_url
from ledgerbox._core.identifiers import sql_identifier
from ledgerbox.migrations import VERSION_TABLE
from ledgerbox.migrations._names import Names, target_metadata

config = context.config
names = Names.resolve(context.get_x_argument(as_dictionary=True), config.attributes)
config.attributes["ledgerbox_names"] = names


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is None:
        url = config.get_main_option("sqlalchemy.url")
        assert url, "set sqlalchemy.url (alembic.ini or migrations.alembic_config)"
        connectable = sa.create_engine(
            sqlalchemy_url(url), poolclass=sa.pool.NullPool, connect_args=connect_args(url)
        )
    with (
        connectable.connect()
        if isinstance(connectable, sa.Engine)
        else _nullctx(connectable) as connection
    ):
        if names.schema:
            # The version table lives in the schema, so the schema must exist before Alembic
            # looks for it; the name is a validated identifier.
            connection.execute(
                sa.text(f"CREATE SCHEMA IF NOT EXISTS {sql_identifier(names.schema, 'schema')}")
            )
            connection.commit()
        context.configure(
            connection=connection,
            target_metadata=target_metadata(names),
            version_table=VERSION_TABLE,
            version_table_schema=names.schema,
            include_schemas=names.schema is not None,
            transaction_per_migration=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()


class _nullctx:
    def __init__(self, conn: sa.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sa.Connection:
        return self.conn

    def __exit__(self, *exc: object) -> None:
        return None


if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata(names),
        version_table=VERSION_TABLE,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
