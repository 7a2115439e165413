"""``StopSignal``: the stop flag of the daemons and the bound it puts on waits for Kafka
(``stop_timeout_s``, docs/operations.md "Stopping a daemon")."""

from __future__ import annotations

import asyncio
import gc
import math
import time
from typing import TYPE_CHECKING

import pytest

from ledgerbox._core.stop import StopSignal

if TYPE_CHECKING:
    from ledgerbox.relay._producer import SharedProducer


async def test_bounded_returns_what_completes_in_time() -> None:
    stop = StopSignal(grace_s=0.05)

    async def answer() -> int:
        await asyncio.sleep(0.01)
        return 42

    assert await stop.bounded(answer(), math.inf) == 42
    assert stop.left_s() == math.inf  # not stopping: no grace running


async def test_bounded_gives_up_after_its_own_timeout_when_not_stopping() -> None:
    stop = StopSignal(grace_s=math.inf)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await stop.bounded(never, 0.05)
    assert never.cancelled()


async def test_a_stop_during_the_wait_ends_it_after_the_grace_period() -> None:
    stop = StopSignal(grace_s=0.2)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await stop.bounded(never, math.inf)
    took = time.monotonic() - started
    assert took >= 0.2, took  # 0.05 s until the stop, then the 0.2 s grace (a hang: timeout)
    assert never.cancelled()


async def test_the_grace_is_shared_by_the_waits_after_the_stop() -> None:
    stop = StopSignal(grace_s=0.1)
    stop.set()
    assert 0 < stop.left_s() <= 0.1
    with pytest.raises(TimeoutError):
        await stop.bounded(asyncio.sleep(10), math.inf)
    assert stop.left_s() == 0.0
    # Spent: a wait on something not done yet gives up at once, before it even starts ...
    started: list[bool] = []

    async def slow() -> None:
        started.append(True)
        await asyncio.sleep(10)

    with pytest.raises(TimeoutError):
        await stop.bounded(slow(), math.inf)
    await asyncio.sleep(0)
    assert started == []
    # ... but what is already done is still returned.
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    done.set_result(7)
    assert await stop.bounded(done, math.inf) == 7


async def test_a_cancelled_gather_leaves_no_unretrieved_exception(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stop = StopSignal(grace_s=0.0)
    stop.set()
    loop = asyncio.get_running_loop()
    pending = [loop.create_future() for _ in range(3)]
    with pytest.raises(TimeoutError):
        await stop.bounded(asyncio.gather(*pending, return_exceptions=True), math.inf)
    await asyncio.sleep(0)
    assert all(f.cancelled() for f in pending)
    del pending
    gc.collect()  # the loop reports an unretrieved exception when the future is collected
    assert "exception was never retrieved" not in caplog.text


async def test_sleep_ends_at_once_when_stopping() -> None:
    stop = StopSignal()
    asyncio.get_running_loop().call_later(0.02, stop.set)
    await stop.sleep(3600)  # returns at the stop (a hang fails by the test timeout)
    assert stop.is_set()


class _LegacyPublisher:
    """A Publisher written against ledgerbox 0.2: ``stop`` takes no ``timeout_s``."""

    def __init__(self, hang: bool) -> None:
        self.hang = hang
        self.stops: list[bool] = []

    async def start(self) -> None:
        return None

    async def stop(self, *, abort: bool = False) -> None:
        self.stops.append(abort)
        if self.hang:  # a broker away: its flush never ends
            await asyncio.Event().wait()


async def test_a_publisher_without_timeout_s_is_still_stopped_and_bounded() -> None:
    # 7154fcc added timeout_s to Publisher.stop(): a user's own Publisher without it raised
    # TypeError at every stop. It is called as before and bounded from outside.

    for hang, stopping in ((False, False), (True, True)):
        stop = StopSignal(grace_s=0.1)
        publisher = _LegacyPublisher(hang)
        producer = _shared(publisher, stop)
        assert await producer.ensure()
        if stopping:
            stop.set()
        await producer.stop(abort=True)  # a hang fails by the test timeout
        assert publisher.stops == [True]


class _UnansweredPublisher(_LegacyPublisher):
    """A broker that accepts the connection and never answers: start and check hang."""

    def __init__(self) -> None:
        super().__init__(hang=False)
        self.started = asyncio.Event()

    async def start(self) -> None:
        self.started.set()
        await asyncio.Event().wait()

    async def check(self) -> None:
        await asyncio.Event().wait()


async def test_a_producer_start_that_never_ends_is_given_up_at_the_stop_grace() -> None:
    # Before: a lane starting the producer against a broker that did not answer held the
    # relay's stop for the probe's and aiokafka's bootstrap timeouts (10 s + 30 s),
    # outside stop_timeout_s. Now it ends when the grace does, and is no failure.

    stop = StopSignal(grace_s=0.1)
    publisher = _UnansweredPublisher()
    producer = _shared(publisher, stop)
    ensure = asyncio.create_task(producer.ensure())
    await asyncio.wait_for(publisher.started.wait(), 5)
    stop.set()
    assert await asyncio.wait_for(ensure, 10) is False  # a hang fails here, not by a bound
    assert producer.failures == 0


def _shared(publisher: object, stop: StopSignal) -> SharedProducer:
    """The relay's shared producer over a test publisher (no Kafka)."""
    from ledgerbox._core.backoff import Backoff
    from ledgerbox.relay import RelayHooks
    from ledgerbox.relay._health import RelayHealth
    from ledgerbox.relay._producer import SharedProducer

    return SharedProducer(
        publisher,  # type: ignore[arg-type]
        backoff=Backoff(base_s=0.1, max_s=1.0),
        stop=stop,
        hooks=RelayHooks(),
        health=RelayHealth("r1", time.monotonic),
    )
