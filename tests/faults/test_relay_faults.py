"""Fault cases of the relay (../shared/cases/CASES.md): C01-C04, C07, C08, C14, outages.

Real PostgreSQL and Apache Kafka; relays run in-process or as real ``python -m ledgerbox.relay run``
subprocesses where the case needs a process to die.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
from aiokafka import ConsumerRecord
from prometheus_client import REGISTRY
from psycopg import sql as psycopg_sql
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from ledgerbox._core.faults import Fault
from ledgerbox.relay import Relay, RelayConfig, StoreError
from ledgerbox.relay._pgstore import (
    CLAIM_BATCH_HOLD,
    CLEANUP_PUBLISHED,
    PgRelayStore,
    claim_params,
    pg_store_factory,
)
from ledgerbox.relay._store import (
    Cursor,
    CursorWrite,
    DeadLetter,
    PersistOutcome,
    RelayStore,
    ShardRead,
    StoreFactory,
)
from tests import _relay_support as rs
from tests._relay_support import DelegatingStore
from tests._services import TopicFactory

Records = list[ConsumerRecord[bytes, bytes]]


async def _until(check: Callable[[], Awaitable[bool] | bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within_s}s waiting for {what}")
        await asyncio.sleep(0.05)


def _seqs_by_key(records: Records) -> dict[bytes, list[int]]:
    out: dict[bytes, list[int]] = {}
    for record in records:
        assert record.key is not None and record.value is not None
        out.setdefault(record.key, []).append(json.loads(record.value)["seq"])
    return out


def _first_occurrences(seqs: list[int]) -> list[int]:
    seen: set[int] = set()
    firsts = []
    for s in seqs:
        if s not in seen:
            seen.add(s)
            firsts.append(s)
    return firsts


def _ids(records: Records) -> set[str]:
    return {rs.header(r, "ce_id") for r in records}


@contextlib.asynccontextmanager
async def _running(relay: Relay):  # type: ignore[no-untyped-def]
    task = asyncio.create_task(relay.run())
    try:
        yield task
    finally:
        relay.stop()
        await asyncio.wait_for(task, 60)


# --------------------------------------------------------------------------- C01


async def test_c01_out_of_order_commit_not_skipped(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("c01", partitions=3)
    writer = rs.writer_for(topic)
    e1, e2 = rs.event(writer, "agg-1", 1), rs.event(writer, "agg-2", 1)
    t1 = Session(engine)
    t1.begin()
    writer.stage(t1, e1)
    t1.flush()  # E1 has the lower id and its transaction stays open
    rs.stage(engine, writer, [e2])
    relay = Relay(rs.config(database_url, kafka_bootstrap))
    try:
        assert await relay.run_once() == 1, "only the committed E2 is visible"
        t1.commit()
        assert await relay.run_once() == 1, "E1 committed late is still pending and found"
        assert await relay.run_once() == 0
    finally:
        t1.close()
        await relay.aclose()
    records = await rs.consume(kafka_bootstrap, topic, until=lambda r: len(r) >= 2)
    assert _ids(records) == {str(e1.event_id), str(e2.event_id)}
    assert rs.pending_count(engine) == 0


async def test_c01_same_aggregate_kafka_order_is_commit_order(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("c01b", partitions=3)
    writer = rs.writer_for(topic)
    e1, e2 = rs.event(writer, "agg-s", 1), rs.event(writer, "agg-s", 2)
    t1 = Session(engine)
    t1.begin()
    writer.stage(t1, e1)
    t1.flush()
    rs.stage(engine, writer, [e2])  # committed first, although its id is higher
    relay = Relay(rs.config(database_url, kafka_bootstrap))
    try:
        assert await relay.run_once() == 1
        t1.commit()
        assert await relay.run_once() == 1
    finally:
        t1.close()
        await relay.aclose()
    records = await rs.consume(kafka_bootstrap, topic, until=lambda r: len(r) >= 2)
    assert [rs.header(r, "ce_id") for r in records] == [str(e2.event_id), str(e1.event_id)]


# --------------------------------------------------------------------------- C02


async def test_c02_relay_killed_after_first_batch_loses_nothing(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("c02", partitions=1)
    writer = rs.writer_for(topic)
    events = [rs.event(writer, "order-2", i) for i in (1, 2, 3)]
    rs.stage(engine, writer, events)  # one transaction, one now()
    # TEST-ONLY hook (RelayHooks.after_confirm): 10 s between "Kafka confirmed" and "mark
    # published", so SIGKILL lands after the first batch was sent and before it was marked.
    proc = rs.relay_process(
        database_url, kafka_bootstrap, "--batch-size", "2", hooks=("--mark-delay-ms", "10000")
    )
    try:
        first = await rs.consume(kafka_bootstrap, topic, until=lambda r: len(r) >= 2)
    finally:
        rs.stop_process(proc, kill=True)
    assert proc.returncode == -9
    assert [json.loads(r.value or b"")["seq"] for r in first] == [1, 2]
    assert rs.pending_count(engine) == 3, "killed before marking: all three still pending"

    rs.reset_relay_tables(engine)  # the dead relay's leases would otherwise expire in 3 s
    restarted = rs.relay_process(database_url, kafka_bootstrap, "--batch-size", "2")
    try:
        records = await rs.consume(
            kafka_bootstrap, topic, until=lambda r: len(_ids(r)) >= 3, within_s=60
        )
        await _until(lambda: rs.pending_count(engine) == 0, 30, "rows marked")
    finally:
        assert rs.stop_process(restarted) == 0, "SIGTERM: clean exit 0"
    assert _ids(records) == {str(e.event_id) for e in events}
    by_id: dict[str, set[tuple[bytes | None, str]]] = {}
    for r in records:
        by_id.setdefault(rs.header(r, "ce_id"), set()).add(
            (r.key, rs.header(r, "ce_idempotencykey"))
        )
    assert all(len(v) == 1 for v in by_id.values()), "a duplicate carries the same id and key"
    assert _first_occurrences(_seqs_by_key(records)[b"order-2"]) == [1, 2, 3]


# --------------------------------------------------------------------------- C03


async def test_c03_two_relays_keep_aggregate_order(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("c03", partitions=3)
    writer = rs.writer_for(topic)
    e1, e2 = rs.event(writer, "agg-A", 1), rs.event(writer, "agg-A", 2)
    rs.stage(engine, writer, [e1])
    rs.stage(engine, writer, [e2])
    hooks = ("--send-delay-ms", "200")  # TEST-ONLY (RelayHooks.before_first_send)
    procs = [
        rs.relay_process(
            database_url,
            kafka_bootstrap,
            "--batch-size",
            "1",
            "--relay-id",
            f"c03-{i}",
            hooks=hooks,
        )
        for i in (1, 2)
    ]
    samples: list[list[tuple[int, str | None]]] = []
    try:
        deadline = time.monotonic() + 60
        records: Records = []
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                samples.append(
                    [
                        (int(s), o)
                        for s, o in conn.execute(
                            text(
                                "SELECT shard, owner FROM outbox_relay_lease "
                                "WHERE owner IS NOT NULL AND expires_at > now() AND shard >= 0"
                            )
                        )
                    ]
                )
            if rs.pending_count(engine) == 0 and {o for s in samples[-1:] for _, o in s} == {
                "c03-1",
                "c03-2",
            }:
                break
            await asyncio.sleep(0.1)
        records = await rs.consume(kafka_bootstrap, topic, until=lambda r: len(_ids(r)) >= 2)
    finally:
        codes = [rs.stop_process(p) for p in procs]
    assert codes == [0, 0]
    assert _first_occurrences(_seqs_by_key(records)[b"agg-A"]) == [1, 2]
    for sample in samples:
        shards = [s for s, _ in sample]
        assert len(shards) == len(set(shards)), "a shard had two live owners"
    assert {o for sample in samples for _, o in sample} == {"c03-1", "c03-2"}, "shards split"
    last = samples[-1]
    per_owner = {o: sum(1 for _, x in last if x == o) for o in ("c03-1", "c03-2")}
    assert per_owner == {"c03-1": 32, "c03-2": 32}, per_owner


# --------------------------------------------------------------------------- C04


class _MarkFault:
    """Injected fault shared by every persist ("mark") store of one relay: ``persist`` (the
    write that records the published events) fails ``failures`` times (on whichever lane),
    then goes through."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def factory(self, config: RelayConfig) -> StoreFactory:
        """Real PostgreSQL stores for every role; the mark stores wrapped with the fault."""
        real = pg_store_factory(config)

        def build(role: str) -> RelayStore:
            store = real(role)
            return _FlakyMarkStore(store, self) if role.startswith("mark") else store

        return build


class _FlakyMarkStore(DelegatingStore):
    """A real store whose ``persist`` fails while the shared fault says so."""

    def __init__(self, inner: RelayStore, fault: _MarkFault) -> None:
        super().__init__(inner)
        self.fault = fault

    async def persist(
        self,
        cursors: Sequence[CursorWrite],
        dead: Sequence[DeadLetter] = (),
        held: Sequence[tuple[int, int]] = (),
    ) -> dict[int, PersistOutcome]:
        self.fault.calls += 1
        if self.fault.failures > 0:
            self.fault.failures -= 1
            raise StoreError("injected: connection lost", sqlstate="08006", fault=Fault.ENVIRONMENT)
        return await self.inner.persist(cursors, dead, held)


def _metric(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


async def test_c04_mark_fails_three_times_after_send(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("c04", partitions=1)
    writer = rs.writer_for(topic)
    e1 = rs.event(writer, "pay-1", 1)
    rs.stage(engine, writer, [e1])
    config = rs.config(database_url, kafka_bootstrap)
    before = _metric("ledgerbox_relay_retries_total", {"stage": "mark"})
    fault = _MarkFault(failures=3)
    relay = Relay(config, store_factory=fault.factory(config))
    async with _running(relay):
        await _until(lambda: rs.pending_count(engine) == 0, 60, "E1 marked after the fault")
    assert fault.calls == 4
    assert _metric("ledgerbox_relay_retries_total", {"stage": "mark"}) - before == 3

    # The process dies while marking keeps failing: the next relay sends E1 again.
    e2 = rs.event(writer, "pay-1", 2)
    rs.stage(engine, writer, [e2])
    dying = Relay(config, store_factory=_MarkFault(failures=10**6).factory(config))
    task = asyncio.create_task(dying.run())
    await rs.consume(kafka_bootstrap, topic, until=lambda r: str(e2.event_id) in _ids(r))
    task.cancel()  # crash: no mark, no release
    with contextlib.suppress(asyncio.CancelledError):
        await task
    rs.reset_relay_tables(engine)
    assert rs.pending_count(engine) == 1
    healthy = Relay(config)
    try:
        assert await healthy.run_once() == 1
    finally:
        await healthy.aclose()
    records = await rs.consume(kafka_bootstrap, topic, until=lambda r: len(r) >= 3)
    copies = [r for r in records if rs.header(r, "ce_id") == str(e2.event_id)]
    assert len(copies) == 2
    assert {(r.key, rs.header(r, "ce_idempotencykey")) for r in copies} == {
        (b"pay-1", e2.idempotency_key)
    }
    assert [
        rs.header(r, "ce_id") for r in records if rs.header(r, "ce_id") == str(e1.event_id)
    ] == [str(e1.event_id)]


# --------------------------------------------------------------------------- C07


async def test_c07_nothing_on_kafka_before_commit_and_never_after_rollback(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("c07", partitions=1)
    writer = rs.writer_for(topic)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS c07_orders (id text PRIMARY KEY)"))
    inserted = threading.Event()
    go_commit = threading.Event()
    e1 = rs.event(writer, "O1", 1)

    def producer() -> None:
        with Session(engine) as session, session.begin():
            session.execute(text("INSERT INTO c07_orders (id) VALUES ('O1')"))
            writer.stage(session, e1)
            session.flush()
            inserted.set()
            go_commit.wait(30)  # the 500 ms "before COMMIT" window, held open by the test

    def rolled_back() -> None:
        with contextlib.suppress(RuntimeError), Session(engine) as session, session.begin():
            session.execute(text("INSERT INTO c07_orders (id) VALUES ('O2')"))
            writer.stage(session, rs.event(writer, "O2", 1))
            session.flush()
            raise RuntimeError("business rule failed")

    relay = Relay(rs.config(database_url, kafka_bootstrap, poll_interval_s=0.1))
    async with _running(relay):
        await _until(lambda: len(relay.owned_shards()) == 64, 20, "relay owns shards")
        thread = threading.Thread(target=producer)
        thread.start()
        await asyncio.to_thread(inserted.wait, 30)
        await asyncio.to_thread(rolled_back)
        await asyncio.sleep(0.5)  # the relay polls 5 times meanwhile
        early = await rs.consume(kafka_bootstrap, topic, until=lambda r: True, within_s=5)
        # the consumer's first fetch may return nothing: read for a moment to be sure
        early += await _read_for(kafka_bootstrap, topic, 1.0)
        assert early == [], "nothing reaches Kafka before COMMIT"
        go_commit.set()
        await asyncio.to_thread(thread.join, 30)
        records = await rs.consume(kafka_bootstrap, topic, until=lambda r: len(r) >= 1)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT id FROM c07_orders")).scalars().all() == ["O1"]
        await _until(lambda: rs.pending_count(engine) == 0, 20, "idle")
    records = await _read_for(kafka_bootstrap, topic, 1.0)
    assert [r.key for r in records] == [b"O1"], "the rolled-back O2 never appears"
    assert rs.header(records[0], "ce_id") == str(e1.event_id)


async def _read_for(bootstrap: str, topic: str, seconds: float) -> Records:
    end = time.monotonic() + seconds
    return await rs.consume(bootstrap, topic, until=lambda r: time.monotonic() > end)


# --------------------------------------------------------------------------- C08


async def test_c08_writer_killed_after_commit_relay_publishes_later(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("c08", partitions=1)
    key = f"c08-{uuid.uuid4().hex[:6]}"
    script = textwrap.dedent(
        f"""
        import sys, time
        from sqlalchemy import create_engine
        from sqlalchemy.orm import Session
        from ledgerbox.outbox import OutboxWriter, TopicRouter
        TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        engine = create_engine({database_url!r})
        writer = OutboxWriter(TopicRouter(default={topic!r}), source="/c08")
        ev = writer.event(event_type="PaymentTaken", aggregate_type="payment",
                          aggregate_id={key!r}, payload={{"seq": 1, "amount": "100.00"}},
                          idempotency_key="c08:{key}", headers={{"traceparent": TP}})
        with Session(engine) as s, s.begin():
            writer.stage(s, ev)
        print(ev.event_id, flush=True)
        time.sleep(60)  # a post-commit "publish now" fast path would run here
        """
    )
    proc = await asyncio.to_thread(
        subprocess.Popen, [sys.executable, "-c", script], cwd=rs.REPO_ROOT, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        event_id = (await asyncio.to_thread(proc.stdout.readline)).decode().strip()
    finally:
        proc.kill()
        proc.wait(10)
    assert event_id, "the writer committed"
    assert rs.pending_count(engine) == 1
    relay = Relay(rs.config(database_url, kafka_bootstrap))
    try:
        assert await relay.run_once() == 1
    finally:
        await relay.aclose()
    records = await rs.consume(kafka_bootstrap, topic, until=lambda r: len(r) >= 1)
    assert len(records) == 1
    r = records[0]
    assert r.key == key.encode()
    assert rs.header(r, "ce_id") == event_id
    assert rs.header(r, "ce_idempotencykey") == f"c08:{key}"
    assert rs.header(r, "traceparent").startswith("00-0af7651916cd43dd")
    assert json.loads(r.value or b"") == {"seq": 1, "amount": "100.00"}


# --------------------------------------------------------------------------- on_dead_letter


async def test_permanent_reject_parks_dead_and_holds_the_key(
    engine: Engine, database_url: str
) -> None:
    from aiokafka.errors import MessageSizeTooLargeError

    from ledgerbox.relay.testing import InMemoryPublisher

    rs.reset_relay_tables(engine)
    writer = rs.writer_for("dead-test")
    bad = rs.event(writer, "k-bad", 1, payload={"seq": 1, "huge": True})
    rs.stage(engine, writer, [bad, rs.event(writer, "k-bad", 2), rs.event(writer, "k-ok", 1)])
    publisher = InMemoryPublisher()
    publisher.reject_on_send(lambda r: b'"huge"' in r.value, MessageSizeTooLargeError())
    before = _metric("ledgerbox_relay_dead_lettered_total")
    relay = Relay(rs.config(database_url, "unused:9092"), publisher=publisher)
    try:
        assert await relay.run_once() == 1
        assert await relay.run_once() == 0
    finally:
        await relay.aclose()
    assert [(r.key, json.loads(r.value)["seq"]) for r in publisher.records] == [(b"k-ok", 1)]
    assert _metric("ledgerbox_relay_dead_lettered_total") - before == 1
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT partition_key, status, last_error FROM outbox "
                "WHERE topic = 'dead-test' ORDER BY id"
            )
        ).all()
    assert [(k, s) for k, s, _ in rows] == [("k-bad", 2), ("k-bad", 3), ("k-ok", 0)], (
        "dead, held behind it, published (the cursor passed all three)"
    )
    assert rows[0][2].startswith("MessageSizeTooLargeError")
    assert len(rs.published_ids(engine, "dead-test")) == 1
    assert rs.pending_count(engine) == 0

    skipping = Relay(
        rs.config(database_url, "unused:9092", on_dead_letter="skip"), publisher=publisher
    )
    try:
        assert await skipping.run_once() == 1, "on_dead_letter='skip' publishes the held event"
    finally:
        await skipping.aclose()
    assert publisher.records[-1].key == b"k-bad"


# --------------------------------------------------------------------------- C14


def _producer_latencies(engine: Engine, writer: Any, seconds: float, rate: float) -> list[float]:
    latencies: list[float] = []
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < seconds:
        t0 = time.perf_counter()
        with Session(engine) as session, session.begin():
            writer.stage(session, rs.event(writer, f"p{n % 50}", n))
        latencies.append(time.perf_counter() - t0)
        n += 1
        pause = start + n / rate - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    return latencies


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


@pytest.mark.slow
async def test_c14_cleanup_bounded_batches_never_deletes_pending(
    engine: Engine, database_url: str
) -> None:
    rs.reset_relay_tables(engine)
    writer = rs.writer_for("c14-live")
    with engine.begin() as conn:
        # Published 8 days ago (v2: the cursor passed them; half of them under v1, status 1).
        conn.execute(
            text(
                """INSERT INTO outbox (event_id, idempotency_key, topic, partition_key, shard,
                event_type, source, aggregate_type, aggregate_id, payload, occurred_at, status,
                created_at)
                SELECT gen_random_uuid(), 'c14:' || g, 'c14', 'k' || (g % 1000), g % 64, 'E',
                  's', 'a', 'k' || (g % 1000), '{"x": 1}', now(), g % 2,
                  now() - interval '8 days'
                FROM generate_series(1, 200000) g"""
            )
        )
    with engine.begin() as conn:
        # Every shard's cursor passes them (what the relay persisted after publishing them).
        conn.execute(
            text(
                "INSERT INTO outbox_relay_lease (shard, fence) SELECT g, 0"
                " FROM generate_series(-1, 63) g ON CONFLICT (shard) DO NOTHING"
            )
        )
        conn.execute(
            text(
                "UPDATE outbox_relay_lease SET lo = pg_current_snapshot(),"
                " sysid = (SELECT system_identifier FROM pg_control_system())"
            )
        )
    with engine.begin() as conn:
        # Old but NOT published (committed after the cursor: pending) or dead-lettered:
        # cleanup must never touch them, although they are older than the retention and
        # below the tick's horizon.
        conn.execute(
            text(
                """INSERT INTO outbox (event_id, idempotency_key, topic, partition_key, shard,
                event_type, source, aggregate_type, aggregate_id, payload, occurred_at, status,
                created_at)
                SELECT gen_random_uuid(), 'c14-keep:' || g, 'c14', 'keep', 7, 'E', 's', 'a',
                  'keep', '{"x": 1}', now(), CASE WHEN g % 2 = 0 THEN 0 ELSE 2 END,
                  now() - interval '30 days'
                FROM generate_series(1, 100) g"""
            )
        )
    with engine.begin() as conn:
        # The leader's tick of that time: every row above was written before it.
        conn.execute(
            text(
                "INSERT INTO outbox_relay_tick (taken_at, horizon) SELECT now() - interval"
                " '7 days 1 hour', pg_snapshot_xmin(pg_current_snapshot())"
            )
        )
        conn.execute(text("ANALYZE outbox"))
    assert rs.pending_count(engine) == 50
    config = rs.config(database_url, "unused:9092", cleanup_batch_size=1000)
    store = PgRelayStore(config, "test")
    try:
        # The pending-events query (the claim) and the cleanup use the (shard, txid) index.
        pg = await store._connection()
        with engine.connect() as conn:
            cursors = conn.execute(
                text("SELECT shard, lo::text FROM outbox_relay_lease WHERE shard >= 0")
            ).all()
        claim = claim_params([ShardRead(s, Cursor(lo)) for s, lo in cursors], 1000)
        for template, params in (
            (CLAIM_BATCH_HOLD, claim),
            (CLEANUP_PUBLISHED, {"retention_s": 7 * 86400.0, "limit": 1000}),
        ):
            cur = await pg.execute(psycopg_sql.SQL("EXPLAIN ") + store._q(template), params)
            plan = "\n".join(row[0] for row in await cur.fetchall())
            assert "ix_outbox_shard_txid" in plan, plan
            assert "Seq Scan on outbox " not in plan, plan

        baseline = await asyncio.to_thread(_producer_latencies, engine, writer, 4.0, 100.0)
        sizes: list[int] = []
        lock_waits: list[int] = []

        async def cleanup() -> None:
            while True:
                n = await store.cleanup_published(7 * 86400.0, 1000)
                sizes.append(n)
                if n < 1000:
                    return
                await asyncio.sleep(config.cleanup_pause_s)

        async def watch_locks() -> None:
            while True:
                with engine.connect() as c:
                    lock_waits.append(
                        int(
                            c.execute(
                                text(
                                    "SELECT count(*) FROM pg_locks l JOIN pg_class r ON r.oid = "
                                    "l.relation WHERE r.relname = 'outbox' AND l.mode IN "
                                    "('ShareLock','ShareRowExclusiveLock','ExclusiveLock',"
                                    "'AccessExclusiveLock')"
                                )
                            ).scalar_one()
                        )
                    )
                await asyncio.sleep(0.2)

        watcher = asyncio.create_task(watch_locks())
        cleaning = asyncio.create_task(cleanup())
        during = await asyncio.to_thread(_producer_latencies, engine, writer, 4.0, 100.0)
        await asyncio.wait_for(cleaning, 300)
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    finally:
        await store.aclose()
    assert sum(sizes) == 200000
    assert max(sizes) <= 1000, "bounded batches"
    assert max(lock_waits, default=0) == 0, "no table lock"
    with engine.connect() as conn:
        kept = conn.execute(
            text("SELECT status, count(*) FROM outbox WHERE topic = 'c14' GROUP BY status")
        ).all()
    assert {int(status): int(n) for status, n in kept} == {0: 50, 2: 50}, (
        "no pending or dead row deleted"
    )
    p99_base, p99_during = _p99(baseline) * 1000, _p99(during) * 1000
    print(
        f"C14: {len(sizes)} DELETE batches (max {max(sizes)} rows); producer p99 "
        f"{p99_base:.1f} ms without cleanup, {p99_during:.1f} ms with cleanup "
        f"({len(baseline)} / {len(during)} tx)"
    )
