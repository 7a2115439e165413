"""Claim pacing (``relay._pacing``): claims of a stream spaced by a linger that follows the
lane's event rate, none lost time after a quiet spell or under a backlog."""

from __future__ import annotations

import pytest

from ledgerbox.relay._pacing import FULL_LINGER_RATE, ClaimPacer


def _stream(pacer: ClaimPacer, rate: float, claims: int, start: float = 100.0) -> float:
    """``claims`` claims of a steady stream of ``rate`` events/s: a NOTIFY wakes the lane at
    each event, the claim begins when the pacer allows and takes every event committed since
    the previous claim began. Returns the time the last claim began."""
    step = 1 / rate
    pending, claimed_at, next_event = 0, start, start + step
    pacer.started(start)
    pacer.claimed(0)
    for _ in range(claims):
        woken = next_event  # the first event after the previous claim wakes the lane
        begin = woken + pacer.delay_s(woken)
        while next_event <= begin:  # every event committed before the claim begins
            pending += 1
            next_event += step
        pacer.started(begin)
        pacer.claimed(pending)
        pending, claimed_at = 0, begin
    return claimed_at


def test_a_lone_event_after_a_quiet_spell_is_claimed_at_once() -> None:
    pacer = ClaimPacer(0.020, 1000)
    assert pacer.delay_s(100.0) == 0.0, "nothing claimed yet"
    pacer.started(100.0)
    pacer.claimed(1)
    assert pacer.delay_s(100.001) == 0.0, "no rate yet: no linger"
    pacer.started(160.0)  # a minute later
    pacer.claimed(1)
    assert pacer.rate < 1
    assert pacer.delay_s(160.001) < 0.0001, "one event a minute lingers nothing measurable"


def test_at_a_high_rate_claims_are_spaced_by_the_whole_bound() -> None:
    pacer = ClaimPacer(0.020, 1000)
    last = _stream(pacer, 2 * FULL_LINGER_RATE, claims=60)
    assert pacer.rate == pytest.approx(2 * FULL_LINGER_RATE, rel=0.1)
    assert pacer.linger_for_rate_s() == pytest.approx(0.020)
    assert pacer.delay_s(last + 0.005) == pytest.approx(0.015)
    assert 0 <= pacer.delay_s(last) <= 0.020, "bounded by claim_linger_ms"


def test_the_linger_scales_with_the_rate_below_full() -> None:
    slow, busy = ClaimPacer(0.020, 1000), ClaimPacer(0.020, 1000)
    _stream(slow, 100.0, claims=80)
    _stream(busy, 500.0, claims=80)
    assert slow.linger_for_rate_s() == pytest.approx(0.002, rel=0.25), "100/s: ~2 ms"
    assert busy.linger_for_rate_s() == pytest.approx(0.010, rel=0.25), "500/s: ~10 ms"


def test_the_linger_shrinks_again_when_the_stream_slows() -> None:
    pacer = ClaimPacer(0.020, 1000)
    last = _stream(pacer, 2000.0, claims=40)
    assert pacer.linger_for_rate_s() == pytest.approx(0.020)
    _stream(pacer, 50.0, claims=40, start=last + 1.0)
    assert pacer.linger_for_rate_s() < 0.002


def test_a_full_claim_is_followed_at_once_and_zero_disables_it() -> None:
    pacer = ClaimPacer(0.020, 1000)
    last = _stream(pacer, 2000.0, claims=40)
    pacer.started(last + 0.020)
    pacer.claimed(1000)
    assert pacer.delay_s(last + 0.021) == 0.0, "a backlog: claims follow each other"
    off = ClaimPacer(0.0, 1000)
    _stream(off, 2000.0, claims=10)
    assert off.delay_s(200.0) == 0.0


def test_after_a_backlog_the_linger_is_the_stream_rate_not_the_drain_rate() -> None:
    """A claim that follows a full claim finds rows older than the claim before it began (the
    backlog's rest): its rows over the interval are the relay's drain speed (~65,000 rows/s
    here), not the rate events commit at. Counted, they kept the whole 20 ms linger for a
    100 events/s stream for ~35 claims (~0.5 s, 12 ms mean wait) after every backlog."""
    pacer = ClaimPacer(0.020, 1000)
    last = _stream(pacer, 100.0, claims=80)
    steady = pacer.linger_for_rate_s()
    assert steady == pytest.approx(0.002, rel=0.25)
    now = last + 5.0  # an outage: a backlog drains in full claims 15 ms apart
    for _ in range(20):
        pacer.started(now)
        pacer.claimed(1000)
        now += 0.015
    pacer.started(now)
    pacer.claimed(300)  # the backlog's rest: the first partial claim
    assert pacer.linger_for_rate_s() == pytest.approx(steady, rel=0.25)
    _stream(pacer, 100.0, claims=3, start=now + 0.010)
    assert pacer.linger_for_rate_s() == pytest.approx(0.002, rel=0.25)
