"""The relay's health: ``ok`` or ``down`` with the cause, one log line per change of state.

Each part of the relay that can fail for a reason outside the relay (Kafka, the database)
reports it here. The relay is ``down`` while any part is down; the cause is the oldest
outage's one-line description. Retries themselves are logged at DEBUG only: a broker outage of
an hour is two WARNING lines (down, ok again), not one per second (docs/relay.md, "Health").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ledgerbox.relay import _metrics as m

__all__ = ["HealthReport", "RelayHealth"]

log = logging.getLogger("ledgerbox.relay")

#: Who reports: the producer ("kafka"), the heartbeat ("leases": the lease and member
#: tables) and the lanes ("claims": the outbox table; "persists": writing the cursors, dead
#: and held rows after Kafka confirmed a batch; "shards": shards refused after a restore,
#: until `relay rebase`). Each reports its own state, so one part
#: working never hides another one failing (claims that work while every persist fails
#: left the lane stuck with health ok: an adversarial review, 2026-12-05).
Part = Literal["kafka", "leases", "claims", "persists", "shards"]


@dataclass(frozen=True, slots=True)
class HealthReport:
    """A snapshot of the relay's health.

    Attributes
    ----------
    state : {"ok", "down"}
    cause : str | None
        One line naming what is down and why (``None`` when ok), e.g. ``"kafka: producer
        start failed: KafkaConnectionError: Unable to bootstrap from ..."``.
    down_for_s : float
        Seconds since the oldest outage began (0 when ok).
    """

    state: Literal["ok", "down"]
    cause: str | None
    down_for_s: float


class RelayHealth:
    """Which parts are down since when, and why.

    Parameters
    ----------
    relay_id : str
        Named in the log lines.
    clock : Callable[[], float]
        Monotonic clock in seconds.
    """

    def __init__(self, relay_id: str, clock: Callable[[], float]) -> None:
        self._relay_id = relay_id
        self._clock = clock
        self._down: dict[Part, tuple[float, str]] = {}
        self._failing: dict[Part, set[object]] = {}
        m.UP.set(1)

    def down(self, part: Part, cause: str, *, who: object = None) -> None:
        """``part`` failed with ``cause``; logs once when the part goes down (WARNING).
        ``who``: one of several reporters of the part (a lane): the part stays down until
        each of them that reported a failure reported :meth:`up`."""
        if who is not None:
            self._failing.setdefault(part, set()).add(who)
        if part in self._down:
            since, _ = self._down[part]
            self._down[part] = (since, cause)
            log.debug("%s still down: %s", part, cause)
            return
        self._down[part] = (self._clock(), cause)
        m.UP.set(0)
        log.warning("relay %s down: %s: %s", self._relay_id, part, cause)

    def up(self, part: Part, *, who: object = None) -> None:
        """``part`` works again; logs once when it comes back (WARNING, with the duration).
        With ``who``: only once no other reporter of the part is still failing."""
        if who is not None:
            failing = self._failing.get(part, set())
            failing.discard(who)
            if failing:
                return
        outage = self._down.pop(part, None)
        if outage is None:
            return
        if not self._down:
            m.UP.set(1)
        log.warning(
            "relay %s: %s ok again after %.1f s",
            self._relay_id,
            part,
            self._clock() - outage[0],
        )

    def now(self) -> float:
        """The monotonic clock's reading, in seconds."""
        return self._clock()

    def down_for_s(self, part: Part) -> float:
        """Seconds ``part`` has been down (0 when it is up)."""
        outage = self._down.get(part)
        return 0.0 if outage is None else self._clock() - outage[0]

    def report(self) -> HealthReport:
        """The current state and, when down, the oldest outage's cause."""
        if not self._down:
            return HealthReport("ok", None, 0.0)
        part, (since, cause) = min(self._down.items(), key=lambda item: item[1][0])
        return HealthReport("down", f"{part}: {cause}", self._clock() - since)
