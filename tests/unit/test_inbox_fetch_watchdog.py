"""The inbox runner's fetch watchdog (``KafkaRunner.fetch_stall``, docs/inbox.md "A Kafka
client that stops fetching is replaced"): pure logic over a stand-in client and workers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from aiokafka import TopicPartition

from ledgerbox.inbox._runner import FETCH_STALL_MAX_S, FETCH_STALL_S, KafkaRunner, client_failure

TP0, TP1 = TopicPartition("t", 0), TopicPartition("t", 1)


class FakeClient:
    """``last_poll_timestamp`` per partition (wall-clock ms, as aiokafka keeps it)."""

    def __init__(self) -> None:
        self.polled: dict[TopicPartition, int | None] = {}

    def last_poll_timestamp(self, tp: TopicPartition) -> int | None:
        if tp not in self.polled:
            raise AssertionError("Partition is not assigned")
        return self.polled[tp]


def runner_with(*tps: TopicPartition, idle_since: float = 0.0) -> KafkaRunner:
    deps: Any = SimpleNamespace(config=SimpleNamespace(stop_timeout_s=5.0))
    runner = KafkaRunner(deps, process_batch=None)  # type: ignore[arg-type]
    for tp in tps:
        runner.workers[tp] = SimpleNamespace(  # type: ignore[assignment]
            closing=False, queue=[], in_process=0, idle_since=idle_since
        )
    return runner


def test_a_partition_answered_within_the_bound_is_no_stall() -> None:
    runner, kafka = runner_with(TP0), FakeClient()
    kafka.polled[TP0] = 1_000
    assert runner.fetch_stall(kafka, now=10.0) is None  # type: ignore[arg-type]
    kafka.polled[TP0] = 2_000  # a new answer, seen at 50
    assert runner.fetch_stall(kafka, now=50.0) is None  # type: ignore[arg-type]
    assert runner.fetch_stall(kafka, now=50.0 + FETCH_STALL_S) is None  # type: ignore[arg-type]


def test_no_answer_past_the_bound_is_a_stall_naming_the_partition() -> None:
    runner, kafka = runner_with(TP0, TP1), FakeClient()
    kafka.polled = {TP0: 1_000, TP1: None}  # TP1 never answered since its assignment at 0
    assert runner.fetch_stall(kafka, now=1.0) is None  # type: ignore[arg-type]
    cause = runner.fetch_stall(kafka, now=FETCH_STALL_S + 2)  # type: ignore[arg-type]
    assert cause is not None and cause.startswith("no fetch response for t[")
    assert "(Kafka away, or the client stuck)" in cause


def test_the_wall_clock_is_only_compared_with_itself() -> None:
    """A clock step makes aiokafka's timestamp jump (even backwards): a changed value is an
    answer, counted from when it was seen; an unchanged one is no answer."""
    runner, kafka = runner_with(TP0), FakeClient()
    kafka.polled[TP0] = 10_000_000
    assert runner.fetch_stall(kafka, now=1.0) is None  # type: ignore[arg-type]
    kafka.polled[TP0] = 5_000  # the clock stepped back 3 hours
    assert runner.fetch_stall(kafka, now=40.0) is None  # type: ignore[arg-type]
    assert runner.fetch_stall(kafka, now=40.0 + FETCH_STALL_S - 1) is None  # type: ignore[arg-type]
    assert runner.fetch_stall(kafka, now=40.0 + FETCH_STALL_S + 1) is not None  # type: ignore[arg-type]


def test_a_partition_with_work_paused_or_closing_is_not_waiting_on_kafka() -> None:
    runner, kafka = runner_with(TP0), FakeClient()
    kafka.polled[TP0] = None
    worker: Any = runner.workers[TP0]
    late = FETCH_STALL_S * 3
    worker.queue = [object()]
    assert runner.fetch_stall(kafka, now=late) is None  # type: ignore[arg-type]
    worker.queue, worker.in_process = [], 3
    assert runner.fetch_stall(kafka, now=late) is None  # type: ignore[arg-type]
    worker.in_process = 0
    runner.paused.add(TP0)
    assert runner.fetch_stall(kafka, now=late) is None  # type: ignore[arg-type]
    runner.paused.clear()
    worker.closing = True
    assert runner.fetch_stall(kafka, now=late) is None  # type: ignore[arg-type]
    worker.closing = False
    del kafka.polled[TP0]  # revoked meanwhile: aiokafka asserts
    assert runner.fetch_stall(kafka, now=late) is None  # type: ignore[arg-type]


def test_the_idle_time_counts_from_the_last_batch_not_the_last_answer() -> None:
    """A worker busy for minutes on the database (its partition paused meanwhile) starts
    waiting on Kafka when its last batch ends."""
    runner, kafka = runner_with(TP0, idle_since=500.0), FakeClient()
    kafka.polled[TP0] = 1_000
    runner._polled[TP0] = (1_000, 0.0)  # last answer long before
    assert runner.fetch_stall(kafka, now=500.0 + FETCH_STALL_S - 1) is None  # type: ignore[arg-type]
    assert runner.fetch_stall(kafka, now=500.0 + FETCH_STALL_S + 1) is not None  # type: ignore[arg-type]


def test_a_raised_bound_holds_while_one_partition_is_unanswered_and_resets_after() -> None:
    runner, kafka = runner_with(TP0, TP1), FakeClient()
    runner._stall_bound_s = 4 * FETCH_STALL_S  # after two stall replacements
    kafka.polled = {TP0: 1, TP1: None}  # TP1: an offline partition
    assert runner.fetch_stall(kafka, now=2 * FETCH_STALL_S) is None  # type: ignore[arg-type]
    assert runner._stall_bound_s == 4 * FETCH_STALL_S  # TP1 still unanswered: kept
    kafka.polled[TP1] = 7  # it answers
    kafka.polled[TP0] = 2
    assert runner.fetch_stall(kafka, now=2 * FETCH_STALL_S + 1) is None  # type: ignore[arg-type]
    assert runner._stall_bound_s == FETCH_STALL_S
    assert FETCH_STALL_MAX_S >= 4 * FETCH_STALL_S


def test_client_failure_reads_the_fetch_task() -> None:
    import asyncio

    async def scenario() -> None:
        async def died() -> None:
            try:
                raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")
            except RuntimeError as exc:
                raise ValueError("Unexpected error during data retrieval") from exc

        async def forever() -> None:
            await asyncio.Event().wait()

        running = asyncio.ensure_future(forever())
        dead = asyncio.ensure_future(died())
        await asyncio.sleep(0)
        live: Any = SimpleNamespace(_closed=False, _fetcher=SimpleNamespace(error_future=running))
        assert client_failure(live) is None
        gone: Any = SimpleNamespace(_closed=False, _fetcher=SimpleNamespace(error_future=dead))
        assert client_failure(gone) == (
            "its fetch task died: RuntimeError: unable to perform operation on"
            " <TCPTransport closed=True>"
        )
        gone._closed = True  # being stopped: not a failure
        assert client_failure(gone) is None
        assert client_failure(SimpleNamespace()) is None  # type: ignore[arg-type]
        running.cancel()

    asyncio.run(scenario())
