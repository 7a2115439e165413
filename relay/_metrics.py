"""Prometheus metrics of the relay (module-level, units in the names)."""

from __future__ import annotations

from prometheus_client import Counter, Enum, Gauge, Histogram

__all__ = [
    "ACTIVE_LANES",
    "DEAD_LETTERED",
    "DEAD_LETTERED_EVENTS",
    "EVENT_AGE_AT_PUBLISH",
    "HELD_EVENTS",
    "LEASE_CHANGES",
    "OLDEST_PENDING_AGE",
    "OWNED_OLDEST_PENDING_AGE",
    "OWNED_PENDING_EVENTS",
    "OWNED_SHARDS",
    "PENDING_EVENTS",
    "PUBLISHED",
    "PUBLISH_BATCH_DURATION",
    "REFUSED_SHARDS",
    "RESTAMPED",
    "RETRIES",
    "STRAY_EVENTS",
    "UP",
    "WAKE_GATE",
]

PENDING_EVENTS = Gauge(
    "ledgerbox_relay_pending_events", "Outbox rows not yet published (leader's last count)"
)
OLDEST_PENDING_AGE = Gauge(
    "ledgerbox_relay_oldest_pending_age_seconds", "Age of the oldest pending outbox row"
)
PUBLISHED = Counter(
    "ledgerbox_relay_published_total", "Events confirmed by Kafka whose shard cursor was persisted"
)
PUBLISH_BATCH_DURATION = Histogram(
    "ledgerbox_relay_publish_batch_duration_seconds",
    "Claim + publish + persist of one batch",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
RETRIES = Counter(
    "ledgerbox_relay_retries_total",
    "Retries after a failure, by stage (publish, mark = persist, db, listen, gate, producer)",
    ["stage"],
)
DEAD_LETTERED = Counter(
    "ledgerbox_relay_dead_lettered_total", "Events Kafka refused for good, dead-lettered (status 2)"
)
OWNED_SHARDS = Gauge("ledgerbox_relay_owned_shards", "Shards this relay holds a lease on")
ACTIVE_LANES = Gauge(
    "ledgerbox_relay_active_lanes",
    "Claim -> publish -> mark pipelines running now (all while there is a backlog, else 1)",
)
OWNED_PENDING_EVENTS = Gauge(
    "ledgerbox_relay_owned_pending_events",
    "Outbox rows not yet published in the shards this relay holds (this relay's last count)",
)
OWNED_OLDEST_PENDING_AGE = Gauge(
    "ledgerbox_relay_owned_oldest_pending_age_seconds",
    "Age of the oldest row not yet published in the shards this relay holds",
)
UP = Gauge(
    "ledgerbox_relay_up",
    "1 while this relay can publish (Kafka and its database answer), 0 while it is down",
)
RESTAMPED = Counter(
    "ledgerbox_relay_restamped_total",
    "Records re-sent with the relay's send time as timestamp because the broker refused the "
    "event time (log.message.timestamp.{before,after}.max.ms); ce_time keeps the event time",
)
REFUSED_SHARDS = Gauge(
    "ledgerbox_relay_refused_shards",
    "Shards this relay refuses: cursor ahead of the database (run `ledgerbox relay rebase`)",
)
DEAD_LETTERED_EVENTS = Gauge(
    "ledgerbox_relay_dead_lettered_events",
    "Outbox rows dead-lettered now (status 2) and waiting for an operator's replay or discard "
    "(leader's last count)",
)
STRAY_EVENTS = Gauge(
    "ledgerbox_relay_stray_events",
    "Outbox rows waiting in a shard outside 0..shard_count-1, which no relay publishes (the"
    " writers' OutboxTable.shard_count is larger than the relays'; counted up to 10,000;"
    " leader's last count): alert on > 0",
)
HELD_EVENTS = Gauge(
    "ledgerbox_relay_held_events",
    "Outbox rows held behind a dead-lettered row of their key (status 3, on_dead_letter="
    "'hold'): not sent until the dead row is replayed or discarded (leader's last count)",
)
LEASE_CHANGES = Counter(
    "ledgerbox_relay_lease_changes_total",
    "Shard lease changes of this relay, by change: acquired, lost (expired before renewal "
    "or taken over), released (drained to another relay or on stop), leader (became the "
    "maintenance leader)",
    ["change"],
)
EVENT_AGE_AT_PUBLISH = Histogram(
    "ledgerbox_relay_event_age_at_publish_seconds",
    "Per confirmed batch, the age of its oldest event when Kafka confirmed the batch: event "
    "time (occurred_at) to broker ack, in seconds (one observation per batch, not per event)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
)
for _change in ("acquired", "lost", "released", "leader"):
    LEASE_CHANGES.labels(change=_change)  # every series exported at 0 from the start
WAKE_GATE = Enum(
    "ledgerbox_relay_wake_gate",
    "This relay and the wake gate: guarded (it holds it, writers notify), covered (another "
    "relay holds it), open (its lanes poll, writers skip NOTIFY), off (no gate: writers "
    "always notify); docs/relay.md, Wake gate",
    states=["off", "open", "guarded", "covered"],
)
