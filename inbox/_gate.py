"""The Redis circuit: Redis is used while it answers and skipped while it does not (G6, C12).

The first failure of an outage is logged once (WARNING) and flips the
``ledgerbox_inbox_redis_degraded`` gauge to 1; calls are then skipped (their fallback value
is used) until ``probe_interval_s`` has passed, when the next call or :meth:`probe` tries
again. The first success logs the recovery once and flips the gauge back to 0. No restart is
ever needed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ledgerbox.inbox._errors import RedisUnavailableError
from ledgerbox.inbox._metrics import REDIS_DEGRADED

__all__ = ["RedisGate"]

T = TypeVar("T")
_log = logging.getLogger("ledgerbox.inbox")


class RedisGate:
    """Degradation state of one consumer's Redis edges.

    Parameters
    ----------
    group : str
        Consumer group (metric label).
    probe_interval_s : float
        While degraded, calls are skipped for this long after each failure, in seconds.
    clock : Callable[[], float]
        Monotonic clock in seconds (injectable for tests).
    """

    def __init__(
        self,
        group: str,
        probe_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.group = group
        self.probe_interval_s = probe_interval_s
        self.clock = clock
        self.degraded = False
        self._retry_at = 0.0
        self.outages = 0
        #: Called after each change of :attr:`degraded` (the consumer's health listens).
        self.on_change: Callable[[], None] | None = None
        REDIS_DEGRADED.labels(group).set(0)

    def usable(self) -> bool:
        """False while a recent failure says Redis is down and it is not yet time to probe."""
        return not self.degraded or self.clock() >= self._retry_at

    async def call(self, fn: Callable[[], Awaitable[T]], fallback: T) -> T:
        """``await fn()``, or ``fallback`` if Redis is skipped or fails."""
        if not self.usable():
            return fallback
        try:
            result = await fn()
        except RedisUnavailableError as exc:
            self.failed(exc)
            return fallback
        self.succeeded()
        return result

    def failed(self, exc: BaseException) -> None:
        """Record a failure; the first of an outage is logged."""
        self._retry_at = self.clock() + self.probe_interval_s
        if not self.degraded:
            self.degraded = True
            self.outages += 1
            REDIS_DEGRADED.labels(self.group).set(1)
            _log.warning(
                "redis unavailable, consumer group %s continues on the database alone "
                "(dedup hints and aggregate locks off until it answers): %s",
                self.group,
                exc,
            )
            if self.on_change is not None:
                self.on_change()

    def succeeded(self) -> None:
        """Record a success; ends an outage."""
        if self.degraded:
            self.degraded = False
            REDIS_DEGRADED.labels(self.group).set(0)
            _log.warning("redis reachable again, consumer group %s uses it again", self.group)
            if self.on_change is not None:
                self.on_change()

    async def probe(self, ping: Callable[[], Awaitable[None]]) -> None:
        """While degraded and due, try ``ping`` so that health recovers without traffic."""
        if self.degraded and self.usable():
            await self.call(ping, None)
