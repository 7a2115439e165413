"""The outbox table: SQLAlchemy Core metadata, its ORM mapping for ``Session.add``, and DDL.

Producers only ever insert; every row is stamped with the id of the transaction that wrote it
(``txid``, a column default), which is all the relay needs to find what committed since its
cursor (docs/relay.md, "Read design"): nothing is written per published row. The relay owns
the columns it writes for the rare rows that leave the normal flow (``status``,
``attempts``, ``last_error``); ``published_at`` is only set on rows published under schema
v1. See ``docs/outbox.md``.
"""

from __future__ import annotations

import enum
import zlib
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.orm import registry

from ledgerbox._core.identifiers import (
    outbox_notify_channel,
    outbox_table_name,
    sql_identifier,
    wake_gate_key,
)
from ledgerbox._core.names import DEFAULT_SHARD_COUNT
from ledgerbox.outbox._types import Xid8

__all__ = ["DEFAULT_SHARD_COUNT", "EventStatus", "OutboxTable", "shard_of"]


class EventStatus(enum.IntEnum):
    """The ``status`` column of an outbox row.

    ``PENDING`` (0) is the normal state: whether such a row is published yet is decided by
    the relay's cursor of its shard, not by the row (schema v2 writes nothing per published
    row; ``relay status`` counts the pending ones). ``PUBLISHED`` (1) marks rows published
    under schema v1. Transitions: PENDING -> DEAD_LETTERED (Kafka refused the record for
    good); PENDING -> HELD (with ``on_dead_letter="hold"``, an earlier event of its key is
    dead-lettered); DEAD_LETTERED -> PENDING (replayed: sent again, then the HELD rows of its
    key, in id order) or -> DISCARDED (given up: the HELD rows of its key go on)."""

    PENDING = 0
    PUBLISHED = 1
    DEAD_LETTERED = 2
    HELD = 3
    DISCARDED = 4


def shard_of(partition_key: str, shard_count: int = DEFAULT_SHARD_COUNT) -> int:
    """Map a partition key to its shard, ``0 <= shard < shard_count``.

    CRC-32 of the UTF-8 key: stable across processes, machines and Python versions (unlike
    ``hash()``), so every writer agrees on the shard of a key.
    """
    return zlib.crc32(partition_key.encode("utf-8")) % shard_count


#: Longest LISTEN/NOTIFY channel, in bytes (PostgreSQL's ``NAMEDATALEN - 1``).
MAX_CHANNEL_CHARS = 63


class _OutboxRow:
    """Base of the per-table mapped classes; rows are created by the writer only."""

    def __init__(self, **values: Any) -> None:
        for key, value in values.items():
            setattr(self, key, value)


class OutboxTable:
    """One outbox table: its name, schema, Core ``Table`` and ORM mapping.

    Parameters
    ----------
    name : str
        Table name, a lower-case SQL identifier (default ``"outbox"``).
    schema : str | None
        Schema, a lower-case SQL identifier, or ``None`` for the connection's search path.
    metadata : sqlalchemy.MetaData | None
        Metadata to attach the table to (e.g. your own ``Base.metadata`` so Alembic's
        autogenerate sees it); a private one when ``None``.
    shard_count : int
        Number of relay shards (default 64). Must never change once rows exist.

    Raises
    ------
    ConfigurationError
        If ``name`` or ``schema`` is not a valid identifier, if together they make the
        notify channel ``<name>_<schema>_ledgerbox`` longer than 63 chars (``pg_notify``
        refuses it), or ``shard_count`` is not in ``1..32767``.
    """

    def __init__(
        self,
        name: str = "outbox",
        *,
        schema: str | None = None,
        metadata: sa.MetaData | None = None,
        shard_count: int = DEFAULT_SHARD_COUNT,
    ) -> None:
        from ledgerbox._core.errors import ConfigurationError

        self.name = outbox_table_name(name)
        self.schema = None if schema is None else sql_identifier(schema, "schema")
        # pg_notify refuses a longer channel ("channel name too long"): the migration
        # passed and then every INSERT failed in the NOTIFY trigger.
        outbox_notify_channel(self.name, self.schema)
        if not 1 <= shard_count <= 32767:
            raise ConfigurationError(f"shard_count must be in 1..32767, got {shard_count}")
        self.shard_count = shard_count
        self.metadata = metadata if metadata is not None else sa.MetaData()
        self.table = _define_table(self.metadata, self.name, self.schema)
        self.row_class: type[_OutboxRow] = type(f"OutboxRow_{self.name}", (_OutboxRow,), {})
        # eager_defaults=False: the flush fetches back only the id (the identity map needs
        # it), not the server defaults (created_at, status, attempts, txid) it never reads.
        registry().map_imperatively(self.row_class, self.table, eager_defaults=False)

    @property
    def qualified_name(self) -> str:
        """``schema.name`` or ``name``; both parts are validated identifiers."""
        return f"{self.schema}.{self.name}" if self.schema else self.name

    @property
    def notify_function(self) -> str:
        """The trigger function's name: ``schema.name_notify`` or ``name_notify``."""
        return f"{self.qualified_name}_notify"

    @property
    def notify_channel(self) -> str:
        """The LISTEN/NOTIFY channel the write path signals at commit (a quoted identifier)."""
        return f"{self.name}_{self.schema or 'default'}_ledgerbox"

    @property
    def idempotency_constraint(self) -> str:
        """Name of the UNIQUE constraint on ``idempotency_key`` (to classify 23505 errors)."""
        return f"uq_{self.name}_idempotency_key"

    @property
    def duplicate_constraints(self) -> frozenset[str]:
        """Constraints whose violation means "this event was already written"."""
        return frozenset({self.idempotency_constraint, f"uq_{self.name}_event_id"})

    def notify_function_ddl(self, *, gated: bool = True) -> str:
        """SQL (re)creating the trigger function: at most one ``NOTIFY`` per transaction, and
        with ``gated`` only while a relay waits for one.

        ``pg_notify`` is transactional: delivered at COMMIT, dropped at ROLLBACK (PostgreSQL
        docs, NOTIFY). A transaction-local setting guards it so a transaction with many
        inserts signals (or tries the gate) once.

        ``gated`` (schema revision 0004, docs/relay.md "Wake gate"): the transaction first
        takes the wake gate's advisory lock in SHARE mode without waiting
        (``pg_try_advisory_xact_lock_shared``, held to its end) and sends the ``NOTIFY``
        only if that fails, i.e. while a relay holds or waits for the gate: a relay waits
        for a notification only then. PostgreSQL queues notifications at commit under one
        lock of the whole cluster, held through the commit's WAL flush, so every
        transaction that notifies commits one after the other (docs/performance.md);
        while the relays are busy (they poll) writers skip it. Revision 0001 created the
        function without the gate (``gated=False``: every transaction notifies).
        """
        fn = self.notify_function
        guard = f"ledgerbox.notified_{self.name}"
        notify = f"PERFORM pg_notify('{self.notify_channel}', '');"
        if gated:
            k1, k2 = wake_gate_key(self.notify_channel)
            notify = f"""IF NOT pg_try_advisory_xact_lock_shared({k1}, {k2}) THEN
      {notify}
    END IF;"""
        return f"""CREATE OR REPLACE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF current_setting('{guard}', true) IS DISTINCT FROM '1' THEN
    PERFORM set_config('{guard}', '1', true);
    {notify}
  END IF;
  RETURN NULL;
END
$$"""

    def notify_ddl(self, *, gated: bool = True) -> list[str]:
        """SQL creating the trigger function (:meth:`notify_function_ddl`) and the
        statement-level trigger that calls it after every ``INSERT``."""
        fn = self.notify_function
        return [
            self.notify_function_ddl(gated=gated),
            f"""CREATE TRIGGER {self.name}_notify AFTER INSERT ON {self.qualified_name}
FOR EACH STATEMENT EXECUTE FUNCTION {fn}()""",
        ]

    def drop_notify_ddl(self) -> list[str]:
        """SQL dropping what :meth:`notify_ddl` created."""
        fn = self.notify_function
        return [
            f"DROP TRIGGER IF EXISTS {self.name}_notify ON {self.qualified_name}",
            f"DROP FUNCTION IF EXISTS {fn}()",
        ]


def _define_table(metadata: sa.MetaData, name: str, schema: str | None) -> sa.Table:
    return sa.Table(
        name,
        metadata,
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
        sa.Column("event_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("idempotency_key", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition_key", sa.Text, nullable=False),
        sa.Column("shard", sa.SmallInteger, nullable=False),
        sa.Column("event_type", sa.Text, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("aggregate_type", sa.Text, nullable=False),
        sa.Column("aggregate_id", sa.Text, nullable=False),
        sa.Column("aggregate_version", sa.BigInteger, nullable=True),
        sa.Column("payload", pg.JSONB, nullable=False),
        sa.Column("headers", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column("status", sa.SmallInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        # The writing transaction's top-level id (a savepoint's rows carry it too; a rolled
        # back savepoint's rows are never visible). STABLE, so adding the column to a
        # populated table is a fast default (no rewrite).
        sa.Column("txid", Xid8(), nullable=False, server_default=sa.text("pg_current_xact_id()")),
        # Each index below costs every producer a write (docs/performance.md, "Write cost of
        # each index"); each is needed by a guarantee or by the relay's reads.
        # G4 and the duplicate check of stage_once: one row per event id and per key.
        sa.UniqueConstraint("event_id", name=f"uq_{name}_event_id"),
        sa.UniqueConstraint("idempotency_key", name=f"uq_{name}_idempotency_key"),
        # The relay's claim (rows of a shard committed in a range of transactions, in id
        # order), the pending count and the cleanup (rows of a shard below a horizon).
        sa.Index(f"ix_{name}_shard_txid", "shard", "txid", "id"),
        # on_dead_letter="hold" ("is an earlier event of this key dead-lettered?") and the
        # replay of a key's held rows: only dead-lettered and held rows, so a producer's
        # insert evaluates the predicate and writes no entry.
        sa.Index(
            f"ix_{name}_held",
            "partition_key",
            "id",
            postgresql_where=sa.text("status IN (2, 3)"),
        ),
        schema=schema,
    )
