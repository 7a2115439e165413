"""Claim pacing (``relay._pacing``): one claim per linger interval in a stream, none lost
time after a quiet spell or under a backlog."""

from __future__ import annotations

import pytest

from ledgerbox.relay._pacing import ClaimPacer


def test_a_lone_event_after_a_quiet_spell_is_claimed_at_once() -> None:
    pacer = ClaimPacer(0.005, 1000)
    assert pacer.delay_s(100.0) == 0.0, "nothing claimed yet"
    pacer.started(100.0)
    pacer.claimed(1)
    assert pacer.delay_s(100.010) == 0.0, "the previous claim began longer ago than 5 ms"


def test_in_a_stream_claims_are_spaced_by_the_linger_at_most() -> None:
    pacer = ClaimPacer(0.005, 1000)
    pacer.started(100.0)
    pacer.claimed(3)
    assert pacer.delay_s(100.001) == pytest.approx(0.004)
    assert pacer.delay_s(100.0049) == pytest.approx(0.0001)
    assert 0 <= pacer.delay_s(100.001) <= 0.005, "bounded by the linger"


def test_a_full_claim_is_followed_at_once_and_zero_disables_it() -> None:
    pacer = ClaimPacer(0.005, 1000)
    pacer.started(100.0)
    pacer.claimed(1000)
    assert pacer.delay_s(100.001) == 0.0, "a backlog: claims follow each other"
    off = ClaimPacer(0.0, 1000)
    off.started(100.0)
    off.claimed(1)
    assert off.delay_s(100.001) == 0.0
