"""The soak's fault plan: seeded, complete, overlapping across resources, serial within one."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from example_services.soak.schedule import (
    CONSUMER_SESSION_TIMEOUT_S,
    KIND_NAMES,
    KINDS,
    PRODUCER_REQUEST_TIMEOUT_S,
    minimum_duration_s,
    plan_faults,
)


@pytest.mark.parametrize("seed", range(20))
def test_short_soak_plans_every_kind_inside_the_window(seed: int) -> None:
    plan = plan_faults(seed, 180)
    assert sorted({f.kind for f in plan}) == sorted(KIND_NAMES)
    assert all(f.at_s >= 15 and f.at_s + f.estimate_s <= 170 for f in plan), plan


def test_same_seed_same_plan_other_seed_other_plan() -> None:
    assert [f.as_dict() for f in plan_faults(7, 600)] == [f.as_dict() for f in plan_faults(7, 600)]
    assert [f.as_dict() for f in plan_faults(7, 600)] != [f.as_dict() for f in plan_faults(8, 600)]


@pytest.mark.parametrize("duration", [180, 1800])
def test_faults_on_one_resource_never_overlap_and_different_resources_do(duration: int) -> None:
    plan = plan_faults(3, duration)
    by_resource: dict[str, list[tuple[float, float]]] = {}
    for f in plan:
        by_resource.setdefault(f.resource, []).append((f.at_s, f.at_s + f.estimate_s))
    for spans in by_resource.values():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end, f"overlap on one resource: {spans}"
    overlapping = sum(
        1
        for a in plan
        for b in plan
        if a.index < b.index and a.resource != b.resource and b.at_s < a.at_s + a.estimate_s
    )
    assert overlapping >= 5, "the plan must overlap faults of different kinds"


def test_long_soak_repeats_kinds_and_keeps_calms_for_the_liveness_check() -> None:
    plan = plan_faults(11, 1800, cycle_s=300, calm_s=90)
    counts = Counter(f.kind for f in plan)
    assert set(counts) == set(KIND_NAMES)
    assert counts["relay-kill"] >= 5 and counts["cluster-restart"] >= 1
    for f in plan:
        assert (f.at_s - 15) % 300 <= 300 - 90, f"fault starts in a calm: {f}"


def test_parameters_cross_the_timeouts_they_attack() -> None:
    for seed in range(30):
        for f in plan_faults(seed, 180):
            if f.kind == "consumer-zombie":
                assert f.params["stopped_s"] > CONSUMER_SESSION_TIMEOUT_S
            if f.kind == "broker-stall":
                assert f.params["stalled_s"] > PRODUCER_REQUEST_TIMEOUT_S
            if f.kind == "min-isr":
                assert len(f.params["stopped"]) == 2  # 1 of 3 left < min.insync.replicas=2
            if f.kind == "net-latency":
                assert 0 <= f.params["jitter_ms"] <= f.params["latency_ms"]


def test_minimum_duration_and_unknown_kinds() -> None:
    assert minimum_duration_s() <= 180 < 1800
    assert {k.name for k in KINDS} == set(KIND_NAMES)
    with pytest.raises(ValueError, match="unknown fault kinds"):
        plan_faults(1, 180, kinds=["meteor"])
    with pytest.raises(ValueError, match="no time"):
        plan_faults(1, 20)
