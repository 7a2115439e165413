"""The relay's stop signal: set once by ``Relay.stop()``, seen by every loop."""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["StopSignal"]


class StopSignal:
    """Set once when the relay is asked to stop; :meth:`sleep` ends early when it is.

    Shared by the relay's loops (heartbeat, lanes, maintenance, wake-up) and their backoff
    pauses, so a stop never waits out a sleep.
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        """Ask every loop to finish (idempotent; safe from a signal handler in the loop)."""
        self._event.set()

    def is_set(self) -> bool:
        """True once :meth:`set` was called."""
        return self._event.is_set()

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` (negative counts as 0), but return at once when stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), max(0.0, seconds))
