"""The operator tables: the audit trail of operator actions and the state of dead-letter
records an operator replayed or discarded (Kafka cannot change a record)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from ledgerbox._core.identifiers import sql_identifier

__all__ = ["AUDIT_TABLE", "DLQ_ACTION_TABLE", "OpsTables"]

#: One row per operator action (dry runs too): who, when, what.
AUDIT_TABLE = "ledgerbox_ops_audit"
#: One row per dead-letter record an operator replayed or discarded.
DLQ_ACTION_TABLE = "ledgerbox_dlq_action"

_TZ = sa.DateTime(timezone=True)


class OpsTables:
    """``ledgerbox_ops_audit`` and ``ledgerbox_dlq_action`` in ``schema``.

    ``ledgerbox_ops_audit``: ``id``, ``at`` (database clock), ``actor``, ``action``
    (``relay.dead.replay``, ...), ``dry_run``, ``filters`` and ``ids`` (JSON), ``changed``
    (rows changed). ``ledgerbox_dlq_action``: per dead-letter record (``dlq_topic``,
    ``partition``, ``offset``), the ``consumer_group`` it belongs to, its ``state``
    (``replayed`` or ``discarded``), the ``audit_id`` of the action and when.

    Raises
    ------
    ledgerbox.ConfigurationError
        If ``schema`` is not a valid SQL identifier.
    """

    def __init__(self, *, schema: str | None = None, metadata: sa.MetaData | None = None) -> None:
        self.schema = None if schema is None else sql_identifier(schema, "schema")
        self.metadata = metadata if metadata is not None else sa.MetaData()
        self.audit = sa.Table(
            AUDIT_TABLE,
            self.metadata,
            sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
            sa.Column("at", _TZ, nullable=False, server_default=sa.func.now()),
            sa.Column("actor", sa.Text, nullable=False),
            sa.Column("action", sa.Text, nullable=False),
            sa.Column("dry_run", sa.Boolean, nullable=False),
            sa.Column("filters", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
            sa.Column("ids", pg.JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
            sa.Column("changed", sa.Integer, nullable=False, server_default=sa.text("0")),
            sa.Index(f"ix_{AUDIT_TABLE}_at", "at"),
            schema=self.schema,
        )
        self.dlq_action = sa.Table(
            DLQ_ACTION_TABLE,
            self.metadata,
            sa.Column("dlq_topic", sa.Text, primary_key=True),
            sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("offset", sa.BigInteger, primary_key=True, autoincrement=False),
            sa.Column("consumer_group", sa.Text, nullable=True),
            sa.Column("state", sa.Text, nullable=False),
            sa.Column("audit_id", sa.BigInteger, nullable=False),
            sa.Column("at", _TZ, nullable=False, server_default=sa.func.now()),
            schema=self.schema,
        )
