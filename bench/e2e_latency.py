"""End-to-end latency: producer COMMIT -> the consumer handler's transaction committed.

A producer process commits one event per transaction at a steady rate (default 1,000 events/s
for 60 s, in two producer processes); a relay process publishes them; an inbox consumer process
applies them, stamping the time in its transaction. All stamps come from one clock (this
machine's). Reported: p50 / p99 / max in ms per round and their medians over rounds.
Targets: ``e2e_p50_ms <= 10``, ``e2e_p99_ms <= 50``.

Per hop: the topic uses ``message.timestamp.type=LogAppendTime``, so a record's timestamp is
the broker's append time (same machine, same clock); the consumer stores it with the event.
The result splits the latency into the relay hop (commit -> appended to the log) and the
consumer hop (appended -> handler's transaction committed), and reports the CPU the run used
per process kind (``cpu_pct`` of each round: % of one core over the first 90% of the round,
from ``/proc``), because on a small machine the latency is mostly waiting for a core, and
``relay_cpu_us_per_event``: the relay's CPU per event in microseconds (target <= 100 at
1,000 events/s; ``relay_cpu_us_per_event_light`` at the light rate).

Then as many lighter rounds (``BENCH_E2E_LIGHT_RATE``, default 200 events/s, 30 s each) show
the latency when the machine is not saturated by the load generator itself.

Environment knobs (for quick runs): ``BENCH_E2E_RATE``, ``BENCH_E2E_DURATION_S``,
``BENCH_E2E_ROUNDS``, ``BENCH_E2E_PRODUCERS``, ``BENCH_E2E_LIGHT_RATE`` (0: no light run),
``BENCH_E2E_LIGHT_DURATION_S``, ``BENCH_E2E_RELAY_ARGS`` (extra ``relay run`` options, e.g.
``"--lanes 1"``), ``BENCH_E2E_PYSPY`` (a directory: py-spy records the relay and the consumer
over the measured window of each round there, as collapsed stacks, ``relay-N.txt`` and
``consumer-N.txt``; py-spy must be installed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
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
from example_services.demo._kafka import delete_topics

RATE = float(os.environ.get("BENCH_E2E_RATE", "1000"))
DURATION_S = float(os.environ.get("BENCH_E2E_DURATION_S", "60"))
ROUNDS = int(os.environ.get("BENCH_E2E_ROUNDS", "3"))
PRODUCERS = int(os.environ.get("BENCH_E2E_PRODUCERS", "2"))
LIGHT_RATE = float(os.environ.get("BENCH_E2E_LIGHT_RATE", "200"))
LIGHT_DURATION_S = float(os.environ.get("BENCH_E2E_LIGHT_DURATION_S", "30"))
RELAY_ARGS = os.environ.get("BENCH_E2E_RELAY_ARGS", "").split()
PYSPY_DIR = os.environ.get("BENCH_E2E_PYSPY", "")
_ROUND_NO = iter(range(1, 1_000_000))


async def _create_topic(name: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap())
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(
                    name,
                    num_partitions=3,
                    replication_factor=1,
                    topic_configs={"message.timestamp.type": "LogAppendTime"},
                )
            ]
        )
    finally:
        await admin.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


_KINDS = {
    "bench._e2e_producer": "producers",
    "relay run": "relay",
    "inbox run": "consumer",
    "kafka.Kafka": "kafka",
    "redis-server": "redis",
}


def _cpu_ticks() -> dict[int, tuple[int, str]]:
    """utime + stime (clock ticks) and a kind for every process, from /proc (Linux)."""
    out: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if "postgres:" in cmd and not cmd.startswith(sys.executable):
            kind = "postgresql"  # a backend (a Python process's URL also holds "postgres:")
        else:
            kind = next((v for k, v in _KINDS.items() if k in cmd), "other")
        out[int(entry.name)] = (int(fields[11]) + int(fields[12]), kind)
    return out


def _cpu_pct(before: dict[int, tuple[int, str]], seconds: float) -> dict[str, float]:
    """% of one core used per process kind since ``before``."""
    hz = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = {}
    for pid, (ticks, kind) in _cpu_ticks().items():
        delta = ticks - before.get(pid, (0, kind))[0]
        used[kind] = used.get(kind, 0.0) + delta
    return {k: round(v / hz / seconds * 100, 1) for k, v in sorted(used.items()) if v}


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


def _spies(daemons: list[subprocess.Popen[bytes]], seconds: float) -> list[subprocess.Popen[bytes]]:
    """py-spy on the relay and the consumer for ``seconds`` when ``BENCH_E2E_PYSPY`` is set."""
    if not PYSPY_DIR:
        return []
    out = Path(PYSPY_DIR)
    out.mkdir(parents=True, exist_ok=True)
    n = next(_ROUND_NO)
    spies = []
    for name, daemon in zip(("relay", "consumer"), daemons, strict=True):
        spies.append(
            subprocess.Popen(
                [
                    shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy")),
                    "record",
                    "-p",
                    str(daemon.pid),
                    "-d",
                    str(int(seconds)),
                    "-r",
                    "200",
                    "-f",
                    "raw",
                    "-o",
                    str(out / f"{name}-{n}.txt"),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return spies


def _round(rate: float, duration_s: float) -> dict[str, float]:
    topic = f"bench-e2e-{uuid.uuid4().hex[:8]}"
    asyncio.run(_create_topic(topic))
    try:
        return _measure(topic, rate, duration_s)
    finally:
        # A leftover topic per round costs Kafka CPU in every later run (metadata, log
        # segments): delete it, best effort.
        with contextlib.suppress(Exception):
            asyncio.run(delete_topics(kafka_bootstrap(), [topic]))


def _measure(topic: str, rate: float, duration_s: float) -> dict[str, float]:
    with fresh_database("bench_e2e") as url, tempfile.TemporaryDirectory() as tmp:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "CREATE TABLE e2e_applied (event_id uuid PRIMARY KEY,"
                    " appended_at timestamptz, handled_at timestamptz, applied_at timestamptz)"
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
                [
                    sys.executable,
                    "-m",
                    "ledgerbox.relay",
                    "run",
                    "--poll-interval-s",
                    "1",
                    *RELAY_ARGS,
                ],
                env=env,
                stdout=(logs / "relay.log").open("w"),
                stderr=subprocess.STDOUT,
            ),
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ledgerbox.inbox",
                    "run",
                    "--app",
                    os.environ.get("BENCH_E2E_APP", "bench._e2e_consumer:make_consumer"),
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
            cpu_before, cpu_started = _cpu_ticks(), time.monotonic()
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
            spies = _spies(daemons, duration_s * 0.8)
            # CPU over the first 90% of the run, while the producers still live.
            time.sleep(duration_s * 0.9)
            cpu = _cpu_pct(cpu_before, time.monotonic() - cpu_started)
            for spy in spies:
                spy.wait()
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
                        "SELECT event_id::text, extract(epoch FROM applied_at),"
                        " extract(epoch FROM appended_at) FROM e2e_applied"
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
    measured = [(committed[e], float(a), float(b)) for e, a, b in rows if e in committed]
    if applied_count < expected or not measured:
        raise RuntimeError(f"only {applied_count} of {expected} events applied")
    latencies = [(applied - commit) * 1000 for commit, applied, _ in measured]
    relay_hop = [(appended - commit) * 1000 for commit, _, appended in measured]
    consumer_hop = [(applied - appended) * 1000 for _, applied, appended in measured]
    offered = len(committed) / duration_s
    return {
        # CPU the relay process used per event offered, in microseconds (its share of one
        # core over the round, from /proc, divided by the event rate).
        "relay_cpu_us_per_event": cpu.get("relay", 0.0) / 100 * 1e6 / offered,
        "p50_ms": _percentile(latencies, 0.50),
        "p99_ms": _percentile(latencies, 0.99),
        "max_ms": max(latencies),
        "relay_hop_p50_ms": _percentile(relay_hop, 0.50),
        "relay_hop_p99_ms": _percentile(relay_hop, 0.99),
        "consumer_hop_p50_ms": _percentile(consumer_hop, 0.50),
        "consumer_hop_p99_ms": _percentile(consumer_hop, 0.99),
        "events": float(len(latencies)),
        "offered_rate_per_s": offered,
        "cpu_pct": cpu,  # type: ignore[dict-item]
    }


def run() -> dict[str, Any]:
    """Run ``ROUNDS`` rounds at ``RATE`` (then the light rounds); return medians and every
    round's figures."""
    rounds = [_round(RATE, DURATION_S) for _ in range(ROUNDS)]
    result: dict[str, Any] = {
        "e2e_p50_ms": median([r["p50_ms"] for r in rounds]),
        "e2e_p99_ms": median([r["p99_ms"] for r in rounds]),
        "e2e_relay_hop_p50_ms": median([r["relay_hop_p50_ms"] for r in rounds]),
        "e2e_relay_hop_p99_ms": median([r["relay_hop_p99_ms"] for r in rounds]),
        "e2e_consumer_hop_p50_ms": median([r["consumer_hop_p50_ms"] for r in rounds]),
        "e2e_consumer_hop_p99_ms": median([r["consumer_hop_p99_ms"] for r in rounds]),
        "relay_cpu_us_per_event": median([r["relay_cpu_us_per_event"] for r in rounds]),
        "e2e_rounds": rounds,
        "e2e_rate_per_s": RATE,
        "e2e_duration_s": DURATION_S,
    }
    if LIGHT_RATE > 0:
        light = [_round(LIGHT_RATE, LIGHT_DURATION_S) for _ in range(ROUNDS)]
        result.update(
            {
                "e2e_light_p50_ms": median([r["p50_ms"] for r in light]),
                "e2e_light_p99_ms": median([r["p99_ms"] for r in light]),
                "e2e_light_rate_per_s": LIGHT_RATE,
                "relay_cpu_us_per_event_light": median(
                    [r["relay_cpu_us_per_event"] for r in light]
                ),
                "e2e_light_rounds": light,
            }
        )
    return result


if __name__ == "__main__":
    result = run()
    print(write_result("e2e_latency", result))
    print(json.dumps(result, indent=2))
