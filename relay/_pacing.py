"""How long a lane lingers before a claim: a pure policy (no clock, no I/O; times are passed
in; unit-tested in ``tests/unit/test_relay_pacing.py``).

Every committed transaction sends one NOTIFY; at 1,000 events/s a lane that claims on every
NOTIFY runs ~1,000 claims (and persists) per second, each finding a row or two: that is
most of the relay's CPU at moderate load. The pacer spaces the claims of a stream of
events: a claim starts at least the linger after the previous one started, so the events of
that interval arrive in one batch. No wait when the previous claim started longer ago than
that (a lone event after a quiet spell goes out at once) or came back full (a backlog:
claims follow each other anyway).

The linger follows the lane's event rate: ``linger_s * min(1, rate / FULL_LINGER_RATE)``,
where ``rate`` is the rows per second its claims found (a moving average over claims) and
``linger_s`` the bound (``RelayConfig.claim_linger_ms``, default 20 ms). At 100 events/s a
claim waits at most 2 ms, at 1,000 events/s up to 20 ms. Measured at 1,000 events/s
(docs/performance.md, "The claim linger follows the rate"): a fixed 5 ms linger gave ~5
events per claim, ~220 us of relay CPU per event and small Kafka batches that reached the
consumer as small transactions (consumer hop p50 31-39 ms on the saturated 2-core machine);
the rate-following 20 ms bound gave ~100 us, consumer hop p50 8 ms and end-to-end p50 20 ms,
p99 37 ms instead of 33 / 95-100 ms: the batch the relay forms is the batch every later stage
works with.
"""

from __future__ import annotations

__all__ = ["FULL_LINGER_RATE", "ClaimPacer"]

#: Events per second (of one lane) at and above which a claim lingers the whole bound.
FULL_LINGER_RATE = 1000.0

#: Weight of the newest claim in the rate's moving average (~10 claims of memory).
_RATE_WEIGHT = 0.2


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
        self._previous_start = -float("inf")
        self._last_full = False
        self._rate = 0.0

    @property
    def rate(self) -> float:
        """The lane's event rate as its claims saw it, in rows per second (moving average)."""
        return self._rate

    def linger_for_rate_s(self) -> float:
        """The linger at the current rate, in seconds: ``linger_s`` scaled by
        ``rate / FULL_LINGER_RATE``, at most ``linger_s``."""
        return self.linger_s * min(1.0, self._rate / FULL_LINGER_RATE)

    def delay_s(self, now: float) -> float:
        """Seconds to wait at monotonic time ``now`` (seconds) before a claim begins."""
        if self.linger_s <= 0 or self._last_full:
            return 0.0
        return max(0.0, self._last_start + self.linger_for_rate_s() - now)

    def started(self, now: float) -> None:
        """A claim began at ``now``."""
        self._previous_start, self._last_start = self._last_start, now

    def claimed(self, rows: int) -> None:
        """The claim that began last returned ``rows`` rows: what committed since the claim
        before it began, so ``rows`` over that interval is the rate it saw. Not after a full
        claim: that one left rows behind, so this one's rows are older too (the backlog's
        drain speed, not the rate events commit at) and the rate stays as it was."""
        after_full, self._last_full = self._last_full, rows >= self.batch_size
        interval = self._last_start - self._previous_start
        if not after_full and interval > 0 and interval != float("inf"):
            self._rate += _RATE_WEIGHT * (rows / interval - self._rate)
