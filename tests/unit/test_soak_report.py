"""The soak report's pure parts: per-kind fault counts and the time buckets of the plot."""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal

from example_services.demo.checker import OrderRow
from example_services.soak.faults import FaultRecord
from example_services.soak.report import buckets, per_kind
from example_services.soak.schedule import PlannedFault

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def test_per_kind_counts_injected_failed_and_worst_recovery() -> None:
    plan = [
        PlannedFault(0, "relay-kill", 10, "proc:x", 3),
        PlannedFault(1, "relay-kill", 50, "proc:y", 3),
        PlannedFault(2, "pg-restart", 20, "pg-server", 8),
        PlannedFault(3, "duplicates", 30, "duplicates", 3),
    ]
    records = [
        FaultRecord(0, "relay-kill", {}, 10, ok=True),
        FaultRecord(1, "relay-kill", {}, 50, ok=True),
        FaultRecord(2, "pg-restart", {}, 20, ok=True),
        FaultRecord(3, "duplicates", {}, 30, ok=False, error="boom"),
    ]
    out = per_kind(plan, records, {0: 4.0, 1: 12.5, 2: None})
    assert out["relay-kill"] == {"planned": 2, "ok": 2, "failed": 0, "max_recovery_s": 12.5}
    assert out["pg-restart"]["max_recovery_s"] == "never"
    assert out["duplicates"] == {"planned": 1, "ok": 0, "failed": 1, "max_recovery_s": None}
    assert set(out) == {"relay-kill", "pg-restart", "duplicates"}


def test_buckets_count_per_second_and_latency_percentiles() -> None:
    def order(created_s: float, closed_s: float | None) -> OrderRow:
        closed = None if closed_s is None else T0 + dt.timedelta(seconds=closed_s)
        return OrderRow(
            uuid.uuid4(), "x", Decimal(1), "PAID", 2, T0 + dt.timedelta(seconds=created_s), closed
        )

    orders = [order(1, 1.1), order(2, 2.5), order(4, 4.3), order(3, 12), order(11, None)]
    rows = buckets(orders, T0.timestamp(), 10.0)["rows"]
    assert [r["t_s"] for r in rows] == [0.0, 10.0]
    assert rows[0]["created_per_s"] == 0.4 and rows[0]["closed_per_s"] == 0.3
    assert rows[1]["created_per_s"] == 0.1 and rows[1]["closed_per_s"] == 0.1
    assert round(rows[0]["latency_p50_ms"]) == 300 and round(rows[0]["latency_p99_ms"]) == 500
    assert round(rows[1]["latency_p50_ms"]) == 9000
