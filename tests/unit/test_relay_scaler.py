"""The lane scaler: a pure policy (claims and monotonic times in, a lane count out)."""

from __future__ import annotations

from ledgerbox.relay._scaler import SCALE_DOWN_AFTER_S, LaneScaler


def test_lane_count_has_hysteresis_so_a_steady_load_does_not_flip_it() -> None:
    """Up when one lane's claim is full; down only after 2 s in which no lane claimed more
    than half a batch's share (a steady load between the two keeps its lane count)."""
    scaler = LaneScaler(most=8, batch_size=1000)
    assert scaler.lanes_for(999, running=1, now=0.0) == 1, "below a full batch: one lane"
    assert scaler.lanes_for(1000, running=1, now=0.0) == 8, "a full claim brings every lane in"
    now = 0.0
    for _ in range(50):  # 1,000/16 = 62.5: 63 rows per lane claim is still busy
        now += 0.5
        assert scaler.lanes_for(63, running=8, now=now) == 8
    for _ in range(4):
        now += 0.5
        assert scaler.lanes_for(62, running=8, now=now) == 8, "not before 2 s"
    now += 0.5
    assert scaler.lanes_for(62, running=8, now=now) == 1


def test_a_single_configured_lane_never_changes() -> None:
    scaler = LaneScaler(most=1, batch_size=10)
    assert scaler.lanes_for(10, running=1, now=0.0) == 1
    assert scaler.lanes_for(0, running=1, now=100.0) == 1


def test_scale_down_counts_from_the_last_busy_claim_not_from_the_start() -> None:
    scaler = LaneScaler(most=4, batch_size=100)
    assert scaler.lanes_for(100, running=1, now=10.0) == 4  # busy at t=10
    # 100 / (2 * 4) = 12.5: 13 rows is busy, 12 is small
    assert scaler.lanes_for(13, running=4, now=11.5) == 4  # busy again at t=11.5
    assert scaler.lanes_for(12, running=4, now=11.5 + SCALE_DOWN_AFTER_S) == 4
    assert scaler.lanes_for(0, running=4, now=11.5 + SCALE_DOWN_AFTER_S + 0.01) == 1


def test_the_down_threshold_scales_with_the_running_lanes() -> None:
    """With 2 lanes a claim of 30 of 100 is busy (30 * 2 * 2 > 100); with 4 it is small
    only below 12.5 rows."""
    two = LaneScaler(most=2, batch_size=100, scale_down_after_s=1.0)
    two.lanes_for(100, running=1, now=0.0)
    assert two.lanes_for(30, running=2, now=5.0) == 2, "busy: resets the timer"
    assert two.lanes_for(25, running=2, now=5.5) == 2, "25 * 2 * 2 = 100: not above"
    assert two.lanes_for(25, running=2, now=6.1) == 1


def test_a_custom_scale_down_delay() -> None:
    scaler = LaneScaler(most=3, batch_size=10, scale_down_after_s=0.0)
    assert scaler.lanes_for(10, running=1, now=1.0) == 3
    assert scaler.lanes_for(0, running=3, now=1.0) == 3, "not strictly after the delay"
    assert scaler.lanes_for(0, running=3, now=1.001) == 1
