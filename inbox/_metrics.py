"""Prometheus metrics of the inbox consumer (module level; units in the names).

Every series carries the consumer ``group`` so that several consumers in one process (tests,
a service consuming for two groups) stay apart.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "CONFLICTS",
    "DEAD_LETTERED",
    "DUPLICATES",
    "HANDLER_DURATION",
    "HEALTH",
    "PROCESSED",
    "REDIS_DEGRADED",
    "RETRIES",
    "UNHANDLED",
    "GroupMetrics",
]

PROCESSED = Counter(
    "ledgerbox_inbox_processed_total",
    "Events whose handler effect committed together with the inbox row.",
    ["group"],
)
DUPLICATES = Counter(
    "ledgerbox_inbox_duplicates_total",
    "Redelivered events recognised as already applied, by where: redis (hint) or db (inbox); "
    "dead_lettered: a redelivery or copy of a dead-lettered event (final, handler not run).",
    ["group", "path"],
)
UNHANDLED = Counter(
    "ledgerbox_inbox_unhandled_total",
    "Events of a type without a registered handler (on_unhandled decides what happens).",
    ["group", "event_type"],
)
HEALTH = Gauge(
    "ledgerbox_inbox_health",
    "Health of the consumer: 0 ok, 1 degraded (Redis away), 2 down (a fault of the "
    "environment stops progress).",
    ["group"],
)
CONFLICTS = Counter(
    "ledgerbox_inbox_conflicts_total",
    "Optimistic version conflicts and fenced writes that made a handler run again.",
    ["group"],
)
RETRIES = Counter(
    "ledgerbox_inbox_retries_total",
    "Attempts rerun after a transient error (connection, timeout, 40001, 40P01, conflict).",
    ["group"],
)
DEAD_LETTERED = Counter(
    "ledgerbox_inbox_dead_lettered_total",
    "Records sent to the dead-letter topic (unparseable, permanent error, retries exhausted).",
    ["group"],
)
HANDLER_DURATION = Histogram(
    "ledgerbox_inbox_handler_duration_seconds",
    "Wall time of one attempt: inbox insert, handler and commit, in seconds.",
    ["group"],
)
REDIS_DEGRADED = Gauge(
    "ledgerbox_inbox_redis_degraded",
    "1 while Redis is unreachable and the consumer runs on the database alone, else 0.",
    ["group"],
)


class GroupMetrics:
    """The series of one consumer group, looked up once per consumer.

    ``labels()`` takes a lock and hashes the label values on every call; the hot path uses
    these children instead. Building them also exports every series at 0 from the start.
    """

    def __init__(self, group: str) -> None:
        self.processed = PROCESSED.labels(group)
        self.duplicates_redis = DUPLICATES.labels(group, "redis")
        self.duplicates_db = DUPLICATES.labels(group, "db")
        self.duplicates_dead_lettered = DUPLICATES.labels(group, "dead_lettered")
        self.conflicts = CONFLICTS.labels(group)
        self.retries = RETRIES.labels(group)
        self.dead_lettered = DEAD_LETTERED.labels(group)
        self.handler_duration = HANDLER_DURATION.labels(group)
