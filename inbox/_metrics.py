"""Prometheus metrics of the inbox consumer (module level; units in the names).

Every series carries the consumer ``group`` so that several consumers in one process (tests,
a service consuming for two groups) stay apart.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "CLIENT_REPLACED",
    "CONFLICTS",
    "DEAD_LETTERED",
    "DUPLICATES",
    "EVENT_LATENCY",
    "HANDLER_DURATION",
    "HEALTH",
    "LAG",
    "LOCK_ACQUIRED",
    "LOCK_CONTENDED",
    "LOCK_EXPIRED",
    "PROCESSED",
    "REDIS_DEGRADED",
    "REPLAYED",
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
CLIENT_REPLACED = Counter(
    "ledgerbox_inbox_client_replaced_total",
    "Kafka clients replaced because they stopped fetching, by why: fetch_task_died (aiokafka's "
    "fetch task ended, e.g. aiokafka#1038 under uvloop) or no_fetch_response (a partition "
    "waited on got no fetch response within the stall bound).",
    ["group", "why"],
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

REPLAYED = Counter(
    "ledgerbox_inbox_replayed_total",
    "Dead-lettered events applied by an operator's replay (their REPLAY_REQUESTED inbox row "
    "taken over by a delivery and the handler's effect committed).",
    ["group"],
)
EVENT_LATENCY = Histogram(
    "ledgerbox_inbox_event_latency_seconds",
    "End to end: the event's time (occurred_at, set by the writer) to its inbox commit "
    "(handler effect applied), in seconds. Includes relay, broker and queueing delays; "
    "clock skew between the writer's and the consumer's host shifts it.",
    ["group"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
)
LAG = Gauge(
    "ledgerbox_inbox_lag_records",
    "Records of a partition assigned to this consumer not applied yet: its end offset (last "
    "stable offset under read_committed) minus the offset after the last record finished, "
    "refreshed about once per second while the consumer fetches.",
    ["group", "topic", "partition"],
)
LOCK_ACQUIRED = Counter(
    "ledgerbox_inbox_lock_acquired_total",
    "Per-aggregate locks taken (lock_aggregates=True), one per handler attempt.",
    ["group"],
)
LOCK_CONTENDED = Counter(
    "ledgerbox_inbox_lock_contended_total",
    "Lock acquisitions that found the aggregate's lock taken by another worker and waited "
    "(counted once per acquisition, whether it then got the lock or gave up).",
    ["group"],
)
LOCK_EXPIRED = Counter(
    "ledgerbox_inbox_lock_expired_total",
    "Aggregate locks lost while their handler ran (a renewal found the lock expired or "
    "taken): the fencing token then refuses the handler's stale write.",
    ["group"],
)


class GroupMetrics:
    """The series of one consumer group, looked up once per consumer.

    ``labels()`` takes a lock and hashes the label values on every call; the hot path uses
    these children instead. Building them also exports every series at 0 from the start.
    """

    def __init__(self, group: str, clock: Callable[[], float] = time.time) -> None:
        self.group = group
        self._clock = clock
        self.processed = PROCESSED.labels(group)
        self.duplicates_redis = DUPLICATES.labels(group, "redis")
        self.duplicates_db = DUPLICATES.labels(group, "db")
        self.duplicates_dead_lettered = DUPLICATES.labels(group, "dead_lettered")
        self.conflicts = CONFLICTS.labels(group)
        self.retries = RETRIES.labels(group)
        self.dead_lettered = DEAD_LETTERED.labels(group)
        self.handler_duration = HANDLER_DURATION.labels(group)
        self.event_latency = EVENT_LATENCY.labels(group)
        self.replayed = REPLAYED.labels(group)
        self.lock_acquired = LOCK_ACQUIRED.labels(group)
        self.lock_contended = LOCK_CONTENDED.labels(group)
        self.lock_expired = LOCK_EXPIRED.labels(group)
        self.client_replaced = {
            why: CLIENT_REPLACED.labels(group, why)
            for why in ("fetch_task_died", "no_fetch_response")
        }

    def observe_latency(self, occurred_at: dt.datetime) -> None:
        """Observe one applied event's end-to-end latency (``clock() - occurred_at``, s;
        a negative value from clock skew counts as 0)."""
        self.event_latency.observe(max(0.0, self._clock() - occurred_at.timestamp()))

    def set_lag(self, topic: str, partition: int, records: int) -> None:
        """Set the lag gauge of one assigned partition (records)."""
        LAG.labels(self.group, topic, str(partition)).set(records)

    def forget_lag(self, topic: str, partition: int) -> None:
        """Drop the lag series of a partition this consumer no longer holds."""
        with contextlib.suppress(KeyError):
            LAG.remove(self.group, topic, str(partition))
