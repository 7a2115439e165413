"""Batches across partitions (``inbox._runner._PartitionWorker``; docs/inbox.md, "Across
partitions"): the partition workers' lending, over a scripted stand-in for the batched pipeline (no
database, no Kafka: the pipeline's own behaviour is tested against real services in
tests/integration/test_inbox_lending.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from aiokafka import TopicPartition

from ledgerbox.inbox import Outcome
from ledgerbox.inbox._runner import KafkaRunner
from ledgerbox.inbox.testing import FakeRecord

TPS = [TopicPartition("t", p) for p in range(3)]


def records(partition: int, first: int, count: int) -> list[FakeRecord]:
    return [FakeRecord("t", partition, o, b"k", b"v") for o in range(first, first + count)]


class Pipeline:
    """Records every call; ``script`` decides the outcomes (default: all applied); a call
    waits while ``gate`` is clear."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[tuple[int, int]], tuple[str, int] | None]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.script: Callable[[Sequence[FakeRecord], tuple[str, int] | None], list[Outcome]]
        self.script = lambda batch, own: [Outcome.APPLIED] * len(batch)
        self.entered = asyncio.Event()

    async def __call__(
        self,
        batch: Sequence[FakeRecord],
        abandon: Callable[[], bool],
        own: tuple[str, int] | None = None,
    ) -> list[Outcome]:
        self.calls.append(([(r.partition, r.offset) for r in batch], own))
        self.entered.set()
        await self.gate.wait()
        return self.script(batch, own)


def runner_with(pipeline: Pipeline, *, across: bool = True, limit: int = 100) -> KafkaRunner:
    config = SimpleNamespace(
        stop_timeout_s=5.0, batch_max_records=limit, batch_across_partitions=across
    )
    runner = KafkaRunner(SimpleNamespace(config=config), pipeline)  # type: ignore[arg-type]
    runner.start_workers(TPS)
    return runner


def feed(runner: KafkaRunner, partitions: int, count: int, first: int = 0) -> None:
    """``count`` records (offsets from ``first``) on each of the first ``partitions``."""
    for p in range(partitions):
        runner.workers[TPS[p]].feed(records(p, first, count))


async def held_batch(pipeline: Pipeline, partitions: int, count: int) -> KafkaRunner:
    """A runner whose first batch (lending ``partitions`` x ``count`` records) is in the
    pipeline, held there until ``pipeline.gate`` is set."""
    runner = runner_with(pipeline)
    pipeline.gate.clear()
    feed(runner, partitions, count)
    await pipeline.entered.wait()
    return runner


async def settle(runner: KafkaRunner) -> None:
    for _ in range(50):
        await asyncio.sleep(0)
        if all(not w.queue and not w.in_process for w in runner.workers.values()):
            return


def partitions_of(call: tuple[list[tuple[int, int]], Any]) -> set[int]:
    return {p for p, _ in call[0]}


async def close(runner: KafkaRunner) -> None:
    await asyncio.gather(*(w.aclose() for w in runner.workers.values()))


async def test_records_waiting_on_idle_partitions_join_the_batch_in_offset_order() -> None:
    pipeline = Pipeline()
    runner = runner_with(pipeline)
    feed(runner, 3, 4, 10)
    await settle(runner)
    assert len(pipeline.calls) == 1, pipeline.calls
    [(batch, own)] = pipeline.calls
    assert own == ("t", 0)
    for p in range(3):
        assert [o for q, o in batch if q == p] == [10, 11, 12, 13]
    assert [runner.workers[tp].position for tp in TPS] == [14, 14, 14]
    await close(runner)


async def test_without_lending_each_partition_has_its_own_batches() -> None:
    pipeline = Pipeline()
    runner = runner_with(pipeline, across=False)
    feed(runner, 3, 2)
    await settle(runner)
    assert sorted(partitions_of(c).pop() for c in pipeline.calls) == [0, 1, 2]
    assert all(len(partitions_of(c)) == 1 and c[1] is None for c in pipeline.calls)
    await close(runner)


async def test_a_batch_takes_at_most_batch_max_records() -> None:
    pipeline = Pipeline()
    runner = runner_with(pipeline, limit=5)
    feed(runner, 3, 3)
    await settle(runner)
    assert all(len(c[0]) <= 5 for c in pipeline.calls)
    assert sorted(pipeline.calls[0][0]) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert [runner.workers[tp].position for tp in TPS] == [3, 3, 3]
    await close(runner)


async def test_given_back_records_return_in_order_and_run_on_their_own() -> None:
    """The lent batch ends at partition 1's second record (ABANDONED: given back): partition
    0's records and partition 1's first are applied; the rest go back to the front of their
    queues, before what arrived meanwhile, and each worker runs them in a batch of its own
    (own=None: the per-message path may run there)."""
    pipeline = Pipeline()
    runner = await held_batch(pipeline, 3, 3)
    runner.workers[TPS[1]].feed(records(1, 3, 1))  # arrives while lent

    def first(batch: Sequence[FakeRecord], own: Any) -> list[Outcome]:
        if own is None:
            return [Outcome.APPLIED] * len(batch)
        stop = [(r.partition, r.offset) for r in batch].index((1, 1))
        return [Outcome.APPLIED] * stop + [Outcome.ABANDONED]

    pipeline.script = first
    pipeline.gate.set()
    await settle(runner)
    later = pipeline.calls[1:]
    assert all(own is None and len(partitions_of((b, own))) == 1 for b, own in later), later
    assert ([(1, 1), (1, 2), (1, 3)], None) in later
    assert ([(2, 0), (2, 1), (2, 2)], None) in later
    assert [runner.workers[tp].position for tp in TPS] == [3, 4, 3]
    await close(runner)


async def test_a_lent_partition_closing_waits_for_its_records_and_keeps_their_position() -> None:
    """A revoke of a lent partition: ``aclose`` returns only once the batch holding its
    records ended, and by then the position of the applied ones is set (the revoke commits
    it); the batch stopped at its next run (abandon), the other records given back."""
    pipeline = Pipeline()
    runner = await held_batch(pipeline, 3, 2)
    lent = runner.workers[TPS[2]]
    closing = asyncio.create_task(lent.aclose())
    await asyncio.sleep(0.05)
    assert not closing.done(), "a lent worker is not closed while its records are in a batch"
    pipeline.gate.set()
    await asyncio.wait_for(closing, 5)
    assert lent.position == 2 and not lent.queue and lent.closing
    await close(runner)


async def test_a_closing_partition_gets_nothing_back_and_others_keep_theirs() -> None:
    pipeline = Pipeline()
    runner = await held_batch(pipeline, 3, 2)
    lent = runner.workers[TPS[1]]
    closing = asyncio.create_task(lent.aclose())
    # The lent batch is abandoned at once (a closing part); the batches after it apply.
    pipeline.script = lambda batch, own: (
        [Outcome.ABANDONED] if own is not None else [Outcome.APPLIED] * len(batch)
    )
    pipeline.gate.set()
    await asyncio.wait_for(closing, 5)
    await settle(runner)
    assert lent.position is None and not lent.queue
    assert runner.workers[TPS[0]].position == 2 and runner.workers[TPS[2]].position == 2
    await close(runner)


async def test_a_pipeline_error_gives_every_lent_record_back() -> None:
    """A bug in the pipeline kills the worker that ran the batch (the fetch loop surfaces
    it); the lent partitions keep their records and run them."""
    pipeline = Pipeline()
    runner = runner_with(pipeline)
    calls = 0

    def explode(batch: Sequence[FakeRecord], own: Any) -> list[Outcome]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("bug")
        return [Outcome.APPLIED] * len(batch)

    pipeline.script = explode
    feed(runner, 3, 2)
    await settle(runner)
    assert runner.workers[TPS[0]].task.done()
    assert isinstance(runner.workers[TPS[0]].task.exception(), RuntimeError)
    assert [runner.workers[tp].position for tp in TPS[1:]] == [2, 2]


async def test_no_lending_with_per_message_locks() -> None:
    """With ``lock_aggregates`` every run is one record: a lent batch could share nothing."""
    pipeline = Pipeline()
    runner = runner_with(pipeline)
    runner.deps = SimpleNamespace(config=runner.config, lock=object())  # type: ignore[assignment]
    feed(runner, 3, 2)
    await settle(runner)
    assert all(len(partitions_of(c)) == 1 and c[1] is None for c in pipeline.calls)
    await close(runner)


async def test_a_closing_lender_still_asks_for_the_lent_positions_to_be_committed() -> None:
    pipeline = Pipeline()
    runner = await held_batch(pipeline, 2, 2)
    lender = runner.workers[TPS[0]]
    closing = asyncio.create_task(lender.aclose())
    await asyncio.sleep(0)
    runner.commit_wanted.clear()
    pipeline.gate.set()
    await asyncio.wait_for(closing, 5)
    assert runner.workers[TPS[1]].position == 2
    assert runner.commit_wanted.is_set(), "the lent partition's new position gets committed"
    await close(runner)


async def test_a_short_outcome_list_is_a_bug_surfaced_not_a_loop() -> None:
    """Fewer outcomes than records without ABANDONED breaks the pipeline's contract: the
    worker fails (the fetch loop surfaces it) and the lent records go back, not round."""
    pipeline = Pipeline()
    runner = runner_with(pipeline)
    pipeline.script = lambda batch, own: (
        [Outcome.APPLIED] if own is not None else [Outcome.APPLIED] * len(batch)
    )
    feed(runner, 2, 2)
    await settle(runner)
    lender = runner.workers[TPS[0]]
    assert lender.task.done() and isinstance(lender.task.exception(), RuntimeError)
    assert runner.workers[TPS[1]].position == 2
