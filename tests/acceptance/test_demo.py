"""The demo end to end: real APIs, relays and consumers in subprocesses, real faults.

1. A small run with the process, Redis and delivery faults (kill -9 of a relay and a consumer,
   Redis stopped 10 s, duplicate Kafka deliveries) ends with every invariant holding: exit
   code 0 and a JSON summary saying so.
2. The checker is not vacuous: with the payment consumer swapped for a planted bug that skips
   the inbox (``LEDGERBOX_DEMO_PLANT_BUG=skip-inbox``) and duplicate deliveries, the demo
   exits 1 and names the broken invariant (a double debit breaks the wallet reconciliation).
3. What ``make demo`` adds: Kafka and PostgreSQL each restarted once (services.sh) while
   orders flow; every invariant holds, no daemon crashed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests._services import REPO_ROOT

pytestmark = pytest.mark.slow


def run_demo(
    tmp_path: Path,
    database_server_url: str,
    kafka_bootstrap: str,
    redis_url: str,
    *args: str,
    plant_bug: str | None = None,
) -> tuple[int, str, dict[str, Any]]:
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_server_url,
        KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
        REDIS_URL=redis_url,
    )
    env.pop("LEDGERBOX_DEMO_PLANT_BUG", None)
    if plant_bug is not None:
        env["LEDGERBOX_DEMO_PLANT_BUG"] = plant_bug
    results = tmp_path / "demo-results"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "example_services.demo"),
            *("--results-dir", str(results), "--cleanup", "always"),
            *("--run-id", f"t{uuid.uuid4().hex[:6]}"),
            *args,
        ],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 and plant_bug is None:
        # The process logs explain a failure; tmp_path may be gone by the time anyone looks.
        for log in sorted((results / "logs").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-30:]
            output += f"\n----- {log.name} (last 30 lines) -----\n" + "\n".join(tail)
    summary_file = results / "summary.json"
    assert summary_file.is_file(), f"no summary.json; demo output:\n{output}"
    return proc.returncode, output, json.loads(summary_file.read_text())


def test_demo_with_every_fault_keeps_every_invariant(
    tmp_path: Path,
    database_server_url: str,
    kafka_bootstrap: str,
    redis_url: str,
    services_script: str,
) -> None:
    code, output, summary = run_demo(
        tmp_path,
        database_server_url,
        kafka_bootstrap,
        redis_url,
        *("--orders", "200", "--customers", "10", "--concurrency", "16", "--seed", "11"),
        *("--faults", "relay,consumer,redis,duplicates", "--redis-outage-s", "10"),
    )
    assert code == 0, output
    assert summary["ok"] is True, output
    assert summary["failed_invariants"] == []
    names = {inv["name"] for inv in summary["invariants"] if inv["ok"]}
    assert {
        "orders_final",
        "orders_match_requests",
        "retries_returned_first",
        "one_payment_per_order",
        "order_matches_payment",
        "wallet_balance_reconciles",
        "balance_never_negative",
        "no_order_moved_backwards",
        "events_applied_in_order",
        "no_process_crashed",
    } <= names
    orders = summary["orders"]
    assert orders["created"] == 200 and orders["pending"] == 0
    assert orders["paid"] + orders["cancelled"] == 200
    assert orders["paid"] > 0 and orders["cancelled"] > 0, "some customers must run dry"
    kinds = sorted(f["fault"] for f in summary["faults"])
    assert kinds == ["duplicate deliveries", "kill -9 consumer", "kill -9 relay", "redis outage"]
    resent = next(f for f in summary["faults"] if f["fault"] == "duplicate deliveries")
    assert sum(resent["records"].values()) > 0
    assert summary["drain"]["drained"] is True
    assert summary["latency_ms"]["count"] == 200
    killed = [name for name, p in summary["processes"].items() if p["kills"]]
    assert len(killed) == 2 and all(p["crashes"] == [] for p in summary["processes"].values())


def test_demo_catches_a_planted_double_debit(
    tmp_path: Path, database_server_url: str, kafka_bootstrap: str, redis_url: str
) -> None:
    code, output, summary = run_demo(
        tmp_path,
        database_server_url,
        kafka_bootstrap,
        redis_url,
        *("--orders", "200", "--customers", "5", "--concurrency", "16", "--seed", "5"),
        *("--faults", "duplicates"),
        plant_bug="skip-inbox",
    )
    assert code == 1, output
    assert summary["ok"] is False
    assert "wallet_balance_reconciles" in summary["failed_invariants"], output
    assert "[FAIL] wallet_balance_reconciles" in output
    broken = next(i for i in summary["invariants"] if i["name"] == "wallet_balance_reconciles")
    assert broken["violations"] >= 1 and "difference -" in broken["examples"][0]


def test_demo_survives_a_kafka_and_a_postgres_restart(
    tmp_path: Path,
    database_server_url: str,
    kafka_bootstrap: str,
    redis_url: str,
    services_script: str,
) -> None:
    # What `make demo` adds to the four faults above: the broker and the database server are
    # each stopped and started once while orders flow; every daemon reconnects by itself.
    code, output, summary = run_demo(
        tmp_path,
        database_server_url,
        kafka_bootstrap,
        redis_url,
        *("--orders", "300", "--customers", "10", "--concurrency", "16", "--seed", "23"),
        *("--faults", "kafka,postgres"),
    )
    assert code == 0, output
    assert summary["failed_invariants"] == [], output
    assert sorted(f["fault"] for f in summary["faults"]) == ["kafka restart", "postgres restart"]
    assert all("error" not in f for f in summary["faults"]), summary["faults"]
    assert summary["orders"]["created"] == 300 and summary["orders"]["pending"] == 0
    assert summary["drain"]["drained"] is True
    assert all(p["crashes"] == [] for p in summary["processes"].values()), summary["processes"]
