"""When the inbox reads Redis before the database, and how "done" hints are written after the
commit without making a batch wait (inbox._hints)."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from ledgerbox.inbox._gate import RedisGate
from ledgerbox.inbox._hints import DoneHintWriter, HintPolicy
from ledgerbox.inbox.testing import InMemoryDedupStore, ManualClock


def test_a_partition_new_to_the_consumer_reads_the_hints() -> None:
    policy = HintPolicy()
    assert policy.consult("t", 0, 0)
    assert policy.consult("t", 0, 500)  # assigned mid-log: the previous owner's records


def test_records_that_continue_the_previous_batch_go_to_the_database_alone() -> None:
    policy = HintPolicy()
    policy.observe("t", 0, last_offset=9, duplicate=False)
    assert not policy.consult("t", 0, 10)
    policy.observe("t", 0, last_offset=15, duplicate=False)
    assert not policy.consult("t", 0, 16)


def test_a_jump_or_a_rewind_reads_the_hints() -> None:
    policy = HintPolicy()
    policy.observe("t", 0, last_offset=9, duplicate=False)
    assert policy.consult("t", 0, 5)  # sought back / redelivered after a rebalance
    assert policy.consult("t", 0, 40)  # the partition went away and came back


def test_a_duplicate_makes_the_next_batch_read_the_hints_until_one_is_clean() -> None:
    policy = HintPolicy()
    policy.observe("t", 0, last_offset=9, duplicate=True)  # a copy from the relay
    assert policy.consult("t", 0, 10)
    policy.observe("t", 0, last_offset=19, duplicate=True)
    assert policy.consult("t", 0, 20)
    policy.observe("t", 0, last_offset=29, duplicate=False)
    assert not policy.consult("t", 0, 30)


def test_partitions_and_topics_are_apart() -> None:
    policy = HintPolicy()
    policy.observe("t", 0, last_offset=9, duplicate=False)
    assert policy.consult("t", 1, 10)
    assert policy.consult("u", 0, 10)
    assert not policy.consult("t", 0, 10)


class _SlowStore(InMemoryDedupStore):
    """Counts mark_done_many calls; each waits until released."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[uuid.UUID]] = []
        self.release = asyncio.Event()

    async def mark_done_many(self, group: str, event_ids: list[uuid.UUID], ttl_s: float) -> None:
        self.calls.append(list(event_ids))
        await self.release.wait()
        await super().mark_done_many(group, event_ids, ttl_s)


async def test_hints_are_written_in_the_background_and_coalesced() -> None:
    store = _SlowStore()
    writer = DoneHintWriter(store, RedisGate("g", 1.0), "g", ttl_s=60)
    first = [uuid.uuid4() for _ in range(3)]
    writer.add(first)  # returns at once: the batch does not wait
    await asyncio.sleep(0)
    assert store.calls == [first]
    later = [[uuid.uuid4()], [uuid.uuid4(), uuid.uuid4()]]
    for ids in later:
        writer.add(ids)  # while the first write is in flight
    assert len(store.calls) == 1  # at most one write at a time
    store.release.set()
    await writer.flush()
    assert store.calls == [first, later[0] + later[1]]  # everything waiting in ONE write
    for event in first + later[0] + later[1]:
        assert await store.is_done("g", event)


async def test_the_oldest_waiting_hints_are_dropped_beyond_the_cap() -> None:
    store = _SlowStore()
    writer = DoneHintWriter(store, RedisGate("g", 1.0), "g", ttl_s=60, max_pending=4)
    writer.add([uuid.uuid4()])
    await asyncio.sleep(0)  # the first write is in flight
    ids = [uuid.uuid4() for _ in range(6)]
    writer.add(ids)
    store.release.set()
    await writer.flush()
    assert store.calls[1] == ids[-4:]


async def test_redis_down_costs_the_hints_only() -> None:
    clock = ManualClock()
    store = InMemoryDedupStore(clock)
    store.available = False
    gate = RedisGate("g", probe_interval_s=1.0, clock=clock)
    writer = DoneHintWriter(store, gate, "g", ttl_s=60)
    event = uuid.uuid4()
    writer.add([event])
    await writer.flush()  # no exception reaches the consumer
    assert gate.degraded
    store.available = True
    clock.advance(1.0)
    assert not await store.is_done("g", event)  # lost: the database still decides
    writer.add([event])
    await writer.flush()
    assert await store.is_done("g", event) and not gate.degraded


async def test_flush_gives_up_after_its_timeout() -> None:
    store = _SlowStore()  # never released
    writer = DoneHintWriter(store, RedisGate("g", 1.0), "g", ttl_s=60)
    writer.add([uuid.uuid4()])
    await writer.flush(timeout_s=0.05)
    assert len(store.calls) == 1
    assert not await store.is_done("g", store.calls[0][0])


async def test_a_store_bug_is_logged_once_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(InMemoryDedupStore):
        async def mark_done_many(self, group: str, ids: list[uuid.UUID], ttl_s: float) -> None:
            raise RuntimeError("boom")

    writer = DoneHintWriter(Broken(), RedisGate("g", 1.0), "g", ttl_s=60)
    with caplog.at_level(logging.WARNING, logger="ledgerbox.inbox"):
        writer.add([uuid.uuid4()])
        await writer.flush()
        writer.add([uuid.uuid4()])
        await writer.flush()  # no exception reaches the consumer
    warnings = [r.getMessage() for r in caplog.records if "done hints" in r.getMessage()]
    assert len(warnings) == 1 and "boom" in warnings[0]
