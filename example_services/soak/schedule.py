"""The soak's fault plan: pure and seeded (same seed and duration, same plan).

Every fault kind has a *resource* it works on. Faults on different resources overlap freely
(a relay killed while a broker is stalled while PostgreSQL's link is slow); faults on one
resource run one after the other (two broker faults at once could take the whole cluster
down, which ``cluster-restart`` already does on purpose). Times in the plan are "not before":
the injector also waits for the resource at run time, since a fault may take longer than
its estimate (a broker that starts slowly).

Long soaks alternate storms and calms: in every cycle of ``cycle_s`` seconds the last
``calm_s`` start no fault, so the liveness bound is checked after each storm, not only at
the end. A short soak (under two cycles) is one storm followed by the final drain; every
kind is planned at least once in any soak long enough to hold them (the CLI refuses shorter
ones: see :func:`minimum_duration_s`).

Fault kinds (``KINDS``): kill -9 of relays and consumers, SIGSTOP of a consumer past its
session timeout then SIGCONT (a zombie), kill -9 / SIGSTOP of one broker, two brokers stopped
(produce refused with NOT_ENOUGH_REPLICAS), whole-cluster restart, PostgreSQL fast restart,
SIGKILL and pg_terminate_backend of backends, Redis stop and FLUSHALL, and per link group
(kafka, pg, redis) latency + jitter, bandwidth limit, connection resets and black-holes, plus
duplicate Kafka deliveries.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "CONSUMER_SESSION_TIMEOUT_S",
    "KINDS",
    "PRODUCER_REQUEST_TIMEOUT_S",
    "FaultKind",
    "PlannedFault",
    "minimum_duration_s",
    "plan_faults",
]

#: aiokafka's default consumer ``session_timeout_ms`` (the inbox keeps it): a consumer
#: stopped longer than this loses its partitions.
CONSUMER_SESSION_TIMEOUT_S = 10.0
#: The relay's producer ``request_timeout_ms`` default (30 000 ms).
PRODUCER_REQUEST_TIMEOUT_S = 30.0

LINK_GROUPS = ("kafka", "pg", "redis")
RELAYS = tuple(f"{s}-relay-{i}" for s in ("order", "payment") for i in (1, 2))
CONSUMERS = tuple(f"{s}-consumer-{i}" for s in ("order", "payment") for i in (1, 2))
BROKERS = (1, 2, 3)


@dataclass(frozen=True)
class FaultKind:
    """One kind: its resource and an estimate of how long it holds it (s), for the plan."""

    name: str
    resource: str
    estimate_s: float
    period_s: float  # one per this many seconds of storm in a long soak


KINDS: tuple[FaultKind, ...] = (
    FaultKind("relay-kill", "proc", 3, 90),
    FaultKind("consumer-kill", "proc", 3, 90),
    FaultKind("consumer-zombie", "proc", 20, 240),
    FaultKind("broker-kill", "kafka-cluster", 20, 240),
    FaultKind("broker-stall", "kafka-cluster", 38, 360),
    FaultKind("min-isr", "kafka-cluster", 35, 360),
    FaultKind("cluster-restart", "kafka-cluster", 45, 600),
    FaultKind("pg-restart", "pg-server", 8, 300),
    FaultKind("pg-backend-kill", "pg-server", 5, 300),
    FaultKind("pg-terminate", "pg-server", 2, 150),
    FaultKind("redis-stop", "redis-server", 10, 240),
    FaultKind("redis-flush", "redis-server", 1, 150),
    FaultKind("net-latency", "link", 20, 120),
    FaultKind("net-bandwidth", "link", 20, 180),
    FaultKind("net-reset", "link", 2, 120),
    FaultKind("net-blackhole", "link", 15, 180),
    FaultKind("duplicates", "duplicates", 3, 180),
)
KIND_NAMES = tuple(k.name for k in KINDS)
#: Seconds kept free on a resource after a fault's estimate (restarts vary).
GAP_S = 3.0


@dataclass
class PlannedFault:
    """One fault of the plan: ``at_s`` from the soak's start, ``params`` decided by the seed."""

    index: int
    kind: str
    at_s: float
    resource: str
    estimate_s: float
    params: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _params(kind: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """The seeded parameters of one fault and the exact resource it holds."""
    if kind == "relay-kill":
        target = rng.choice(RELAYS)
        return f"proc:{target}", {"target": target, "down_s": round(rng.uniform(0.5, 3.0), 1)}
    if kind == "consumer-kill":
        target = rng.choice(CONSUMERS)
        return f"proc:{target}", {"target": target, "down_s": round(rng.uniform(0.5, 3.0), 1)}
    if kind == "consumer-zombie":
        target = rng.choice(CONSUMERS)
        stop_s = CONSUMER_SESSION_TIMEOUT_S + rng.uniform(5.0, 12.0)
        return f"proc:{target}", {"target": target, "stopped_s": round(stop_s, 1)}
    if kind == "broker-kill":
        return "kafka-cluster", {
            "broker": rng.choice(BROKERS),
            "down_s": round(rng.uniform(3.0, 10.0), 1),
        }
    if kind == "broker-stall":
        stall = PRODUCER_REQUEST_TIMEOUT_S + rng.uniform(3.0, 8.0)
        return "kafka-cluster", {"broker": rng.choice(BROKERS), "stalled_s": round(stall, 1)}
    if kind == "min-isr":
        survivor = rng.choice(BROKERS)
        return "kafka-cluster", {
            "stopped": [b for b in BROKERS if b != survivor],
            "down_s": round(rng.uniform(10.0, 20.0), 1),
        }
    if kind == "cluster-restart":
        return "kafka-cluster", {"down_s": round(rng.uniform(1.0, 5.0), 1)}
    if kind in ("pg-restart", "pg-backend-kill"):
        return "pg-server", {}
    if kind == "pg-terminate":
        return "pg-server", {"backends": rng.randint(1, 4)}
    if kind == "redis-stop":
        return "redis-server", {"down_s": round(rng.uniform(3.0, 12.0), 1)}
    if kind == "redis-flush":
        return "redis-server", {}
    if kind.startswith("net-"):
        group = rng.choice(LINK_GROUPS)
        params: dict[str, Any] = {"group": group}
        if kind == "net-latency":
            latency = rng.choice((20, 50, 100, 200, 400))
            params |= {
                "latency_ms": latency,
                "jitter_ms": round(latency * rng.uniform(0.0, 0.8)),
                "hold_s": round(rng.uniform(10.0, 30.0), 1),
            }
        elif kind == "net-bandwidth":
            params |= {
                "bandwidth_bps": rng.choice((8_000, 32_000, 128_000, 512_000)),
                "hold_s": round(rng.uniform(10.0, 30.0), 1),
            }
        elif kind == "net-reset":
            params |= {"resets": rng.randint(1, 3)}
        else:
            # Up to past the producer's request timeout for Kafka: in-flight sends time out.
            top = PRODUCER_REQUEST_TIMEOUT_S + 5.0 if group == "kafka" else 20.0
            params |= {"hold_s": round(rng.uniform(5.0, top), 1)}
        return f"link:{group}", params
    if kind == "duplicates":
        return "duplicates", {"records": rng.randint(20, 100)}
    raise ValueError(f"unknown fault kind {kind!r}")


def minimum_duration_s(warmup_s: float = 15.0, tail_s: float = 10.0) -> float:
    """Shortest soak whose single storm can hold one fault of every kind (s)."""
    per_resource: dict[str, float] = {}
    for kind in KINDS:
        resource = kind.resource if kind.resource not in ("proc", "link") else kind.name
        per_resource[resource] = per_resource.get(resource, 0.0) + kind.estimate_s + GAP_S
    return warmup_s + tail_s + max(per_resource.values())


def plan_faults(
    seed: int,
    duration_s: float,
    *,
    kinds: Sequence[str] = KIND_NAMES,
    warmup_s: float = 15.0,
    tail_s: float = 10.0,
    cycle_s: float = 300.0,
    calm_s: float = 90.0,
) -> list[PlannedFault]:
    """The fault plan of a soak of ``duration_s`` seconds, sorted by start.

    Faults start after ``warmup_s`` and are planned to end ``tail_s`` before the load stops.
    Soaks of at least two cycles keep the last ``calm_s`` of every ``cycle_s`` free of new
    faults. Each kind in ``kinds`` gets ``max(1, storm seconds / period)`` faults. The first
    of each kind is always planned, in the first storm (faults sharing a resource one after
    the other, in a random order with random gaps); further ones go at a random time or when
    their resource is free, and are dropped when that is past their storm.

    Raises
    ------
    ValueError
        On an unknown kind or a window too short for anything.
    """
    unknown = sorted(set(kinds) - set(KIND_NAMES))
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}; known: {KIND_NAMES}")
    rng = random.Random(seed)
    end = duration_s - tail_s
    if end <= warmup_s:
        raise ValueError(f"a {duration_s:g} s soak leaves no time for faults")
    storms: list[tuple[float, float]] = []
    if duration_s >= 2 * cycle_s:
        start = warmup_s
        while start < end:
            storms.append((start, min(end, start + cycle_s - calm_s)))
            start += cycle_s
    else:
        storms.append((warmup_s, end))
    storm_total = sum(b - a for a, b in storms)

    def storm_time(offset: float) -> float:
        for a, b in storms:
            if offset < b - a:
                return a + offset
            offset -= b - a
        return storms[-1][1]

    by_name = {k.name: k for k in KINDS}
    drawn: list[tuple[float, bool, str, str, dict[str, Any]]] = []
    for name in kinds:
        count = max(1, int(storm_total // by_name[name].period_s))
        for i in range(count):
            resource, params = _params(name, rng)
            drawn.append((rng.uniform(0, storm_total), i == 0, name, resource, params))
    free_at: dict[str, list[tuple[float, float]]] = {}
    planned: list[PlannedFault] = []
    # The first fault of every kind is placed for sure: per resource, one after the other in
    # a random order, the spare time of the first storm spread randomly between them.
    first_start, first_end = storms[0]
    required: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for _, is_first, name, resource, params in drawn:
        if is_first:
            required.setdefault(resource, []).append((name, params))
    for resource in sorted(required):
        group = required[resource]
        rng.shuffle(group)
        total = sum(by_name[name].estimate_s + GAP_S for name, _ in group)
        spare = max(0.0, first_end - first_start - total)
        weights = [rng.random() for _ in range(len(group) + 1)]
        scale = spare / sum(weights)
        at = first_start
        for (name, params), weight in zip(group, weights, strict=False):
            at += weight * scale
            kind = by_name[name]
            planned.append(PlannedFault(0, name, round(at, 1), resource, kind.estimate_s, params))
            free_at.setdefault(resource, []).append((at, at + kind.estimate_s + GAP_S))
            at += kind.estimate_s + GAP_S
    # Further faults (long soaks) at their random time, or when their resource is free, or
    # not at all when that is past the storm.
    for offset, is_first, name, resource, params in sorted(drawn, key=lambda d: d[0]):
        if is_first:
            continue
        kind = by_name[name]
        busy = free_at.setdefault(resource, [])
        at = _first_free(busy, storm_time(offset), kind.estimate_s + GAP_S)
        if at + kind.estimate_s > end or not _in_storm(storms, at):
            continue
        busy.append((at, at + kind.estimate_s + GAP_S))
        planned.append(PlannedFault(0, name, round(at, 1), resource, kind.estimate_s, params))
    planned.sort(key=lambda f: (f.at_s, f.kind))
    for index, fault in enumerate(planned):
        fault.index = index
    return planned


def _in_storm(storms: Sequence[tuple[float, float]], at: float) -> bool:
    return any(a <= at <= b for a, b in storms)


def _first_free(busy: list[tuple[float, float]], at: float, length: float) -> float:
    """Earliest start >= ``at`` where ``[start, start + length)`` overlaps no busy span."""
    for a, b in sorted(busy):
        if at + length <= a:
            break
        if at < b:
            at = b
    return at
