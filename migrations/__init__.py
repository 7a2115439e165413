"""Alembic migrations of the ledgerbox tables (outbox, inbox, relay leases).

Stand-alone: ``ledgerbox migrate`` or :func:`upgrade_database`. The version table is
``ledgerbox_alembic_version`` so it never collides with your own Alembic history. From your own
Alembic environment, call the helpers in :mod:`migrations.ops` inside your revisions instead.
"""

from __future__ import annotations

if __name__ != "ledgerbox.migrations":  # the repository folder is importable from its root too
    raise ImportError(
        f"import ledgerbox.migrations, not {__name__} (one import package: ledgerbox)"
    )

from pathlib import Path

from alembic import command
from alembic.config import Config

from ledgerbox.migrations._names import Names, target_metadata

__all__ = ["VERSION_TABLE", "Names", "alembic_config", "target_metadata", "upgrade_database"]

VERSION_TABLE = "ledgerbox_alembic_version"
_HERE = Path(__file__).resolve().parent


def alembic_config(url: str, names: Names | None = None) -> Config:
    """An Alembic ``Config`` for these migrations against the SQLAlchemy ``url``."""
    config = Config()
    config.set_main_option("script_location", str(_HERE))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["ledgerbox_names"] = names or Names()
    return config


def upgrade_database(url: str, names: Names | None = None, revision: str = "head") -> None:
    """Migrate the database at ``url`` (a SQLAlchemy URL) to ``revision``.

    Idempotent: already-applied revisions are skipped. Runs in one transaction per revision.
    """
    command.upgrade(alembic_config(url, names), revision)
