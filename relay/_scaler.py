"""How many lanes the relay runs: a pure policy (no clock, no I/O; times are passed in).

The relay mostly waits on PostgreSQL and Kafka; its lanes (``RelayConfig.lanes`` concurrent
claim -> publish -> mark pipelines) overlap those waits. They follow the load: one lane runs
while the relay keeps up (lowest latency and database load: every extra lane would only
repeat claims and marks that find a row or two), all of them while claims come back full (a
backlog). The relay applies a change only between batches, after every running lane's
batch is confirmed and marked, so ``shard % lanes`` never moves a shard with rows in flight
(docs/relay.md, "Lanes"). Unit-tested in ``tests/unit/test_relay_scaler.py``.
"""

from __future__ import annotations

__all__ = ["SCALE_DOWN_AFTER_S", "LaneScaler"]

#: With several lanes configured, the relay runs them all while there is a backlog and goes
#: back to one lane once the lanes' claims stayed small for this long (seconds).
SCALE_DOWN_AFTER_S = 2.0


class LaneScaler:
    """Says how many lanes should run, from the size of each lane's claims.

    Up: all ``most`` lanes once one lane's claim comes back full (``batch_size`` rows, a
    backlog). Down: back to one once, for ``scale_down_after_s``, no lane claimed more than
    half a batch's share (``batch_size / (2 * running lanes)``: one lane would then claim at
    most half a batch per cycle). The gap between the two thresholds keeps a steady load from
    flipping the count.

    Parameters
    ----------
    most : int
        ``RelayConfig.lanes``: lanes configured (with 1 the count never changes).
    batch_size : int
        ``RelayConfig.batch_size``: rows per full claim.
    scale_down_after_s : float
        Seconds of small claims before going back to one lane (default 2).
    """

    def __init__(
        self, most: int, batch_size: int, *, scale_down_after_s: float = SCALE_DOWN_AFTER_S
    ) -> None:
        self.most = most
        self.batch_size = batch_size
        self.scale_down_after_s = scale_down_after_s
        self._last_busy = -float("inf")

    def lanes_for(self, claimed: int, *, running: int, now: float) -> int:
        """The lane count wanted after a lane claimed ``claimed`` rows while ``running``
        lanes ran, at monotonic time ``now`` (seconds); ``running`` means "no change".
        """
        if self.most == 1:
            return running
        if running == 1:
            if claimed >= self.batch_size:
                self._last_busy = now
                return self.most
            return running
        if claimed * 2 * running > self.batch_size:
            self._last_busy = now
            return running
        if now - self._last_busy > self.scale_down_after_s:
            return 1
        return running
