"""Constants shared by the write path, the relay and the consumer, in a module without heavy
imports (the relay daemon loads it without SQLAlchemy or pydantic)."""

from __future__ import annotations

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_MAX_RECORD_BYTES",
    "DEFAULT_SHARD_COUNT",
    "H_AGG_ID",
    "H_AGG_TYPE",
    "H_AGG_VERSION",
    "H_CONTENT_TYPE",
    "H_ID",
    "H_KEY",
    "H_SOURCE",
    "H_SPEC",
    "H_TIME",
    "H_TYPE",
    "KNOWN_HEADERS",
    "SCHEMA_REVISION",
    "SCHEMA_REVISIONS",
    "SCHEMA_REVISION_MIN",
    "SCHEMA_VERSION_TABLE",
    "revision_served",
]

#: Alembic version table of the stand-alone ledgerbox migrations (``ledgerbox migrate``).
SCHEMA_VERSION_TABLE = "ledgerbox_alembic_version"

#: Number of virtual shards the key space is cut into. Fixed for the life of a table: a relay
#: owns whole shards, and per-key order holds because a key never changes shard.
DEFAULT_SHARD_COUNT = 64

#: Largest Kafka record, in bytes, by default everywhere: aiokafka's ``max_request_size``
#: and close to the brokers' ``message.max.bytes`` (1,048,588). The writer refuses an event
#: whose record would be larger (``OutboxWriter.max_record_bytes``), the relay does not send
#: one (``RelayConfig.max_request_bytes``), so the two agree by default.
DEFAULT_MAX_RECORD_BYTES = 1_048_576

#: ``content-type`` of every record: the value is the payload JSON.
CONTENT_TYPE = "application/json"

#: Kafka header names of the CloudEvents binding (binary content mode, section 3.2) and of this
#: project's extension attributes.
H_ID = "ce_id"
H_TYPE = "ce_type"
H_SOURCE = "ce_source"
H_TIME = "ce_time"
H_SPEC = "ce_specversion"
H_CONTENT_TYPE = "content-type"
H_KEY = "ce_idempotencykey"
H_AGG_TYPE = "ce_aggregatetype"
H_AGG_ID = "ce_aggregateid"
H_AGG_VERSION = "ce_aggregateversion"

#: The header names above: an event's own headers never override them.
KNOWN_HEADERS = frozenset(
    {H_ID, H_TYPE, H_SOURCE, H_TIME, H_SPEC, H_CONTENT_TYPE, H_KEY, H_AGG_TYPE, H_AGG_ID}
    | {H_AGG_VERSION}
)

#: The ledgerbox schema revision this code needs (the head of ``ledgerbox.migrations``), and
#: every revision in order. Daemons compare ``ledgerbox_alembic_version`` with it at start
#: (a test keeps it equal to the Alembic head). Here, not in the migrations package, so that
#: the relay daemon never imports Alembic.
SCHEMA_REVISIONS = ("0001", "0002", "0003", "0004")
SCHEMA_REVISION = SCHEMA_REVISIONS[-1]
#: The oldest revision the daemons of this version run against. Revision 0004 changed only the
#: outbox trigger's function (the wake gate), which these relays work with or without (at
#: 0003 every transaction notifies): so new relays and consumers can be deployed before
#: ``ledgerbox migrate`` runs (docs/migrations.md, "Revision 4").
SCHEMA_REVISION_MIN = "0003"


def revision_served(revision: str) -> bool:
    """True if the daemons of this version run against tables at ``revision`` (a known
    revision, :data:`SCHEMA_REVISION_MIN` or later)."""
    return revision in SCHEMA_REVISIONS and SCHEMA_REVISIONS.index(
        revision
    ) >= SCHEMA_REVISIONS.index(SCHEMA_REVISION_MIN)
