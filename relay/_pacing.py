"""How long a lane lingers before a claim: a pure policy (no clock, no I/O; times are passed
in; unit-tested in ``tests/unit/test_relay_pacing.py``).

Every committed transaction sends one NOTIFY; at 1,000 events/s a lane that claims on every
NOTIFY runs ~1,000 claims (and persists) per second, each finding a row or two: that is
most of the relay's CPU at moderate load. The pacer spaces the claims of a stream of
events: a claim starts at least ``linger_s`` after the previous one started, so the events
of that interval arrive in one batch. It is adaptive: no wait when the previous claim
started longer ago than that (a lone event after a quiet spell goes out at once) or came
back full (a backlog: claims follow each other anyway). Bounded by ``linger_s``
(``RelayConfig.claim_linger_ms``, default 5 ms; docs/relay.md, "Wake-up and pacing").
"""

from __future__ import annotations

__all__ = ["ClaimPacer"]


class ClaimPacer:
    """Says how long to wait before the next claim.

    Parameters
    ----------
    linger_s : float
        Most a claim waits, in seconds (0: never).
    batch_size : int
        Rows of a full claim.
    """

    def __init__(self, linger_s: float, batch_size: int) -> None:
        self.linger_s = linger_s
        self.batch_size = batch_size
        self._last_start = -float("inf")
        self._last_full = False

    def delay_s(self, now: float) -> float:
        """Seconds to wait at monotonic time ``now`` (seconds) before a claim begins."""
        if self.linger_s <= 0 or self._last_full:
            return 0.0
        return max(0.0, self._last_start + self.linger_s - now)

    def started(self, now: float) -> None:
        """A claim began at ``now``."""
        self._last_start = now

    def claimed(self, rows: int) -> None:
        """The claim that began last returned ``rows`` rows."""
        self._last_full = rows >= self.batch_size
