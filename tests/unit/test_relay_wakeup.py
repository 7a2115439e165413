"""The relay's listener reads notifications only while a lane waits for one (or after a
bounded pause), so a stream of commits costs one read per batch, not one per commit
(relay._wakeup)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from ledgerbox._core.backoff import Backoff
from ledgerbox._core.faults import Fault
from ledgerbox._core.stop import StopSignal
from ledgerbox.relay._errors import StoreError
from ledgerbox.relay._wakeup import READ_PAUSE_MAX_S, WakeUp, WakeUpDeps


class QueueStore:
    """A listen connection fed by the test; counts how many notifications were pulled."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[None] = asyncio.Queue()
        self.pulled = 0

    async def notifications(self) -> AsyncIterator[None]:
        yield None  # LISTEN is active
        while True:
            await self.queue.get()
            self.pulled += 1
            yield None

    async def aclose(self) -> None:
        return None


async def _started(
    store: QueueStore, idle: asyncio.Event | None
) -> tuple[list[int], asyncio.Task[None]]:
    wakes: list[int] = []
    deps = WakeUpDeps(
        store=store,  # type: ignore[arg-type]
        wake_all=lambda: wakes.append(store.pulled),
        backoff=Backoff(),
        stop=StopSignal(),
        idle=idle,
    )
    task = asyncio.create_task(WakeUp(deps).run())
    for _ in range(5):
        await asyncio.sleep(0)
    return wakes, task


async def test_after_a_wake_up_nothing_is_read_until_a_lane_waits() -> None:
    store, idle = QueueStore(), asyncio.Event()
    wakes, task = await _started(store, idle)
    try:
        assert wakes == [0]  # LISTEN active: every lane claims once
        idle.set()  # a lane waits
        store.queue.put_nowait(None)
        for _ in range(5):
            await asyncio.sleep(0)
        assert wakes == [0, 1]
        for _ in range(20):  # commits while the lanes claim and publish
            store.queue.put_nowait(None)
        for _ in range(20):
            await asyncio.sleep(0)
        assert store.pulled == 1 and wakes == [0, 1]  # left in the socket meanwhile
        idle.set()  # a lane is idle again: read what came, wake it
        for _ in range(5):
            await asyncio.sleep(0)
        assert wakes == [0, 1, 2]
    finally:
        task.cancel()


async def test_the_pause_is_bounded_when_no_lane_ever_waits() -> None:
    store, idle = QueueStore(), asyncio.Event()
    wakes, task = await _started(store, idle)
    try:
        for _ in range(3):
            store.queue.put_nowait(None)
        # No lane ever idle: still read, one pause of READ_PAUSE_MAX_S after each wake-up.
        for _ in range(400):  # at most 100 pauses' worth
            if store.pulled == 3:
                break
            await asyncio.sleep(READ_PAUSE_MAX_S / 4)
        assert store.pulled == 3 and len(wakes) == 4
    finally:
        task.cancel()


async def test_without_an_idle_signal_every_notification_is_read_at_once() -> None:
    store = QueueStore()
    wakes, task = await _started(store, None)
    try:
        for _ in range(3):
            store.queue.put_nowait(None)
        for _ in range(10):
            await asyncio.sleep(0)
        assert store.pulled == 3 and len(wakes) == 4
    finally:
        task.cancel()


class FlakyStore:
    """A listen connection that drops ``failures`` times before LISTEN is active."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.attempts = 0
        self.active = asyncio.Event()

    async def notifications(self) -> AsyncIterator[None]:
        self.attempts += 1
        if self.attempts <= self.failures:
            raise StoreError(
                "listen failed: OperationalError: connection refused", fault=Fault.ENVIRONMENT
            )
        self.active.set()
        yield None
        await asyncio.Event().wait()  # LISTEN active, no commit

    async def aclose(self) -> None:
        return None


async def test_a_listen_outage_is_two_warning_lines_whatever_the_retries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before: one WARNING per retry (12 lines in 22 s of a PostgreSQL outage); docs/relay.md
    # "Health": each change of state is ONE WARNING line, the retries log at DEBUG.
    store = FlakyStore(failures=12)
    deps = WakeUpDeps(
        store=store,  # type: ignore[arg-type]
        wake_all=lambda: None,
        backoff=Backoff(base_s=0.001, max_s=0.001),
        stop=StopSignal(),
    )
    caplog.set_level(logging.DEBUG, logger="ledgerbox.relay")
    task = asyncio.create_task(WakeUp(deps).run())
    try:
        await asyncio.wait_for(store.active.wait(), 10)
        for _ in range(5):
            await asyncio.sleep(0)
    finally:
        task.cancel()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("LISTEN connection lost: listen failed: "), warnings
    assert warnings[1].startswith("LISTEN connection back after "), warnings
    retries = [r for r in caplog.records if r.levelno == logging.DEBUG and "LISTEN" in r.msg]
    assert len(retries) == 11  # the 2nd to the 12th failure
