"""Alembic migrations of the ledgerbox tables (outbox, inbox, relay leases).

Two ways to own them (docs/migrations.md):

* stand-alone: ``ledgerbox migrate`` or :func:`upgrade_database`, with the version table
  ``ledgerbox_alembic_version`` so it never collides with your own Alembic history;
* embedded: your own Alembic environment calls the frozen, versioned functions of
  :mod:`ledgerbox.migrations.ops` from your revisions (one function per ledgerbox schema
  revision), and :func:`include_tables` puts the models on your metadata so autogenerate
  neither misses them nor proposes to drop them.

Mixing the two on one database is refused with a message that says what to do
(:class:`MigrationError`), never with a half-applied DDL statement.
"""

from __future__ import annotations

if __name__ != "ledgerbox.migrations":  # the repository folder is importable from its root too
    raise ImportError(
        f"import ledgerbox.migrations, not {__name__} (one import package: ledgerbox)"
    )

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from ledgerbox._core.database_url import connect_args, sqlalchemy_url
from ledgerbox._core.errors import ConfigurationError, LedgerboxError
from ledgerbox._core.names import SCHEMA_VERSION_TABLE
from ledgerbox.migrations._names import Names, include_tables, target_metadata

__all__ = [
    "VERSION_TABLE",
    "MigrationError",
    "Names",
    "alembic_config",
    "include_tables",
    "target_metadata",
    "upgrade_database",
]

VERSION_TABLE = SCHEMA_VERSION_TABLE
_HERE = Path(__file__).resolve().parent


def alembic_config(url: str, names: Names | None = None) -> Config:
    """An Alembic ``Config`` for these migrations against the SQLAlchemy ``url``."""
    config = Config()
    config.set_main_option("script_location", str(_HERE))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["ledgerbox_names"] = names or Names()
    return config


def _revisions() -> list[str]:
    """The ledgerbox schema revisions, oldest first (``["0001", "0002", "0003"]``)."""
    from alembic.script import ScriptDirectory

    return [s.revision for s in ScriptDirectory(str(_HERE)).walk_revisions()][::-1]


def _check_revision(revision: str) -> None:
    """Refuse a target that names no ledgerbox schema revision, before any connection.
    ``head``, ``heads``, ``base`` and the revisions of :func:`_revisions` are targets; a
    relative one (``+1``, ``head-1``) is left to Alembic, which says whether it resolves
    (``ledgerbox migrate`` calls it; not public API).

    Raises
    ------
    ledgerbox.ConfigurationError
        ``setting="revision"``: one line listing the revisions.
    """
    if "+" in revision or "-" in revision:
        return
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    try:
        ScriptDirectory(str(_HERE)).get_revisions(revision)
        return
    except (CommandError, AssertionError, ValueError, KeyError):
        pass
    raise ConfigurationError(
        f"revision {revision!r} is not a ledgerbox schema revision: give head or one of "
        f"{', '.join(_revisions())}",
        setting="revision",
    )


class MigrationError(LedgerboxError):
    """The ledgerbox tables cannot be migrated stand-alone as asked; the message says why
    and what to do (e.g. they were created by your own Alembic environment)."""

    __module__ = "ledgerbox.migrations"


def upgrade_database(url: str, names: Names | None = None, revision: str = "head") -> None:
    """Migrate the database at ``url`` (a SQLAlchemy URL) to ``revision``.

    Idempotent: already-applied revisions are skipped. Runs in one transaction per revision.

    Raises
    ------
    MigrationError
        Some ledgerbox tables exist but ``ledgerbox_alembic_version`` does not: they belong
        to your own Alembic environment (docs/migrations.md, "Embedded").
    """
    names = names or Names()
    url = sqlalchemy_url(url)  # psycopg 3 whatever driver the URL names (postgresql://)
    _refuse_foreign_tables(url, names)
    command.upgrade(alembic_config(url, names), revision)


def _current_revision(url: str, names: Names | None = None) -> str | None:
    """The ledgerbox schema revision the database at ``url`` is at (its
    ``ledgerbox_alembic_version`` row), ``None`` before the first migration (``ledgerbox
    migrate`` calls it; not public API)."""
    from alembic.runtime.migration import MigrationContext

    names = names or Names()
    url = sqlalchemy_url(url)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool, connect_args=connect_args(url))
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"version_table": VERSION_TABLE, "version_table_schema": names.schema}
            )
            return context.get_current_revision()
    finally:
        engine.dispose()


def _refuse_foreign_tables(url: str, names: Names) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool, connect_args=connect_args(url))
    try:  # an unreachable database raises here, once (not again in Alembic's connect)
        with engine.connect() as conn:
            found = set(sa.inspect(conn).get_table_names(schema=names.schema))
    finally:
        engine.dispose()
    ours = [t.name for t in target_metadata(names).sorted_tables if t.name in found]
    if ours and VERSION_TABLE not in found:
        where = f"schema {names.schema}" if names.schema else "the search path"
        raise MigrationError(
            f"tables {', '.join(sorted(ours))} already exist in {where} but "
            f"{VERSION_TABLE} does not: your own Alembic environment created them with "
            "ledgerbox.migrations.ops; keep upgrading them there with the ops of each new "
            "ledgerbox schema revision (docs/migrations.md, 'Embedded')"
        )
