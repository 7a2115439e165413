"""RelayHealth: a part several lanes report stays down until each lane that failed recovered."""

from __future__ import annotations

import logging

import pytest

from ledgerbox.relay._health import RelayHealth


def test_a_part_reported_by_several_lanes_is_up_only_when_each_failing_lane_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two lanes' persists fail; the first recovers while the second still retries. Health
    said ok there (one shared part) and logged another down/ok pair at the second's next
    attempt (a review, 2026-12-05)."""
    caplog.set_level(logging.WARNING, logger="ledgerbox.relay")
    now = [0.0]
    health = RelayHealth("r1", lambda: now[0])
    health.down("persists", "permission denied", who=0)
    health.down("persists", "permission denied", who=1)
    health.up("persists", who=0)
    assert health.report().state == "down"
    health.down("persists", "permission denied", who=1)  # its next attempt
    now[0] = 3.0
    health.up("persists", who=1)
    assert health.report().state == "ok"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "relay r1 down: persists: permission denied",
        "relay r1: persists ok again after 3.0 s",
    ]
    # A part without reporters keeps its plain meaning.
    health.down("kafka", "unreachable")
    health.up("kafka")
    assert health.report().state == "ok"
