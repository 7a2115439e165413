"""The demo's two services under fixed order rates: throughput and latency over both hops.

What runs (as in ``python -m example_services.demo --no-faults``): the order API, the payment
API (uvicorn, one worker each, the command of ``example_services._serve``), one relay and one
inbox consumer per service, on a fresh pair of databases and a fresh pair of 6-partition topics
per round. 200 customers, each wallet funded far beyond what the round spends, so every order
is paid (the heavier path: the debit is a versioned ``UPDATE``).

The path of one order: ``POST /orders`` commits the order and ``OrderPlaced`` (order database)
-> order relay -> ``orders.events`` -> payment consumer debits the wallet, writes the payment
and stages ``PaymentSucceeded`` (payment database) -> payment relay -> ``payments.events`` ->
order consumer marks the order PAID and stamps ``closed_at``.

Load: ``bench._pipeline_load`` (a lean open-loop HTTP/1.1 client in its own process, its CPU
reported) at each rate of ``RATES`` for ``DURATION_S`` seconds, then the pipeline is drained
before the next rate; ``max`` is a closed loop with ``MAX_IN_FLIGHT`` requests in flight.

Per rate (medians over ``ROUNDS`` rounds, every round in ``demo_pipeline_rounds``):

- ``offered_per_s``: requests sent / duration; ``api_per_s``: 2xx answers / duration.
- ``sustained_per_s``: orders through BOTH hops / (last order's ``closed_at`` - first order's
  ``created_at``): the rate the whole pipeline delivered, its drain included, so a stage that
  cannot keep up shows even when the API does.
- ``p50_ms`` / ``p99_ms``: commit -> applied over both hops, ``orders.created_at`` (the order
  transaction's start, ``now()``: at most the transaction's few ms before its commit) ->
  ``orders.closed_at`` (``clock_timestamp()`` in the order consumer's transaction).
  ``hop1_*``: -> ``payments.created_at`` (payment consumer's transaction); ``hop2_*``: the
  rest. The topics use ``message.timestamp.type=LogAppendTime``, so each hop splits into its
  relay part (-> appended to the topic) and its consumer part (appended -> applied):
  ``order_relay``, ``payment_consumer``, ``payment_relay``, ``order_consumer``.
- ``http_p50_ms`` / ``http_p99_ms``: the POST's latency seen by the client, from the time the
  request was due.
- ``cpu_s_per_1000``: CPU seconds per 1,000 orders by process kind, from ``/proc`` over the
  rate's window (load start -> drained): ``order_api``, ``payment_api``, ``relays``,
  ``consumers``, ``postgresql`` (this server's postmaster and backends only: the machine may
  host others), ``kafka`` and ``redis`` (the processes listening on this run's ports),
  ``load_generator`` (its own ``getrusage``, load phase).

Targets: ``demo_pipeline_max_orders_per_s >= 400``, and at 100 orders/s
``demo_pipeline_100_p50_ms <= 30``, ``demo_pipeline_100_p99_ms <= 150``.

Knobs: ``BENCH_PIPELINE_RATES`` (``50,100,200,500,max``), ``BENCH_PIPELINE_DURATION_S`` (20),
``BENCH_PIPELINE_ROUNDS`` (3), ``BENCH_PIPELINE_MAX_IN_FLIGHT`` (32),
``BENCH_PIPELINE_CUSTOMERS`` (200), ``BENCH_PIPELINE_KEEP_LOGS`` (a directory for the logs).
Only 127.0.0.1; a run takes ~6.5 minutes with the defaults (3 rounds of ~2 minutes).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench._common import database_url, kafka_bootstrap, median, write_result
from example_services._config import drop_database, prepare_database, url_with_database
from example_services._serve import api_command
from example_services.demo._kafka import delete_topics, end_offsets
from example_services.demo._procs import ManagedProcess, free_port
from example_services.orders._models import metadata as order_metadata
from example_services.payments._models import metadata as payment_metadata

RATES = [r.strip() for r in os.environ.get("BENCH_PIPELINE_RATES", "50,100,200,500,max").split(",")]
DURATION_S = float(os.environ.get("BENCH_PIPELINE_DURATION_S", "20"))
ROUNDS = int(os.environ.get("BENCH_PIPELINE_ROUNDS", "3"))
MAX_IN_FLIGHT = int(os.environ.get("BENCH_PIPELINE_MAX_IN_FLIGHT", "32"))
CUSTOMERS = int(os.environ.get("BENCH_PIPELINE_CUSTOMERS", "200"))
KEEP_LOGS = os.environ.get("BENCH_PIPELINE_KEEP_LOGS")
PARTITIONS = 6
DRAIN_TIMEOUT_S = 120.0
IDLE_S = 5.0
WALLET_FUNDS = "5000000.00"

_PENDING = sa.text("SELECT count(*) FROM orders WHERE status = 'PENDING'")
_ORDERS = sa.text(
    "SELECT id::text, status, extract(epoch FROM created_at), extract(epoch FROM closed_at)"
    " FROM orders WHERE id = ANY(CAST(:ids AS uuid[]))"
)
_PAYMENTS = sa.text(
    "SELECT order_id::text, extract(epoch FROM created_at) FROM payments"
    " WHERE order_id = ANY(CAST(:ids AS uuid[]))"
)
_DATA_DIR = sa.text("SHOW data_directory")


# ---------------------------------------------------------------------------- CPU accounting


def _listening_pid(port: int) -> int | None:
    """The pid of the process listening on TCP ``port`` (from ``/proc/net``), if any."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(entry.name)
        except OSError:
            continue
    return None


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, utime + stime in clock ticks) of ``pid``; ``None`` if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[11]) + int(fields[12])


class CpuMeter:
    """CPU ticks per process kind: fixed pids plus the children of the PostgreSQL postmaster."""

    def __init__(self, kinds: Mapping[int, str], postmaster: int | None) -> None:
        self.kinds = dict(kinds)
        self.postmaster = postmaster

    def ticks(self) -> dict[int, tuple[str, int]]:
        out: dict[int, tuple[str, int]] = {}
        for pid, kind in self.kinds.items():
            stat = _stat(pid)
            if stat is not None:
                out[pid] = (kind, stat[1])
        if self.postmaster is not None:
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    stat = _stat(int(entry.name))
                    if stat is not None and (
                        stat[0] == self.postmaster or int(entry.name) == self.postmaster
                    ):
                        out[int(entry.name)] = ("postgresql", stat[1])
        return out

    @staticmethod
    def seconds(before: Mapping[int, tuple[str, int]], after: Mapping[int, tuple[str, int]]):
        hz = os.sysconf("SC_CLK_TCK")
        used: dict[str, float] = {}
        for pid, (kind, ticks) in after.items():
            start = before.get(pid, (kind, 0))[1]  # a backend born in the window: all its CPU
            used[kind] = used.get(kind, 0.0) + (ticks - start) / hz
        return used


# ---------------------------------------------------------------------------- the services


async def _create_topics(names: Sequence[str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap())
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(
                    name,
                    num_partitions=PARTITIONS,
                    replication_factor=1,
                    topic_configs={"message.timestamp.type": "LogAppendTime"},
                )
                for name in names
            ]
        )
    finally:
        await admin.close()


async def _append_times(topic: str) -> dict[str, float]:
    """order_id -> broker append time (epoch s) of every record of ``topic`` (first copy)."""
    ends = await end_offsets(kafka_bootstrap(), [topic])
    reader = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap(), enable_auto_commit=False)
    await reader.start()
    out: dict[str, float] = {}
    try:
        parts = [tp for tp, end in ends.items() if end > 0]
        reader.assign(parts)
        await reader.seek_to_beginning(*parts)
        remaining = set(parts)
        while remaining:
            batch = await reader.getmany(timeout_ms=2000, max_records=5000)
            if not batch:
                break
            for tp, messages in batch.items():
                for m in messages:
                    order_id = json.loads(m.value)["order_id"]
                    out.setdefault(order_id, m.timestamp / 1000)
                if messages and messages[-1].offset + 1 >= ends[tp]:
                    remaining.discard(tp)
    finally:
        await reader.stop()
    return out


class Pipeline:
    """One round's services: databases, topics, six processes, funded wallets."""

    def __init__(self, logs: Path) -> None:
        server = database_url()
        self.run_id = secrets.token_hex(3)
        self.logs = logs
        self.order_db = url_with_database(server, f"bench_pipe_{self.run_id}_orders")
        self.payment_db = url_with_database(server, f"bench_pipe_{self.run_id}_payments")
        prefix = f"bench-pipe-{self.run_id}"
        self.orders_topic, self.payments_topic = f"{prefix}.orders", f"{prefix}.payments"
        self.ports = {"order": free_port(), "payment": free_port()}
        self.procs: dict[str, ManagedProcess] = {}
        self.engine: sa.Engine | None = None
        self.payment_engine: sa.Engine | None = None

    def start(self) -> None:
        prepare_database(self.order_db, order_metadata)
        prepare_database(self.payment_db, payment_metadata)
        asyncio.run(_create_topics([self.orders_topic, self.payments_topic]))
        self.engine = sa.create_engine(self.order_db, pool_size=1)
        self.payment_engine = sa.create_engine(self.payment_db, pool_size=1)
        py = sys.executable
        for service, db in (("order", self.order_db), ("payment", self.payment_db)):
            env = {
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "DATABASE_URL": db,
                "ORDER_DATABASE_URL": self.order_db,
                "PAYMENT_DATABASE_URL": self.payment_db,
                "ORDERS_TOPIC": self.orders_topic,
                "PAYMENTS_TOPIC": self.payments_topic,
                "ORDER_CONSUMER_GROUP": f"order-service.{self.run_id}",
                "PAYMENT_CONSUMER_GROUP": f"payment-service.{self.run_id}",
                "MIGRATE_ON_START": "false",
            }
            specs = {
                f"{service}-api": api_command(
                    f"example_services.{service}s.api:create_app", self.ports[service]
                ),
                f"{service}-relay": [py, "-m", "ledgerbox.relay", "run"],
                f"{service}-consumer": [
                    *(py, "-m", "ledgerbox.inbox", "run", "--app"),
                    f"example_services.{service}s.consumer:consumer",
                ],
            }
            for name, argv in specs.items():
                proc = ManagedProcess(name, argv, env, self.logs / f"{name}.log")
                self.procs[name] = proc
                proc.start()
        self._wait_healthy()
        self._fund_wallets()

    def _wait_healthy(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            for service, port in self.ports.items():
                while True:
                    try:
                        if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    proc = self.procs[f"{service}-api"]
                    if not proc.alive() or time.monotonic() > deadline:
                        raise RuntimeError(f"{service}-api did not start:\n{proc.tail()}")
                    time.sleep(0.2)

    def _fund_wallets(self) -> None:
        url = f"http://127.0.0.1:{self.ports['payment']}"
        with httpx.Client(base_url=url, timeout=30.0) as client:
            for i in range(CUSTOMERS):
                response = client.post(
                    f"/wallets/c{i:03d}/top-up",
                    json={"amount": WALLET_FUNDS},
                    headers={"Idempotency-Key": f"{self.run_id}-fund-{i}"},
                )
                if response.status_code != 201:
                    raise RuntimeError(f"top-up failed: {response.status_code} {response.text}")

    def cpu_meter(self, load_kinds: Mapping[int, str] | None = None) -> CpuMeter:
        kinds: dict[int, str] = {}
        for name, proc in self.procs.items():
            if proc.pid is not None:
                service, role = name.split("-", 1)
                kinds[proc.pid] = f"{service}_api" if role == "api" else f"{role}s"
        server = sa.engine.make_url(database_url())
        for port, kind in (
            (int(kafka_bootstrap().split(",")[0].rsplit(":", 1)[1]), "kafka"),
            (_redis_port(), "redis"),
        ):
            pid = _listening_pid(port) if port else None
            if pid is not None:
                kinds[pid] = kind
        kinds.update(load_kinds or {})
        return CpuMeter(kinds, _listening_pid(server.port or 5432))

    def pending(self) -> int:
        assert self.engine is not None
        with self.engine.connect() as conn:
            return int(conn.execute(_PENDING).scalar_one())

    def wait_drained(self, timeout_s: float = DRAIN_TIMEOUT_S) -> float:
        """Seconds waited until no order is PENDING; raises after ``timeout_s``."""
        started = time.monotonic()
        while (left := self.pending()) > 0:
            for proc in self.procs.values():
                if proc.check() is not None:
                    raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"{left} orders still PENDING after {timeout_s:g} s")
            time.sleep(0.2)
        return time.monotonic() - started

    def rows(self, ids: Sequence[str]) -> tuple[list[Any], dict[str, float]]:
        assert self.engine is not None and self.payment_engine is not None
        with self.engine.connect() as conn:
            orders = conn.execute(_ORDERS, {"ids": list(ids)}).all()
        with self.payment_engine.connect() as conn:
            payments = {o: float(t) for o, t in conn.execute(_PAYMENTS, {"ids": list(ids)})}
        return orders, payments

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()
        for engine in (self.engine, self.payment_engine):
            if engine is not None:
                engine.dispose()
        try:
            asyncio.run(
                delete_topics(
                    kafka_bootstrap(),
                    [
                        self.orders_topic,
                        self.payments_topic,
                        f"{self.orders_topic}.dlq",
                        f"{self.payments_topic}.dlq",
                    ],
                )
            )
        except Exception as exc:  # cleanup is best effort; a leftover topic is harmless
            print(f"   (topics not deleted: {exc!r})", flush=True)
        for url in (self.order_db, self.payment_db):
            drop_database(url)


def _redis_port() -> int | None:
    url = os.environ.get("REDIS_URL")
    return (urllib.parse.urlsplit(url).port or 6379) if url else None


# ---------------------------------------------------------------------------- one rate


def _load(pipe: Pipeline, rate: str, duration_s: float, seed: int, out: Path) -> dict[str, Any]:
    argv = [
        *(sys.executable, "-m", "bench._pipeline_load"),
        *("--port", str(pipe.ports["order"]), "--customers", str(CUSTOMERS)),
        *("--rate", "0" if rate == "max" else rate, "--duration-s", str(duration_s)),
        *("--seed", str(seed), "--max-in-flight", str(MAX_IN_FLIGHT), "--out", str(out)),
    ]
    subprocess.run(argv, check=True)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _measure_rate(pipe: Pipeline, rate: str, seed: int, tmp: Path) -> dict[str, Any]:
    meter = pipe.cpu_meter()
    before, started = meter.ticks(), time.monotonic()
    load = _load(pipe, rate, DURATION_S, seed, tmp / f"load-{rate}-{seed}.json")
    drain_s = pipe.wait_drained()
    cpu = CpuMeter.seconds(before, meter.ticks())
    window_s = time.monotonic() - started
    cpu["load_generator"] = load["cpu_s"]
    ids = load["order_ids"]
    orders, paid_at = pipe.rows(ids)
    closed = [(o, float(c), float(z)) for o, s, c, z in orders if z is not None and s == "PAID"]
    if not closed:
        raise RuntimeError(f"rate {rate}: no order went through both hops")
    total = [(z - c) * 1000 for _o, c, z in closed]
    hop1 = [(paid_at[o] - c) * 1000 for o, c, _z in closed if o in paid_at]
    hop2 = [(z - paid_at[o]) * 1000 for o, _c, z in closed if o in paid_at]
    span_s = max(z for *_x, z in closed) - min(c for _o, c, _z in closed)
    n = len(closed)
    result: dict[str, Any] = {
        "rate": rate,
        "offered_per_s": load["sent"] / DURATION_S,
        "api_per_s": len(ids) / DURATION_S,
        "sustained_per_s": n / span_s if span_s > 0 else float("nan"),
        "orders": n,
        "not_paid": len(ids) - n,
        "http_errors": load["errors"],
        "statuses": load["statuses"],
        "shed": load["shed"],
        "drain_s": drain_s,
        "window_s": window_s,
        "p50_ms": _pct(total, 0.50),
        "p99_ms": _pct(total, 0.99),
        "max_ms": max(total),
        "hop1_p50_ms": _pct(hop1, 0.50),
        "hop1_p99_ms": _pct(hop1, 0.99),
        "hop2_p50_ms": _pct(hop2, 0.50),
        "hop2_p99_ms": _pct(hop2, 0.99),
        "http_p50_ms": _pct(load["http_ms"], 0.50),
        "http_p99_ms": _pct(load["http_ms"], 0.99),
        "cpu_s_per_1000": {k: round(v / n * 1000, 3) for k, v in sorted(cpu.items()) if v},
        "cpu_pct": {k: round(v / window_s * 100, 1) for k, v in sorted(cpu.items()) if v},
        "_closed": closed,
        "_paid_at": paid_at,
    }
    return result


def _idle_cpu(pipe: Pipeline, seconds: float) -> dict[str, float]:
    """% of one core each process kind uses with no load at all (polls, heartbeats, fetches):
    the fixed cost that a low rate divides among few orders."""
    meter = pipe.cpu_meter()
    before, started = meter.ticks(), time.monotonic()
    time.sleep(seconds)
    used = CpuMeter.seconds(before, meter.ticks())
    elapsed = time.monotonic() - started
    return {k: round(v / elapsed * 100, 1) for k, v in sorted(used.items()) if v}


def _split_hops(rates: Iterable[dict[str, Any]], pipe: Pipeline) -> None:
    """Add the relay / consumer split of each hop from the topics' append times."""
    placed = asyncio.run(_append_times(pipe.orders_topic))
    settled = asyncio.run(_append_times(pipe.payments_topic))
    for r in rates:
        closed, paid_at = r.pop("_closed"), r.pop("_paid_at")
        parts: dict[str, list[float]] = {
            "order_relay": [],
            "payment_consumer": [],
            "payment_relay": [],
            "order_consumer": [],
        }
        for o, c, z in closed:
            if o in placed and o in paid_at and o in settled:
                parts["order_relay"].append((placed[o] - c) * 1000)
                parts["payment_consumer"].append((paid_at[o] - placed[o]) * 1000)
                parts["payment_relay"].append((settled[o] - paid_at[o]) * 1000)
                parts["order_consumer"].append((z - settled[o]) * 1000)
        for name, values in parts.items():
            r[f"{name}_p50_ms"] = _pct(values, 0.50)
            r[f"{name}_p99_ms"] = _pct(values, 0.99)


def _round(index: int, tmp: Path) -> list[dict[str, Any]]:
    logs = tmp / f"round-{index}"
    pipe = Pipeline(logs)
    rates: list[dict[str, Any]] = []
    try:
        pipe.start()
        # Warm-up: connections, leases, consumer groups and caches settled, fully drained.
        _load(pipe, "50", 3, 10_000 + index, tmp / f"warm-{index}.json")
        pipe.wait_drained()
        idle = _idle_cpu(pipe, IDLE_S)
        for k, rate in enumerate(RATES):
            measured = _measure_rate(pipe, rate, 1000 * index + k, tmp)
            rates.append(measured)
            print(
                f"   round {index + 1} rate {rate:>4}: {measured['sustained_per_s']:6.1f} orders/s"
                f" through both hops, p50 {measured['p50_ms']:7.1f} ms, p99"
                f" {measured['p99_ms']:7.1f} ms, http p99 {measured['http_p99_ms']:6.1f} ms",
                flush=True,
            )
        _split_hops(rates, pipe)
        for r in rates:
            r["idle_cpu_pct"] = idle
    finally:
        pipe.stop()
        if KEEP_LOGS:
            shutil.copytree(logs, Path(KEEP_LOGS) / f"{pipe.run_id}", dirs_exist_ok=True)
    return rates


_PER_RATE = (
    "offered_per_s",
    "api_per_s",
    "sustained_per_s",
    "p50_ms",
    "p99_ms",
    "hop1_p50_ms",
    "hop1_p99_ms",
    "hop2_p50_ms",
    "hop2_p99_ms",
    "order_relay_p50_ms",
    "order_relay_p99_ms",
    "payment_consumer_p50_ms",
    "payment_consumer_p99_ms",
    "payment_relay_p50_ms",
    "payment_relay_p99_ms",
    "order_consumer_p50_ms",
    "order_consumer_p99_ms",
    "http_p50_ms",
    "http_p99_ms",
    "drain_s",
)


def run() -> dict[str, Any]:
    """``ROUNDS`` rounds over ``RATES``; medians per rate and every round's figures."""
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as name:
        rounds = [_round(i, Path(name)) for i in range(ROUNDS)]
    result: dict[str, Any] = {
        "demo_pipeline_rounds": rounds,
        "demo_pipeline_duration_s": DURATION_S,
        "demo_pipeline_rates": RATES,
        "demo_pipeline_max_in_flight": MAX_IN_FLIGHT,
    }
    for k, rate in enumerate(RATES):
        per = [r[k] for r in rounds]
        for key in _PER_RATE:
            result[f"demo_pipeline_{rate}_{key.removesuffix('_per_s')}"] = median(
                [r[key] for r in per]
            )
        kinds = sorted({kind for r in per for kind in r["cpu_s_per_1000"]})
        result[f"demo_pipeline_{rate}_cpu_s_per_1000_total"] = median(
            [sum(r["cpu_s_per_1000"].values()) for r in per]
        )
        result[f"demo_pipeline_{rate}_cpu_s_per_1000"] = {
            kind: round(median([r["cpu_s_per_1000"].get(kind, 0.0) for r in per]), 3)
            for kind in kinds
        }
    idle = [r[0]["idle_cpu_pct"] for r in rounds if r]
    kinds = sorted({kind for i in idle for kind in i})
    result["demo_pipeline_idle_cpu_pct"] = {
        kind: median([i.get(kind, 0.0) for i in idle]) for kind in kinds
    }
    if "max" in RATES:
        result["demo_pipeline_max_orders_per_s"] = result["demo_pipeline_max_sustained"]
    return result


if __name__ == "__main__":
    figures = run()
    print(write_result("demo_pipeline", figures))
    print(json.dumps({k: v for k, v in figures.items() if k != "demo_pipeline_rounds"}, indent=2))
