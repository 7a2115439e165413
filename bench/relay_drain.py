"""Relay drain: 200,000 pending events (~300-byte payloads, 1,000 keys) published by the real
relay (``python -m ledgerbox.relay run`` in a subprocess) vs a raw aiokafka producer sending
the same records from memory with the same producer settings, in the same run.

Figures: ``relay_events_per_s`` (from the first row marked to the last: startup excluded),
``raw_producer_events_per_s``, ``relay_vs_raw_ratio`` (target >= 0.8),
``relay_peak_rss_mb`` (VmHWM of the relay process; target <= 100), and the hot-key case
(10 keys only): ``hot_keys_events_per_s`` and ``hot_keys_ratio`` = hot / normal (target >= 0.5).

Run: ``python -m bench relay_drain`` or ``python bench/relay_drain.py`` (services up).
Also ``relay_scaling_2_vs_1``: two relay processes over one on the same backlog (on 2 cores
it need not exceed 1). Warm-up first, then ``BENCH_RELAY_ROUNDS`` (default 3) rounds, every
case once per round, medians reported with every round's figures.
Environment: ``BENCH_RELAY_EVENTS`` (default 200000), ``BENCH_RELAY_ROUNDS`` (default 3);
``LEDGERBOX_RELAY_LANES`` (and any other ``LEDGERBOX_RELAY_*`` setting) reaches the relay CLI,
and the lane count is recorded in the result (``relay_lanes``, "default" when unset).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import psycopg
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import fresh_database, kafka_bootstrap, median, write_result
from ledgerbox.outbox import kafka_headers, timestamp_ms

EVENTS = int(os.environ.get("BENCH_RELAY_EVENTS", "200000"))
ROUNDS = int(os.environ.get("BENCH_RELAY_ROUNDS", "3"))
REPO = Path(__file__).resolve().parent.parent
PRODUCER = {
    "acks": "all",
    "enable_idempotence": True,
    "compression_type": "lz4",
    "linger_ms": 5,
    "max_batch_size": 262_144,
    "request_timeout_ms": 30_000,
}


def _rows(topic: str, keys: int, events: int) -> list[tuple[Any, ...]]:
    now = dt.datetime.now(dt.UTC)
    rows = []
    for i in range(events):
        key = f"customer-{i % keys:04d}"
        payload = {
            "order_id": str(uuid.uuid4()),
            "customer": key,
            "seq": i,
            "amount": "100.00",
            "currency": "EUR",
            "note": "x" * 180,
        }
        rows.append(
            (
                uuid.uuid4(),
                f"bench:{i}",
                topic,
                key,
                zlib.crc32(key.encode()) % 64,
                "OrderPlaced",
                "/bench",
                "order",
                key,
                i,
                json.dumps(payload),
                json.dumps({"traceparent": f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"}),
                now,
            )
        )
    return rows


def _load(url: str, rows: list[tuple[Any, ...]]) -> None:
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
        with conn.cursor().copy(
            "COPY outbox (event_id, idempotency_key, topic, partition_key, shard, event_type, "
            "source, aggregate_type, aggregate_id, aggregate_version, payload, headers, "
            "occurred_at) FROM STDIN"
        ) as copy:
            for row in rows:
                copy.write_row(row)
        conn.execute("VACUUM ANALYZE outbox")


def _pending(conn: psycopg.Connection[Any]) -> int:
    return int(conn.execute("SELECT count(*) FROM outbox WHERE status = 0").fetchone()[0])  # type: ignore[index]


def _exists(conn: psycopg.Connection[Any], status: int) -> bool:
    # ~0.1 ms through a partial index; a count(*) over the pending index costs ~18 ms at 200k
    # rows (with parallel workers), which polled every 50 ms took CPU from the relay measured.
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM outbox WHERE status = %s)", (status,)
    ).fetchone()
    return bool(row[0])  # type: ignore[index]


def _relay_drain(url: str, bootstrap: str, processes: int = 1) -> tuple[float, float]:
    """Run ``processes`` relay CLIs until the outbox is empty; (events/s, peak RSS MB)."""
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "LEDGERBOX_RELAY_LOG_LEVEL": "WARNING",
    }
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
        total = _pending(conn)
    procs = [
        subprocess.Popen([sys.executable, "-m", "ledgerbox.relay", "run"], cwd=REPO, env=env)
        for _ in range(processes)
    ]
    try:
        with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
            # The clock starts at the first mark (relay start-up is not measured) and stops
            # when nothing is pending; cheap EXISTS polls, so the monitor does not load the
            # database the relay works against.
            while not _exists(conn, 1):
                time.sleep(0.01)
            t0, first = time.perf_counter(), _pending(conn)
            while _exists(conn, 0):
                time.sleep(0.05)
            elapsed = time.perf_counter() - t0
            assert first <= total
        hwm_kb = 0
        for proc in procs:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            line = next(x for x in status.splitlines() if x.startswith("VmHWM"))
            hwm_kb = max(hwm_kb, int(line.split()[1]))
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(60)
    return first / elapsed, hwm_kb / 1024


async def _raw(bootstrap: str, topic: str, rows: list[tuple[Any, ...]]) -> float:
    records = []
    for r in rows:
        headers = kafka_headers(
            event_id=r[0],
            event_type=r[5],
            source=r[6],
            occurred_at=r[12],
            idempotency_key=r[1],
            aggregate_type=r[7],
            aggregate_id=r[8],
            aggregate_version=r[9],
            extra=json.loads(r[11]),
        )
        records.append((r[3].encode(), r[10].encode(), timestamp_ms(r[12]), headers))
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **PRODUCER)
    await producer.start()
    try:
        t0 = time.perf_counter()
        futures = []
        for key, value, ts, headers in records:
            futures.append(
                await producer.send(topic, value=value, key=key, timestamp_ms=ts, headers=headers)
            )
        await asyncio.gather(*futures)
        return len(records) / (time.perf_counter() - t0)
    finally:
        await producer.stop()


async def _topics(bootstrap: str, names: list[str], create: bool) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        if create:
            await admin.create_topics(
                [NewTopic(n, num_partitions=6, replication_factor=1) for n in names]
            )
        else:
            await admin.delete_topics(names)
    finally:
        await admin.close()


def _case(
    keys: int, bootstrap: str, relays: int = 1, raw: bool = True, events: int = EVENTS
) -> dict[str, float]:
    topic, raw_topic = f"bench-relay-{uuid.uuid4().hex[:8]}", f"bench-raw-{uuid.uuid4().hex[:8]}"
    asyncio.run(_topics(bootstrap, [topic, raw_topic], create=True))
    try:
        rows = _rows(topic, keys, events)
        with fresh_database("bench_relay") as url:
            _load(url, rows)
            relay_rate, rss_mb = _relay_drain(url, bootstrap, relays)
        raw_rate = asyncio.run(_raw(bootstrap, raw_topic, rows)) if raw else float("nan")
    finally:
        asyncio.run(_topics(bootstrap, [topic, raw_topic], create=False))
    return {"relay": relay_rate, "raw": raw_rate, "rss_mb": rss_mb}


def run() -> dict[str, Any]:
    """Warm up, then ``ROUNDS`` rounds of every case side by side; medians + raw figures.

    Each round drains the 1,000-key backlog with one relay and sends the same records raw,
    drains the 10-key backlog, and drains the 1,000-key backlog with two relay processes.
    """
    bootstrap = kafka_bootstrap()
    _case(1000, bootstrap, events=min(EVENTS, 5_000))  # warm-up: broker, caches, connections
    normal, hot, two = [], [], []
    for _ in range(ROUNDS):
        normal.append(_case(1000, bootstrap))
        hot.append(_case(10, bootstrap, raw=False))
        two.append(_case(1000, bootstrap, relays=2, raw=False))
    relay = median([r["relay"] for r in normal])
    raw = median([r["raw"] for r in normal])
    hot_rate = median([r["relay"] for r in hot])
    two_rate = median([r["relay"] for r in two])
    result = {
        "relay_drain_events": EVENTS,
        "relay_drain_rounds": ROUNDS,
        "relay_lanes": os.environ.get("LEDGERBOX_RELAY_LANES", "default"),
        "relay_events_per_s": round(relay, 1),
        "raw_producer_events_per_s": round(raw, 1),
        "relay_vs_raw_ratio": round(median([r["relay"] / r["raw"] for r in normal]), 3),
        "relay_peak_rss_mb": round(max(r["rss_mb"] for r in normal + hot), 1),
        "hot_keys_events_per_s": round(hot_rate, 1),
        "hot_keys_ratio": round(hot_rate / relay, 3),
        "relay_two_processes_events_per_s": round(two_rate, 1),
        "relay_scaling_2_vs_1": round(two_rate / relay, 3),
        "relay_drain_raw": {"normal": normal, "hot_keys": hot, "two_relays": two},
    }
    write_result("relay_drain", result)
    return result


if __name__ == "__main__":
    for name, value in run().items():
        print(f"{name:28} {value}")
