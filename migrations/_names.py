"""Which schema and table names the migrations create, and the matching model metadata."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import sqlalchemy as sa

from ledgerbox._core.migrate_settings import MIGRATE_SETTINGS, NAME_SETTINGS
from ledgerbox.admin._table import OpsTables
from ledgerbox.inbox._table import InboxTable
from ledgerbox.outbox._table import OutboxTable
from ledgerbox.relay._table import RelayTables

__all__ = ["Names", "include_tables", "target_metadata"]


@dataclass(frozen=True)
class Names:
    """Names of the ledgerbox tables. Each is validated as a SQL identifier when used.

    Read, in order of precedence, from Alembic ``-x`` arguments (``-x schema=app``,
    ``-x outbox_table=...``, ``-x inbox_table=...``), ``Config.attributes`` (key
    ``"ledgerbox_names"``), then the environment as ``ledgerbox migrate`` reads it
    (``LEDGERBOX_MIGRATE_SCHEMA``, ``LEDGERBOX_MIGRATE_OUTBOX_TABLE``,
    ``LEDGERBOX_MIGRATE_INBOX_TABLE``; the former ``LEDGERBOX_SCHEMA``, ... with a warning).
    """

    schema: str | None = None
    outbox_table: str = "outbox"
    inbox_table: str = "inbox"

    @classmethod
    def resolve(cls, x_args: Mapping[str, str], attributes: Mapping[str, object]) -> Names:
        given = attributes.get("ledgerbox_names")
        if isinstance(given, Names):
            base = given
        else:
            base = cls(**MIGRATE_SETTINGS.resolve(NAME_SETTINGS, {}))
        return cls(
            schema=x_args.get("schema", base.schema) or None,
            outbox_table=x_args.get("outbox_table", base.outbox_table),
            inbox_table=x_args.get("inbox_table", base.inbox_table),
        )


def include_tables(
    metadata: sa.MetaData, names: Names | None = None
) -> tuple[OutboxTable, InboxTable, RelayTables]:
    """Add every ledgerbox table (outbox, inbox, the relay's lease and member tables, the
    operator tables ``ledgerbox_ops_audit`` and ``ledgerbox_dlq_action``) to
    your own ``metadata``, e.g. ``Base.metadata`` in your Alembic ``env.py``, so that
    autogenerate sees them: with only ``OutboxTable(metadata=...)`` it proposes to DROP the
    inbox and relay tables. Returns the three table objects (use the first as the writer's
    ``table=``)."""
    names = names or Names()
    OpsTables(schema=names.schema, metadata=metadata)
    return (
        OutboxTable(names.outbox_table, schema=names.schema, metadata=metadata),
        InboxTable(names.inbox_table, schema=names.schema, metadata=metadata),
        RelayTables(names.outbox_table, schema=names.schema, metadata=metadata),
    )


def target_metadata(names: Names) -> sa.MetaData:
    """Model metadata of every ledgerbox table under ``names`` (for autogenerate checks)."""
    metadata = sa.MetaData()
    include_tables(metadata, names)
    return metadata
