"""A daemon's stop signal: set once by ``Relay.stop()`` (``InboxConsumer.stop()``), seen by
every loop; it also carries the stop's deadline for what waits on Kafka (``stop_timeout_s``
of ``RelayConfig`` and ``ConsumerConfig``, docs/operations.md "Stopping a daemon")."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

__all__ = ["StopSignal", "cancel_unawaited"]

_T = TypeVar("_T")


class StopSignal:
    """Set once when the daemon is asked to stop; :meth:`sleep` ends early when it is.

    Shared by the daemon's loops (the relay's heartbeat, lanes, maintenance, wake-up; the
    consumer's offset commits) and their backoff pauses, so a stop never waits out a sleep.
    From :meth:`set` on, what waits on Kafka (delivery confirmations, the producer's flush,
    offset commits) waits at most ``grace_s`` more in all (:meth:`left_s`, :meth:`bounded`):
    a broker that is away cannot hold a stop past it.

    Parameters
    ----------
    grace_s : float
        Seconds from :meth:`set` until the waits on Kafka give up (default: never).
    """

    def __init__(self, grace_s: float = math.inf) -> None:
        self._event = asyncio.Event()
        self._grace_s = grace_s
        self._deadline = math.inf  # time.monotonic(); set with the event

    def set(self) -> None:
        """Ask every loop to finish (idempotent; safe from a signal handler in the loop).
        The first call starts the grace period."""
        if not self._event.is_set():
            self._deadline = time.monotonic() + self._grace_s
        self._event.set()

    def is_set(self) -> bool:
        """True once :meth:`set` was called."""
        return self._event.is_set()

    def left_s(self) -> float:
        """Seconds left of the grace period (``inf`` until :meth:`set`; never negative)."""
        if not self._event.is_set():
            return math.inf
        return max(0.0, self._deadline - time.monotonic())

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` (negative counts as 0), but return at once when stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), max(0.0, seconds))

    async def bounded(self, awaitable: Awaitable[_T], timeout_s: float) -> _T:
        """Await ``awaitable`` for at most ``timeout_s`` seconds, and, once stopping (also
        when the stop comes during the wait), no longer than the grace period lasts.

        Raises
        ------
        TimeoutError
            Either bound passed first; ``awaitable`` is then cancelled.
        """
        task = asyncio.ensure_future(awaitable)
        end = time.monotonic() + timeout_s
        try:
            while not task.done():
                left = min(end - time.monotonic(), self.left_s())
                if left <= 0:
                    raise TimeoutError
                waits: set[asyncio.Future[Any]] = {task}
                stopping: asyncio.Future[Any] | None = None
                if not self._event.is_set():
                    stopping = asyncio.ensure_future(self._event.wait())
                    waits.add(stopping)
                try:
                    await asyncio.wait(
                        waits,
                        timeout=None if left == math.inf else left,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    if stopping is not None:
                        stopping.cancel()
            return task.result()
        finally:
            cancel_unawaited(task)


def cancel_unawaited(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` unless it is done, without awaiting it. What it still ends with (a
    gather cancelled this way finishes with an exception nobody awaits) is retrieved, so
    asyncio logs no "exception was never retrieved"."""
    if not task.done():
        task.cancel()
        task.add_done_callback(_retrieve)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
