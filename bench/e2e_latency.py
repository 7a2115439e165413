"""End-to-end latency: producer COMMIT -> the consumer handler's transaction committed.

A producer process commits one event per transaction at a steady rate (default 1,000 events/s
for 60 s, in two producer processes); a relay process publishes them; an inbox consumer process
applies them, stamping the time in its transaction. Both stamps come from one clock (this
machine's). Reported: p50 / p99 / max in ms per round and their medians over rounds.
Targets: ``e2e_p50_ms <= 10``, ``e2e_p99_ms <= 50``.

Environment knobs (for quick runs): ``BENCH_E2E_RATE``, ``BENCH_E2E_DURATION_S``,
``BENCH_E2E_ROUNDS``, ``BENCH_E2E_PRODUCERS``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench._common import fresh_database, kafka_bootstrap, median, write_result

RATE = float(os.environ.get("BENCH_E2E_RATE", "1000"))
DURATION_S = float(os.environ.get("BENCH_E2E_DURATION_S", "60"))
ROUNDS = int(os.environ.get("BENCH_E2E_ROUNDS", "3"))
PRODUCERS = int(os.environ.get("BENCH_E2E_PRODUCERS", "2"))


async def _create_topic(name: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=3, replication_factor=1)])
    finally:
        await admin.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _wait_applied(engine: sa.Engine, expected: int, deadline_s: float) -> int:
    end = time.monotonic() + deadline_s
    count = 0
    while time.monotonic() < end:
        with engine.connect() as conn:
            count = int(conn.execute(sa.text("SELECT count(*) FROM e2e_applied")).scalar_one())
        if count >= expected:
            break
        time.sleep(0.5)
    return count


def _round(rate: float, duration_s: float) -> dict[str, float]:
    topic = f"bench-e2e-{uuid.uuid4().hex[:8]}"
    asyncio.run(_create_topic(topic))
    with fresh_database("bench_e2e") as url, tempfile.TemporaryDirectory() as tmp:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "CREATE TABLE e2e_applied (event_id uuid PRIMARY KEY, applied_at timestamptz)"
                )
            )
        env = {
            **os.environ,
            "DATABASE_URL": url,
            "E2E_DATABASE_URL": url,
            "E2E_TOPIC": topic,
            "E2E_GROUP": f"e2e-{uuid.uuid4().hex[:8]}",
        }
        logs = Path(tmp)
        daemons = [
            subprocess.Popen(
                [sys.executable, "-m", "relay", "run", "--poll-interval-s", "1"],
                env=env,
                stdout=(logs / "relay.log").open("w"),
                stderr=subprocess.STDOUT,
            ),
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "inbox",
                    "run",
                    "--app",
                    "bench._e2e_consumer:make_consumer",
                ],
                env=env,
                stdout=(logs / "consumer.log").open("w"),
                stderr=subprocess.STDOUT,
            ),
        ]
        try:
            # Warm-up: one second of traffic, fully applied, so connections, leases and the
            # consumer group are settled before the measured run.
            warm = logs / "warm.json"
            subprocess.run(
                [sys.executable, "-m", "bench._e2e_producer", url, topic, "100", "1", str(warm)],
                env=env,
                check=True,
            )
            if _wait_applied(engine, 100, 90) < 100:
                raise RuntimeError(f"warm-up not applied; see {logs}")
            outs = [logs / f"committed-{i}.json" for i in range(PRODUCERS)]
            producers = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench._e2e_producer",
                        url,
                        topic,
                        str(rate / PRODUCERS),
                        str(duration_s),
                        str(out),
                    ],
                    env=env,
                )
                for out in outs
            ]
            for producer in producers:
                if producer.wait() != 0:
                    raise RuntimeError("a producer failed")
            committed: dict[str, float] = {}
            for out in outs:
                committed.update(json.loads(out.read_text()))
            expected = 100 + len(committed)
            applied_count = _wait_applied(engine, expected, 120)
            with engine.connect() as conn:
                rows = conn.execute(
                    sa.text(
                        "SELECT event_id::text, extract(epoch FROM applied_at) FROM e2e_applied"
                    )
                ).all()
        finally:
            for daemon in daemons:
                daemon.terminate()
            for daemon in daemons:
                try:
                    daemon.wait(30)
                except subprocess.TimeoutExpired:
                    daemon.kill()
            engine.dispose()
    latencies = [
        (float(applied) - committed[event_id]) * 1000
        for event_id, applied in rows
        if event_id in committed
    ]
    if applied_count < expected or not latencies:
        raise RuntimeError(f"only {applied_count} of {expected} events applied")
    elapsed_rate = len(committed) / duration_s
    return {
        "p50_ms": _percentile(latencies, 0.50),
        "p99_ms": _percentile(latencies, 0.99),
        "max_ms": max(latencies),
        "events": float(len(latencies)),
        "offered_rate_per_s": elapsed_rate,
    }


def run() -> dict[str, Any]:
    """Run ``ROUNDS`` rounds; return medians and every round's figures."""
    rounds = [_round(RATE, DURATION_S) for _ in range(ROUNDS)]
    return {
        "e2e_p50_ms": median([r["p50_ms"] for r in rounds]),
        "e2e_p99_ms": median([r["p99_ms"] for r in rounds]),
        "e2e_rounds": rounds,
        "e2e_rate_per_s": RATE,
        "e2e_duration_s": DURATION_S,
    }


if __name__ == "__main__":
    result = run()
    print(write_result("e2e_latency", result))
    print(json.dumps(result, indent=2))
