"""The inbox table: one row per (consumer group, event id) whose effect committed or failed."""

from __future__ import annotations

import enum

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from ledgerbox._core.identifiers import inbox_table_name, sql_identifier

__all__ = ["InboxStatus", "InboxTable"]


class InboxStatus(enum.IntEnum):
    """State of an inbox row (transitions: :func:`ledgerbox.inbox._policy.check_transition`).

    DONE: the handler's effect committed with the row; final. DEAD_LETTERED: the record went
    to the dead-letter topic (its effect never committed); final for redeliveries and copies
    of the event (docs/inbox.md, "A dead-lettered event is final"). REPLAY_REQUESTED: an
    operator asked for the dead-lettered event to run again
    (:meth:`ledgerbox.inbox._store.InboxStore.request_replay`); the next delivery of the
    event takes the row over and runs its handler.
    """

    DONE = 1
    DEAD_LETTERED = 2
    REPLAY_REQUESTED = 3


class InboxTable:
    """The inbox table definition.

    Parameters
    ----------
    name : str
        Table name, a lower-case SQL identifier (default ``"inbox"``).
    schema : str | None
        Schema, or ``None`` for the search path.
    metadata : sqlalchemy.MetaData | None
        Metadata to attach to; a private one when ``None``.

    Raises
    ------
    ledgerbox.ConfigurationError
        If a name is not a valid SQL identifier.
    """

    def __init__(
        self, name: str = "inbox", *, schema: str | None = None, metadata: sa.MetaData | None = None
    ) -> None:
        self.name = inbox_table_name(name)
        self.schema = None if schema is None else sql_identifier(schema, "schema")
        self.metadata = metadata if metadata is not None else sa.MetaData()
        self.table = sa.Table(
            self.name,
            self.metadata,
            sa.Column("consumer_group", sa.Text, primary_key=True),
            sa.Column("event_id", pg.UUID(as_uuid=True), primary_key=True),
            sa.Column("status", sa.SmallInteger, nullable=False),
            sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("1")),
            sa.Column("event_type", sa.Text, nullable=True),
            sa.Column(
                "first_seen_at",
                sa.DateTime(timezone=True),
                nullable=False,
                server_default=sa.func.now(),
            ),
            sa.Column(
                "last_seen_at",
                sa.DateTime(timezone=True),
                nullable=False,
                server_default=sa.func.now(),
            ),
            sa.Column("topic", sa.Text, nullable=True),
            sa.Column("partition", sa.Integer, nullable=True),
            sa.Column("offset", sa.BigInteger, nullable=True),
            sa.Column("last_error", sa.Text, nullable=True),
            # Retention purge walks rows by age.
            sa.Index(f"ix_{self.name}_first_seen_at", "first_seen_at"),
            schema=self.schema,
        )

    @property
    def qualified_name(self) -> str:
        """``schema.name`` or ``name``; both parts are validated identifiers."""
        return f"{self.schema}.{self.name}" if self.schema else self.name
