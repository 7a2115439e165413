"""Constants shared by the write path, the relay and the consumer, in a module without heavy
imports (the relay daemon loads it without SQLAlchemy or pydantic)."""

from __future__ import annotations

__all__ = ["CONTENT_TYPE", "DEFAULT_SHARD_COUNT", "KNOWN_HEADERS"]

#: Number of virtual shards the key space is cut into. Fixed for the life of a table: a relay
#: owns whole shards, and per-key order holds because a key never changes shard.
DEFAULT_SHARD_COUNT = 64

#: ``content-type`` of every record: the value is the payload JSON.
CONTENT_TYPE = "application/json"

#: Kafka header names the CloudEvents binding itself uses (binary content mode, section 3.2,
#: plus this project's extension attributes); an event's own headers never override them.
KNOWN_HEADERS = frozenset(
    {
        "ce_id",
        "ce_type",
        "ce_source",
        "ce_time",
        "ce_specversion",
        "content-type",
        "ce_idempotencykey",
        "ce_aggregatetype",
        "ce_aggregateid",
        "ce_aggregateversion",
    }
)
