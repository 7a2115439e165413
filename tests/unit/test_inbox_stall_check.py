"""The inbox runner's stall check (``KafkaRunner.batch_stalls`` / ``report_stalls``,
docs/inbox.md "A partition that stalls"): pure logic over stand-in workers and health."""

from __future__ import annotations

from collections.abc import Hashable
from types import SimpleNamespace
from typing import Any

from aiokafka import TopicPartition

from ledgerbox.inbox._runner import KafkaRunner

TP0, TP1, TP2 = (TopicPartition("t", p) for p in range(3))


class FakeHealth:
    def __init__(self) -> None:
        self.faults: dict[Hashable, str] = {}
        self.cleared: list[tuple[Hashable, bool]] = []

    def fault(self, key: Hashable, cause: str) -> None:
        self.faults[key] = cause

    def clear(self, key: Hashable, *, resolved: bool = True) -> None:
        if self.faults.pop(key, None) is not None:
            self.cleared.append((key, resolved))


def runner_with(stalled_after_s: float | None) -> tuple[KafkaRunner, FakeHealth]:
    health = FakeHealth()
    config = SimpleNamespace(stop_timeout_s=5.0, stalled_after_s=stalled_after_s)
    deps: Any = SimpleNamespace(config=config, health=health)
    runner = KafkaRunner(deps, process_batch=None)  # type: ignore[arg-type]
    for tp in (TP0, TP1, TP2):
        runner.workers[tp] = SimpleNamespace(  # type: ignore[assignment]
            busy_since=None, batch_from={}, closing=False
        )
    return runner, health


def test_a_batch_running_past_the_bound_is_a_stall_naming_its_partitions() -> None:
    runner, _health = runner_with(30.0)
    worker: Any = runner.workers[TP0]
    worker.busy_since, worker.batch_from = 100.0, {("t", 0): 41, ("t", 2): 7}  # lent t[2]
    assert runner.batch_stalls(now=130.0) == {}  # at the bound: not yet
    stalls = runner.batch_stalls(now=131.0)
    assert list(stalls) == [TP0]
    assert stalls[TP0].startswith("a batch has been running for 31 s (t[0] from offset 41,")
    assert "t[2] from offset 7" in stalls[TP0] and "\n" not in stalls[TP0]


def test_idle_workers_and_a_disabled_check_report_nothing() -> None:
    runner, _health = runner_with(None)
    worker: Any = runner.workers[TP1]
    worker.busy_since = 0.0
    assert runner.batch_stalls(now=1e9) == {}
    runner, _health = runner_with(1.0)
    assert runner.batch_stalls(now=1e9) == {}  # no worker in a batch


def test_report_stalls_sets_and_clears_health_per_partition() -> None:
    runner, health = runner_with(1.0)
    runner.report_stalls({TP0: "a batch has been running for 2 s", TP1: "... 3 s"})
    assert set(health.faults) == {("stalled", TP0), ("stalled", TP1)}
    runner.report_stalls({TP1: "... 4 s"})  # TP0's batch ended
    assert set(health.faults) == {("stalled", TP1)} and health.faults[("stalled", TP1)] == "... 4 s"
    assert health.cleared == [(("stalled", TP0), True)]
    del runner.workers[TP1]  # revoked while stalled: given up, not fixed
    runner.report_stalls({})
    assert health.faults == {} and health.cleared[-1] == (("stalled", TP1), False)
