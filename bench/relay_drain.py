"""Relay drain: 200,000 pending events (~300-byte payloads, 1,000 keys) published by the real
relay (``python -m ledgerbox.relay run`` in a subprocess) vs a raw aiokafka producer sending
the same records from memory with the same producer settings, in the same run.

Figures: ``relay_events_per_s`` (from the first row marked to the last: startup excluded),
``raw_producer_events_per_s``, ``relay_vs_raw_ratio`` (target >= 0.8),
``relay_peak_rss_mb`` (VmHWM of the relay process; target <= 100), the CPU per event of the
relay process and of its PostgreSQL backends during the drain
(``relay_drain_relay_cpu_us_per_event``, ``relay_drain_pg_cpu_us_per_event``: less sensitive
to other load on a shared machine than the rate), and the hot-key case
(10 keys only): ``hot_keys_events_per_s`` and ``hot_keys_ratio`` = hot / normal (target >= 0.5).

Run: ``python -m bench relay_drain`` or ``python bench/relay_drain.py`` (services up).
Also ``relay_scaling_2_vs_1``: two relay processes over one on the same backlog (on 2 cores
it need not exceed 1). Warm-up first, then ``BENCH_RELAY_ROUNDS`` (default 3) rounds, every
case once per round, medians reported with every round's figures.
History (``relay_history_ratio``, target >= 0.9): 100,000 events (1,000 keys) drained from an
empty table vs from one that also holds 2,000,000 published rows created 3 days ago (what a
few days of retention leave), interleaved; the relay's reads must not grow with history.
Environment: ``BENCH_RELAY_EVENTS`` (default 200000), ``BENCH_RELAY_ROUNDS`` (default 3),
``BENCH_HISTORY_ROWS`` (default 2000000; 0: no history case), ``BENCH_HISTORY_EVENTS``
(default 100000);
``LEDGERBOX_RELAY_LANES`` (and any other ``LEDGERBOX_RELAY_*`` setting) reaches the relay CLI,
and the lane count is recorded in the result (``relay_lanes``, "default" when unset). The raw
producer runs on the relay's event loop (``LEDGERBOX_RELAY_EVENT_LOOP``, default ``auto``:
uvloop when installed; ``relay_event_loop`` in the result).
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
from ledgerbox._core.event_loop import runner
from ledgerbox.outbox import kafka_headers, timestamp_ms

EVENTS = int(os.environ.get("BENCH_RELAY_EVENTS", "200000"))
ROUNDS = int(os.environ.get("BENCH_RELAY_ROUNDS", "3"))
HISTORY_ROWS = int(os.environ.get("BENCH_HISTORY_ROWS", "2000000"))
HISTORY_EVENTS = int(os.environ.get("BENCH_HISTORY_EVENTS", "100000"))
REPO = Path(__file__).resolve().parent.parent
RELAY_EVENT_LOOP = os.environ.get("LEDGERBOX_RELAY_EVENT_LOOP", "auto")
RAW_LOOP = runner(RELAY_EVENT_LOOP)
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
                # The topic is new per backlog: the history case loads several into one table.
                f"bench:{topic}:{i}",
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
        # The load's dirty pages are written before the clock runs, not by a checkpoint
        # during the drain (the same for every case).
        conn.execute("CHECKPOINT")


def _loaded(conn: psycopg.Connection[Any]) -> tuple[str, dict[int, int]]:
    """The transaction id the backlog was written with, and each of its shards' last row id."""
    row = conn.execute("SELECT max(txid)::text FROM outbox").fetchone()
    last = dict(conn.execute("SELECT shard, max(id) FROM outbox GROUP BY shard").fetchall())
    assert row is not None
    return str(row[0]), {int(k): int(v) for k, v in last.items()}


def _cursors_passed(conn: psycopg.Connection[Any], txid: str, last: dict[int, int]) -> int:
    """How many of the backlog's shards have a persisted cursor past their last row: the
    range closed after transaction ``txid`` (``lo`` sees it), or still open on a snapshot
    that sees it with ``after_id`` at the shard's last row. (A range whose last batch ended
    the shard's rows stays open until the next batch of that shard: the relay persists once
    per batch, never for an empty claim, so ``lo`` alone never passed on those shards.)

    Reads the 64 lease rows only (~0.1 ms): the monitor must not load the database the relay
    works against (a count(*) of the backlog polled every 50 ms did, in an earlier version).
    """
    row = conn.execute(
        "SELECT count(*) FROM outbox_relay_lease AS l"
        " JOIN unnest(%s::int2[], %s::int8[]) AS b(shard, last_id) ON b.shard = l.shard"
        " WHERE pg_visible_in_snapshot(%s::xid8, l.lo)"
        "    OR (pg_visible_in_snapshot(%s::xid8, l.hi) AND l.after_id >= b.last_id)",
        (list(last), list(last.values()), txid, txid),
    ).fetchone()
    return int(row[0])  # type: ignore[index]


def _passed_rows(conn: psycopg.Connection[Any], txid: str) -> int:
    """Rows of the backlog the persisted cursors passed (at the start: one batch or so),
    through the (shard, txid, id) index."""
    row = conn.execute(
        """SELECT coalesce(sum(n), 0) FROM outbox_relay_lease AS l CROSS JOIN LATERAL (
             SELECT count(*) AS n FROM outbox AS o
             WHERE o.shard = l.shard AND o.txid = %(t)s::xid8 AND o.status = 0
               AND (pg_visible_in_snapshot(%(t)s::xid8, l.lo)
                    OR (pg_visible_in_snapshot(%(t)s::xid8, l.hi) AND o.id <= l.after_id))
           ) AS c WHERE l.shard >= 0 AND coalesce(l.hi, l.lo) IS NOT NULL""",
        {"t": txid},
    ).fetchone()
    return int(row[0])  # type: ignore[index]


def _last_persist(conn: psycopg.Connection[Any]) -> Any:
    """The newest ``persisted_at`` of any lease row (the epoch when none was persisted)."""
    row = conn.execute(
        "SELECT coalesce(max(persisted_at), 'epoch') FROM outbox_relay_lease"
    ).fetchone()
    return row[0]  # type: ignore[index]


def _started(conn: psycopg.Connection[Any], before: Any) -> bool:
    """A cursor was persisted after ``before`` (the relay under test published its first
    batch). Not "some lease row has a cursor": the history case starts with every shard's
    cursor already persisted past the history, and the clock must not start before the relay
    process does (it did until 2026-12-01: the history drains counted ~1 s of relay start-up,
    the empty-table drains none, and relay_history_ratio read 0.67-0.86 for that alone)."""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM outbox_relay_lease WHERE persisted_at > %s)", (before,)
    ).fetchone()
    return bool(row[0])  # type: ignore[index]


def _ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def _relay_backends(conn: psycopg.Connection[Any]) -> list[int]:
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE 'ledgerbox-relay-%'"
    ).fetchall()
    return [int(r[0]) for r in rows]


def _relay_drain(url: str, bootstrap: str, processes: int = 1) -> dict[str, float]:
    """Run ``processes`` relay CLIs until the backlog is published: events/s, peak RSS MB,
    and the CPU per event (µs) of the relay processes and of their PostgreSQL backends (from
    /proc, over the measured window)."""
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "LEDGERBOX_RELAY_LOG_LEVEL": "WARNING",
    }
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
        txid, last = _loaded(conn)
        total = int(
            conn.execute("SELECT count(*) FROM outbox WHERE txid = %s::xid8", (txid,)).fetchone()[0]  # type: ignore[index]
        )
        before = _last_persist(conn)
    procs = [
        subprocess.Popen([sys.executable, "-m", "ledgerbox.relay", "run"], cwd=REPO, env=env)
        for _ in range(processes)
    ]
    hz = os.sysconf("SC_CLK_TCK")
    try:
        with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
            # The clock starts at the first persisted cursor (relay start-up is not measured)
            # and stops when every shard's persisted cursor passed the backlog's transaction.
            while not _started(conn, before):
                time.sleep(0.01)
            t0 = time.perf_counter()
            relay0 = sum(_ticks(p.pid) for p in procs)
            backends0 = {pid: _ticks(pid) for pid in _relay_backends(conn)}
            first = total - _passed_rows(conn, txid)
            while _cursors_passed(conn, txid, last) < len(last):
                time.sleep(0.05)
            elapsed = time.perf_counter() - t0
            relay_ticks = sum(_ticks(p.pid) for p in procs) - relay0
            backends = set(backends0) | set(_relay_backends(conn))
            pg_ticks = sum(_ticks(pid) - backends0.get(pid, 0) for pid in backends)
            assert 0 < first <= total
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
    return {
        "relay": first / elapsed,
        "rss_mb": hwm_kb / 1024,
        "relay_cpu_us": relay_ticks / hz / first * 1e6,
        "pg_cpu_us": pg_ticks / hz / first * 1e6,
    }


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
            drained = _relay_drain(url, bootstrap, relays)
        # On the relay's event loop (its `event_loop` setting: uvloop when installed), so the
        # ratio compares the relay with aiokafka alone, not two event loops.
        raw_rate = RAW_LOOP(_raw(bootstrap, raw_topic, rows)) if raw else float("nan")
    finally:
        asyncio.run(_topics(bootstrap, [topic, raw_topic], create=False))
    return {**drained, "raw": raw_rate}


def _history(url: str, rows: int) -> None:
    """``rows`` published rows created 3 days ago (what a few days of retention leave), in
    transactions of 100,000, and every shard's cursor past them, as the relay that published
    them persisted it."""
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
        for start in range(0, rows, 100_000):
            conn.execute(
                """INSERT INTO outbox (event_id, idempotency_key, topic, partition_key, shard,
                     event_type, source, aggregate_type, aggregate_id, aggregate_version,
                     payload, headers, occurred_at, created_at)
                   SELECT gen_random_uuid(), 'history:' || g, 'bench-history',
                     'customer-' || lpad((g %% 1000)::text, 4, '0'), g %% 64, 'OrderPlaced',
                     '/bench',
                     'order', 'customer-' || (g %% 1000), g,
                     jsonb_build_object('order_id', gen_random_uuid(), 'seq', g,
                       'amount', '100.00', 'currency', 'EUR', 'note', repeat('x', 180)),
                     '{}'::jsonb, now() - interval '3 days', now() - interval '3 days'
                   FROM generate_series(%s::int8, %s::int8) AS g""",
                (start, min(start + 100_000, rows) - 1),
            )
        conn.execute(
            "INSERT INTO outbox_relay_lease (shard, fence) SELECT g, 0"
            " FROM generate_series(-1, 63) AS g ON CONFLICT (shard) DO NOTHING"
        )
        conn.execute(
            "UPDATE outbox_relay_lease SET lo = pg_current_snapshot(), persisted_at = now(),"
            " seen_xmax = pg_snapshot_xmax(pg_current_snapshot()),"
            " sysid = (SELECT system_identifier FROM pg_control_system()) WHERE shard >= 0"
        )
        conn.execute("VACUUM ANALYZE outbox")
        # Days-old rows were checkpointed long ago: the ~1 GB the build (and its VACUUM)
        # dirtied must not be written during the measured drains.
        conn.execute("CHECKPOINT")


def _history_cases(bootstrap: str, rounds: int) -> dict[str, Any]:
    """Drain HISTORY_EVENTS (1,000 keys) from an empty outbox and from one that also holds
    HISTORY_ROWS published rows, interleaved, ``rounds`` times each (the history database is
    kept: each drained backlog joins the history)."""
    empty, full = [], []
    with fresh_database("bench_history") as url:
        started = time.perf_counter()
        _history(url, HISTORY_ROWS)
        built_s = time.perf_counter() - started
        for _ in range(rounds):
            empty.append(_case(1000, bootstrap, raw=False, events=HISTORY_EVENTS)["relay"])
            topic = f"bench-relay-{uuid.uuid4().hex[:8]}"
            asyncio.run(_topics(bootstrap, [topic], create=True))
            try:
                _load(url, _rows(topic, 1000, HISTORY_EVENTS))
                full.append(_relay_drain(url, bootstrap)["relay"])
            finally:
                asyncio.run(_topics(bootstrap, [topic], create=False))
    ratio = median([f / e for f, e in zip(full, empty, strict=True)])
    return {
        "relay_history_rows": HISTORY_ROWS,
        "relay_history_events": HISTORY_EVENTS,
        "relay_history_build_s": round(built_s, 1),
        "relay_empty_table_events_per_s": round(median(empty), 1),
        "relay_history_events_per_s": round(median(full), 1),
        "relay_history_ratio": round(ratio, 3),
        "relay_history_raw": {"empty": empty, "history": full},
    }


def run() -> dict[str, Any]:
    """Warm up, then ``ROUNDS`` rounds of every case side by side; medians + raw figures.

    Each round drains the 1,000-key backlog with one relay and sends the same records raw,
    drains the 10-key backlog, and drains the 1,000-key backlog with two relay processes.
    Then the history case: 100,000 events from an empty table vs from one with 2,000,000
    published rows (``relay_history_ratio``, target >= 0.9).
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
        "relay_event_loop": RELAY_EVENT_LOOP,
        "relay_events_per_s": round(relay, 1),
        "raw_producer_events_per_s": round(raw, 1),
        "relay_vs_raw_ratio": round(median([r["relay"] / r["raw"] for r in normal]), 3),
        "relay_peak_rss_mb": round(max(r["rss_mb"] for r in normal + hot), 1),
        "relay_drain_relay_cpu_us_per_event": round(median([r["relay_cpu_us"] for r in normal]), 1),
        "relay_drain_pg_cpu_us_per_event": round(median([r["pg_cpu_us"] for r in normal]), 1),
        "hot_keys_events_per_s": round(hot_rate, 1),
        "hot_keys_ratio": round(hot_rate / relay, 3),
        "relay_two_processes_events_per_s": round(two_rate, 1),
        "relay_scaling_2_vs_1": round(two_rate / relay, 3),
        "relay_drain_raw": {"normal": normal, "hot_keys": hot, "two_relays": two},
    }
    if HISTORY_ROWS > 0:
        result.update(_history_cases(bootstrap, ROUNDS))
    write_result("relay_drain", result)
    return result


if __name__ == "__main__":
    for name, value in run().items():
        print(f"{name:28} {value}")
