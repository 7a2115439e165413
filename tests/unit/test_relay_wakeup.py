"""The relay's listener reads notifications only while a lane waits for one (or after a
bounded pause), so a stream of commits costs one read per batch, not one per commit
(relay._wakeup)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ledgerbox._core.backoff import Backoff
from ledgerbox._core.stop import StopSignal
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
