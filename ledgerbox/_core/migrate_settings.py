"""The settings of ``ledgerbox migrate``, shared by the command (``ledgerbox.cli``) and the
Alembic environment (``ledgerbox.migrations``: ``Names.resolve`` reads the same variables).

Light on purpose (no SQLAlchemy, no Alembic): ``ledgerbox.cli`` builds the command's options
from it when it starts, also for ``ledgerbox relay``. The variables were ``LEDGERBOX_SCHEMA``,
``LEDGERBOX_OUTBOX_TABLE`` and ``LEDGERBOX_INBOX_TABLE``; they work for one release, with a
warning (docs/configuration.md).
"""

from __future__ import annotations

from ledgerbox._core.settings import CommandSettings, Setting

__all__ = ["MIGRATE_SETTINGS", "NAME_SETTINGS"]

#: Every setting of ``ledgerbox migrate``.
MIGRATE_SETTINGS = CommandSettings(
    "migrate",
    [
        Setting(
            "database_url",
            str,
            required=True,
            help="SQLAlchemy URL (postgresql+psycopg://...)",
            well_known=("DATABASE_URL",),
            secret=True,
            label="database URL",
        ),
        Setting(
            "schema",
            str,
            help="Schema of the tables (unset: the search path); a SQL identifier",
            old_env=("LEDGERBOX_SCHEMA",),
        ),
        Setting(
            "outbox_table",
            str,
            default="outbox",
            help="The outbox table (its relay tables are named after it); a SQL identifier",
            old_env=("LEDGERBOX_OUTBOX_TABLE",),
        ),
        Setting(
            "inbox_table",
            str,
            default="inbox",
            help="The inbox table; a SQL identifier",
            old_env=("LEDGERBOX_INBOX_TABLE",),
        ),
        Setting("revision", str, default="head", help="Target Alembic revision"),
    ],
)

#: The settings that name the tables (what ``migrations.Names`` holds).
NAME_SETTINGS = ("schema", "outbox_table", "inbox_table")
