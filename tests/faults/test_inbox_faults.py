"""Fault cases of the inbox (../shared/cases/CASES.md): C05, C06, C09, C10, C11, C12, C13."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer
from redis.asyncio import Redis
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncSession

from ledgerbox.inbox import (
    ConsumerConfig,
    FencedWriteError,
    HandlerContext,
    InboxConsumer,
    InboxStatus,
    Outcome,
    RedisAggregateLock,
    VersionConflictError,
    afenced_update,
    aupdate_versioned,
    fenced_update,
)
from ledgerbox.inbox._consumer import ConsumerHooks
from ledgerbox.inbox._metrics import CONFLICTS, DUPLICATES, REDIS_DEGRADED, RETRIES
from ledgerbox.inbox.testing import kafka_parts, record_for
from ledgerbox.outbox import EventEnvelope, OutboxWriter, TopicRouter
from tests._inbox_support import committed, order_event, poll, produce

REPO = Path(__file__).resolve().parents[2]
metadata = sa.MetaData()
payments = sa.Table(
    "fault_payments",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("consumer_group", sa.Text, nullable=False),
    sa.Column("order_id", sa.Text, nullable=False),
    sa.Column("amount", sa.Numeric(12, 2), nullable=False),
)
accounts = sa.Table(
    "fault_accounts",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("balance", sa.Numeric(12, 2), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=True),
)


@pytest.fixture(scope="module", autouse=True)
def _tables(engine: Engine) -> None:
    metadata.create_all(engine)


def paid(engine: Engine, group: str) -> list[tuple[str, Decimal]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(payments.c.order_id, payments.c.amount)
            .where(payments.c.consumer_group == group)
            .order_by(payments.c.id)
        ).all()
    return [(r[0], r[1]) for r in rows]


def inbox_rows(engine: Engine, group: str) -> list[tuple[uuid.UUID, int, str | None]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT event_id, status, last_error FROM inbox WHERE consumer_group = :g "
                "ORDER BY first_seen_at"
            ),
            {"g": group},
        ).all()
    return [(r[0], r[1], r[2]) for r in rows]


def consumer_for(
    database_url: str,
    bootstrap: str,
    topic: str,
    group: str,
    *,
    hooks: ConsumerHooks | None = None,
    hold_s: float = 0.0,
    dead_letters: Any = None,
    pays: bool = True,
    **extra: Any,
) -> InboxConsumer:
    """A consumer of ``topic`` in ``group``; with ``pays`` its OrderPlaced handler inserts
    a payment (without it, the test registers its own handler)."""
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=database_url,
            kafka_bootstrap_servers=bootstrap,
            commit_interval_ms=20,
            **extra,
        ),
        hooks=hooks,
        dead_letters=dead_letters,
    )
    if not pays:
        return consumer

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        await ctx.session.execute(
            sa.insert(payments).values(
                consumer_group=ctx.group_id,
                order_id=event.payload["order_id"],
                amount=Decimal(event.payload["amount"]),
            )
        )
        if hold_s:
            await asyncio.sleep(hold_s)  # keep the inbox row uncommitted while others race
        if os.environ.get("INBOX_FAULT_BLOCK_FILE"):
            marker = Path(os.environ["INBOX_FAULT_BLOCK_FILE"])
            await asyncio.to_thread(marker.write_text, str(os.getpid()))
            await asyncio.Event().wait()  # "crash" point: the test kills this process here

    return consumer


def spawn_cli(app_ref: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ledgerbox.inbox", "run", "--app", app_ref],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def services(script: str, command: str) -> None:
    subprocess.run(["bash", script, command], check=True, capture_output=True, timeout=120)


# --------------------------------------------------------------------------- C05


def _c05_worker(
    database_url: str, bootstrap: str, topic: str, group: str, barrier: Any, results: Any
) -> None:
    logging.basicConfig(level=logging.WARNING)

    async def main() -> None:
        seen: list[tuple[int, str]] = []
        consumer: InboxConsumer

        async def after_begin(ctx: HandlerContext[Any]) -> None:
            # Both workers hold here with their transaction open, then race on the inbox row.
            await asyncio.to_thread(barrier.wait, 60)

        async def after_commit(record: Any, outcome: Outcome) -> None:
            seen.append((record.offset, outcome.value))
            consumer.stop()

        consumer = consumer_for(
            database_url,
            bootstrap,
            topic,
            group,
            hold_s=0.5,
            hooks=ConsumerHooks(after_begin=after_begin, after_commit=after_commit),
            assignment=[(topic, 0)],
        )
        await asyncio.wait_for(consumer.run(), 120)
        results.put(
            {"seen": seen, "retries": RETRIES.labels(group)._value.get(), "pid": os.getpid()}
        )

    asyncio.run(main())


async def test_c05_two_worker_processes_same_event_one_payment(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any
) -> None:
    topic = await new_topic.acreate("c05", partitions=1)
    group = f"c05-{uuid.uuid4().hex[:8]}"
    await produce(kafka_bootstrap, topic, [order_event(topic, "17")])
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    workers = [
        ctx.Process(
            target=_c05_worker,
            args=(database_url, kafka_bootstrap, topic, group, barrier, results),
        )
        for _ in range(2)
    ]
    for w in workers:
        w.start()
    try:
        reports = [await asyncio.to_thread(results.get, True, 120) for _ in workers]
        for w in workers:
            await asyncio.to_thread(w.join, 60)
            assert w.exitcode == 0
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
    outcomes = sorted(outcome for r in reports for _offset, outcome in r["seen"])
    assert outcomes == ["applied", "duplicate"]
    assert all(len(r["seen"]) == 1 and r["retries"] == 0 for r in reports)  # no error loop
    assert paid(engine, group) == [("17", Decimal("100.00"))]
    assert [status for _id, status, _err in inbox_rows(engine, group)] == [InboxStatus.DONE]
    assert await committed(kafka_bootstrap, group, topic) == 1


# --------------------------------------------------------------------------- C06


async def test_c06_stale_version_conflicts_and_reruns_handler(
    database_url: str, engine: Engine, kafka_bootstrap: str
) -> None:
    group = f"c06-{uuid.uuid4().hex[:8]}"
    account = f"acct-{uuid.uuid4().hex[:6]}"
    with engine.begin() as conn:
        conn.execute(sa.insert(accounts).values(id=account, balance=Decimal("0"), version=1))
    config = ConsumerConfig(
        group_id=group,
        topics=["accounts"],
        database_url=database_url,
        kafka_bootstrap_servers=kafka_bootstrap,
        retry_base_s=0.01,
    )
    consumer_a, consumer_b = InboxConsumer(config), InboxConsumer(config)
    writer = OutboxWriter(TopicRouter(default="accounts"), source="/ledger")

    def credit(amount: str) -> EventEnvelope:
        return writer.event(
            event_type="Credited",
            aggregate_type="account",
            aggregate_id=account,
            payload={"amount": amount},
            idempotency_key=f"credit:{uuid.uuid4()}",
        )

    e_a, e_b = credit("10.00"), credit("50.00")
    versions_read: list[int] = []

    async def apply_credit(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        row = (
            await ctx.session.execute(
                sa.select(accounts.c.balance, accounts.c.version).where(accounts.c.id == account)
            )
        ).one()
        if event.event_id == e_a.event_id:
            versions_read.append(row.version)
            if ctx.attempt == 1:
                # B applies E2 and commits while A holds the old version.
                assert await consumer_b.process_record(record_for(e_b, offset=1)) is (
                    Outcome.APPLIED
                )
        await aupdate_versioned(
            ctx.session,
            accounts,
            {"id": account},
            row.version,
            {"balance": row.balance + Decimal(event.payload["amount"])},
        )

    consumer_a.register("Credited", apply_credit)
    consumer_b.register("Credited", apply_credit)
    conflicts = CONFLICTS.labels(group)._value.get()
    try:
        assert await consumer_a.process_record(record_for(e_a, offset=0)) is Outcome.APPLIED
    finally:
        await consumer_a.aclose()
        await consumer_b.aclose()
    assert versions_read == [1, 2]  # A re-read after its typed conflict
    assert CONFLICTS.labels(group)._value.get() == conflicts + 1
    with engine.connect() as conn:
        final = conn.execute(
            sa.select(accounts.c.balance, accounts.c.version).where(accounts.c.id == account)
        ).one()
    assert tuple(final) == (Decimal("60.00"), 3)  # B's 50 at v2, plus A's 10 re-decided
    with pytest.raises(VersionConflictError), engine.begin() as conn:
        from sqlalchemy.orm import Session

        from ledgerbox.inbox import update_versioned

        with Session(bind=conn) as session:
            update_versioned(session, accounts, {"id": account}, 1, {"balance": 0})


# --------------------------------------------------------------------------- C09 / C10


async def _wait_expired(client: Redis, key: str) -> None:
    async def gone() -> bool:
        return not await client.exists(key)

    await poll(gone, f"{key} to expire", within_s=10)


async def test_c09_release_after_expiry_reports_not_owned(
    redis_client: Redis, redis_prefix: str
) -> None:
    lock = RedisAggregateLock(redis_client, redis_prefix)
    a = await lock.acquire("order:17", 1000)
    assert a is not None
    await _wait_expired(redis_client, f"{redis_prefix}lock:order:17")  # A stalls past its TTL
    b = await lock.acquire("order:17", 10000)
    assert b is not None and b.fencing_token > a.fencing_token
    assert await lock.release(a) is False
    assert await lock.renew(a, 10000) is False
    assert await redis_client.get(f"{redis_prefix}lock:order:17") == b.token.encode()
    assert await lock.acquire("order:17", 10000) is None  # a third worker cannot take it
    assert await lock.release(b) is True


async def test_c10_stale_fencing_token_write_is_rejected(
    database_url: str,
    engine: Engine,
    kafka_bootstrap: str,
    redis_url: str,
    redis_client: Redis,
    redis_prefix: str,
) -> None:
    group = f"c10-{uuid.uuid4().hex[:8]}"
    account = f"acct-{uuid.uuid4().hex[:6]}"
    with engine.begin() as conn:
        conn.execute(sa.insert(accounts).values(id=account, balance=Decimal("0"), version=1))
    lock = RedisAggregateLock(redis_client, redis_prefix)
    name = f"{group}:account:{account}"
    a = await lock.acquire(name, 300)
    assert a is not None
    await _wait_expired(redis_client, f"{redis_prefix}lock:{name}")  # A stalls past the TTL

    consumer_b = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=["accounts"],
            database_url=database_url,
            kafka_bootstrap_servers=kafka_bootstrap,
            redis_url=redis_url,
            redis_key_prefix=redis_prefix,
            lock_aggregates=True,
            lock_ttl_ms=5000,
        )
    )
    tokens: list[int | None] = []

    @consumer_b.handler("Set")
    async def set_balance(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        tokens.append(ctx.fencing_token)
        assert ctx.fencing_token is not None
        await afenced_update(
            ctx.session,
            accounts,
            {"id": account},
            ctx.fencing_token,
            {"balance": Decimal(event.payload["balance"])},
        )

    writer = OutboxWriter(TopicRouter(default="accounts"), source="/ledger")
    e_b = writer.event(
        event_type="Set",
        aggregate_type="account",
        aggregate_id=account,
        payload={"balance": "80.00"},
        idempotency_key=f"set:{uuid.uuid4()}",
    )
    try:
        assert await consumer_b.process_record(record_for(e_b)) is Outcome.APPLIED
    finally:
        await consumer_b.aclose()
    assert tokens[0] is not None and tokens[0] > a.fencing_token
    # A resumes and writes with its old token: refused by the row's fence.
    from sqlalchemy.orm import Session

    with pytest.raises(FencedWriteError), Session(engine) as session, session.begin():
        fenced_update(session, accounts, {"id": account}, a.fencing_token, {"balance": 1})
    assert await lock.release(a) is False
    with engine.connect() as conn:
        final = conn.execute(
            sa.select(accounts.c.balance, accounts.c.fence).where(accounts.c.id == account)
        ).one()
    assert tuple(final) == (Decimal("80.00"), tokens[0])


# --------------------------------------------------------------------------- C11


def c11_app() -> InboxConsumer:
    """`python -m ledgerbox.inbox run` factory for the C11 crashing worker."""
    env = os.environ
    return consumer_for(
        env["INBOX_FAULT_DATABASE_URL"],
        env["KAFKA_BOOTSTRAP_SERVERS"],
        env["INBOX_FAULT_TOPIC"],
        env["INBOX_FAULT_GROUP"],
        redis_url=env["INBOX_FAULT_REDIS_URL"],
        redis_key_prefix=env["INBOX_FAULT_PREFIX"],
        # The default (5 s): the test reads worker 1's in-progress key after seeing it in
        # its handler; with 1.5 s the key expired first on a loaded machine (1 run in 3).
        in_progress_ttl_ms=5000,
    )


async def test_c11_crashed_redis_claimant_never_hides_the_event(
    database_url: str,
    engine: Engine,
    kafka_bootstrap: str,
    new_topic: Any,
    redis_url: str,
    redis_client: Redis,
    redis_prefix: str,
    tmp_path: Path,
) -> None:
    topic = await new_topic.acreate("c11", partitions=1)
    group = f"c11-{uuid.uuid4().hex[:8]}"
    event = order_event(topic, "11")
    await produce(kafka_bootstrap, topic, [event])
    block = tmp_path / "in-handler"
    env = {
        **os.environ,
        "INBOX_FAULT_DATABASE_URL": database_url,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "INBOX_FAULT_TOPIC": topic,
        "INBOX_FAULT_GROUP": group,
        "INBOX_FAULT_REDIS_URL": redis_url,
        "INBOX_FAULT_PREFIX": redis_prefix,
        "INBOX_FAULT_BLOCK_FILE": str(block),
    }
    log = tmp_path / "worker1.log"
    first = spawn_cli("tests.faults.test_inbox_faults:c11_app", env, log)
    second = consumer_for(
        database_url,
        kafka_bootstrap,
        topic,
        group,
        redis_url=redis_url,
        redis_key_prefix=redis_prefix,
        in_progress_ttl_ms=1500,
    )
    try:

        async def in_handler() -> bool:
            assert first.poll() is None, log.read_text()
            return block.exists()

        await poll(in_handler, "worker 1 to claim E1 and enter its handler")
        # Worker 1 holds the fast-path claim (its key scoped to the inbox: any scope).
        busy = f"{redis_prefix}inbox:*:{group}:busy:{event.event_id}"
        assert [key async for key in redis_client.scan_iter(match=busy)]
        racing = asyncio.create_task(second.process_record(record_for(event)))
        await asyncio.sleep(0.2)
        assert not racing.done()  # worker 2 defers to the claim for now
        first.send_signal(signal.SIGKILL)  # worker 1 crashes before its DB commit
        first.wait(30)
        assert await asyncio.wait_for(racing, 60) is Outcome.APPLIED
    finally:
        if first.poll() is None:
            first.kill()
        await second.aclose()
    assert paid(engine, group) == [("11", Decimal("100.00"))]
    done = f"{redis_prefix}inbox:*:{group}:done:{event.event_id}"
    assert [key async for key in redis_client.scan_iter(match=done)]


# --------------------------------------------------------------------------- C12


async def test_c12_redis_outage_processes_through_db_and_recovers(
    database_url: str,
    engine: Engine,
    kafka_bootstrap: str,
    new_topic: Any,
    redis_url: str,
    redis_prefix: str,
    services_script: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = await new_topic.acreate("c12", partitions=1)
    group = f"c12-{uuid.uuid4().hex[:8]}"
    consumer = consumer_for(
        database_url,
        kafka_bootstrap,
        topic,
        group,
        redis_url=redis_url,
        redis_key_prefix=redis_prefix,
        lock_aggregates=True,
        redis_timeout_s=0.2,
        redis_probe_interval_s=0.2,
    )
    task = asyncio.create_task(consumer.run())
    caplog.set_level(logging.WARNING, logger="ledgerbox.inbox")
    try:
        await produce(kafka_bootstrap, topic, [order_event(topic, "E0")])

        async def count(n: int) -> bool:
            assert not task.done(), task
            return len(paid(engine, group)) >= n

        await poll(lambda: count(1), "E0 applied with Redis up")
        assert consumer.health() == "ok"
        services(services_script, "stop-redis")
        try:
            await produce(
                kafka_bootstrap, topic, [order_event(topic, f"E{i}") for i in range(1, 6)]
            )
            await poll(lambda: count(6), "E1..E5 applied through the DB during the outage")
            assert consumer.health() == "degraded"
            assert REDIS_DEGRADED.labels(group)._value.get() == 1
        finally:
            services(services_script, "start-redis")

        async def healthy() -> bool:
            return consumer.health() == "ok"

        await poll(healthy, "health back to ok without a restart")
        assert REDIS_DEGRADED.labels(group)._value.get() == 0
        await produce(kafka_bootstrap, topic, [order_event(topic, "E6")])
        await poll(lambda: count(7), "E6 applied after the outage")
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 60)
    assert [order for order, _ in paid(engine, group)] == [f"E{i}" for i in range(7)]
    outage_logs = [r for r in caplog.records if "redis unavailable" in r.getMessage()]
    assert len(outage_logs) == 1  # once per outage, not per message


async def test_c15_a_consumer_stopped_while_kafka_is_down_returns_cleanly(
    database_url: str,
    engine: Engine,
    kafka_bootstrap: str,
    new_topic: Any,
    services_script: str,
) -> None:
    """SIGTERM during a Kafka outage: ``run()`` must return, not raise. aiokafka's ``stop()``
    let its own fetch task's CancelledError escape with the broker away, so the CLI exited 1
    with a traceback (found by a reviewer: ``ledgerbox consumer run`` after ``stop-kafka``)."""
    topic = await new_topic.acreate("c15", partitions=1)
    group = f"c15-{uuid.uuid4().hex[:8]}"
    consumer = consumer_for(database_url, kafka_bootstrap, topic, group)
    task = asyncio.create_task(consumer.run())
    try:
        await produce(kafka_bootstrap, topic, [order_event(topic, "K0")])

        async def applied() -> bool:
            assert not task.done(), task
            return len(paid(engine, group)) >= 1

        await poll(applied, "K0 applied before the outage")
        services(services_script, "stop-kafka")
        try:
            await asyncio.sleep(3)  # the fetcher now fails against the missing broker
            consumer.stop()
            await asyncio.wait_for(asyncio.shield(task), 90)
        finally:
            services(services_script, "start-kafka")
    finally:
        consumer.stop()
        if not task.done():
            await asyncio.wait_for(task, 90)
    assert not task.cancelled() and task.exception() is None
    assert [order for order, _ in paid(engine, group)] == ["K0"]


# --------------------------------------------------------------------------- C13


async def test_c13_poison_record_dead_lettered_and_partition_moves_on(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any
) -> None:
    topic = await new_topic.acreate("c13", partitions=1)
    dlq = await new_topic.acreate("c13-dlq", partitions=1)
    group = f"c13-{uuid.uuid4().hex[:8]}"
    e1, e2, e3 = (order_event(topic, o) for o in ("E1", "E2", "E3"))
    bad_headers = [("ce_type", b"OrderPlaced"), ("trace", b"\x00\x01")]
    await produce(kafka_bootstrap, topic, [e1, (b"bad-key", b"\xff", bad_headers), e2])

    async def run_until(offset: int) -> None:
        consumer = consumer_for(database_url, kafka_bootstrap, topic, group, dead_letter_topic=dlq)
        task = asyncio.create_task(consumer.run())
        try:

            async def done() -> bool:
                assert not task.done(), task
                return await committed(kafka_bootstrap, group, topic) == offset

            await poll(done, f"offset {offset} committed")
        finally:
            consumer.stop()
            await asyncio.wait_for(task, 60)

    await run_until(3)
    assert paid(engine, group) == [("E1", Decimal("100.00")), ("E2", Decimal("100.00"))]

    reader = AIOKafkaConsumer(
        dlq,
        bootstrap_servers=kafka_bootstrap,
        auto_offset_reset="earliest",
        group_id=f"{group}-dlq-reader",
    )
    await reader.start()
    try:
        parked = await asyncio.wait_for(reader.getone(), 60)
    finally:
        await reader.stop()
    headers = dict(parked.headers)
    assert (parked.key, parked.value) == (b"bad-key", b"\xff")
    assert headers["ce_type"] == b"OrderPlaced" and headers["trace"] == b"\x00\x01"
    assert headers["ledgerbox_error_type"] == b"ledgerbox.outbox.EnvelopeParseError"
    assert b"not JSON" in headers["ledgerbox_error_message"]
    assert headers["ledgerbox_source_topic"] == topic.encode()
    assert (headers["ledgerbox_source_partition"], headers["ledgerbox_source_offset"]) == (
        b"0",
        b"1",
    )
    assert headers["ledgerbox_attempts"] == b"1"
    assert headers["ledgerbox_consumer_group"] == group.encode(), "whose dead letter it is"

    # Restart: nothing is applied again; new work still flows.
    await produce(kafka_bootstrap, topic, [e3])
    await run_until(4)
    assert [o for o, _ in paid(engine, group)] == ["E1", "E2", "E3"]


def _parked_consumer(
    database_url: str, kafka_bootstrap: str, prefix: str, **config: Any
) -> tuple[InboxConsumer, Any]:
    """A consumer of "orders" in a new group whose dead letters go to an in-memory publisher:
    (consumer, publisher)."""
    from ledgerbox.inbox.testing import InMemoryDeadLetterPublisher

    group = f"{prefix}-{uuid.uuid4().hex[:8]}"
    parked = InMemoryDeadLetterPublisher()
    consumer = consumer_for(
        database_url,
        kafka_bootstrap,
        "orders",
        group,
        dead_letters=parked,
        pays=False,
        **config,
    )
    return consumer, parked


async def _dead_lettered_once(
    consumer: InboxConsumer, parked: Any, engine: Engine, event: EventEnvelope, record: Any
) -> str:
    """Process ``record`` (of ``event``) once, close the consumer, and check it was
    dead-lettered - on the dead-letter publisher once, its inbox row DEAD_LETTERED - within
    20 s (not retried without bound); returns the row's ``last_error``."""
    try:
        outcome = await asyncio.wait_for(consumer.process_record(record), 20)
    finally:
        await consumer.aclose()
    assert outcome is Outcome.DEAD_LETTERED and len(parked.records) == 1
    [(event_id, status, error)] = inbox_rows(engine, consumer.group_id)
    assert (event_id, status) == (event.event_id, InboxStatus.DEAD_LETTERED)
    assert error is not None
    return str(error)


async def test_c13_nul_in_ce_type_is_dead_lettered_with_its_inbox_row_not_a_stall(
    database_url: str, engine: Engine, kafka_bootstrap: str
) -> None:
    # Before: since a NUL makes a record unparseable, its inbox row was written with the raw
    # ce_type; psycopg refused the NUL client-side (no SQLSTATE: an ENVIRONMENT fault), so
    # the dead-letterer retried it without bound and the partition stopped for good (health
    # down). The record was already on the dead-letter topic.
    from ledgerbox.inbox.testing import FakeRecord

    consumer, parked = _parked_consumer(database_url, kafka_bootstrap, "c13c")
    group = consumer.group_id
    event = order_event("orders", "N1")
    key, value, headers = kafka_parts(event)
    headers = [(k, b"Order\x00Placed" if k == "ce_type" else v) for k, v in headers]
    record = FakeRecord("orders", 0, 7, key, value, tuple(headers))
    error = await _dead_lettered_once(consumer, parked, engine, event, record)
    assert "event_type contains a NUL character" in error
    with engine.connect() as conn:
        stored_type = conn.execute(
            sa.text("SELECT event_type FROM inbox WHERE consumer_group = :g"), {"g": group}
        ).scalar_one()
    assert stored_type == "Order\ufffdPlaced"


@pytest.mark.parametrize("message", ["card \x00 refused", "card \udcff refused"])
async def test_c13_a_handler_error_with_a_nul_or_a_lone_surrogate_is_dead_lettered_not_a_stall(
    database_url: str, engine: Engine, kafka_bootstrap: str, message: str
) -> None:
    # Before: last_error was the exception's raw text; PostgreSQL text cannot hold either
    # character, psycopg refused it client-side (no SQLSTATE: ENVIRONMENT) and the
    # dead-letterer retried without bound: the partition stopped for good.
    consumer, parked = _parked_consumer(database_url, kafka_bootstrap, "c13d", max_attempts=1)

    @consumer.handler("OrderPlaced")
    async def refuse(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        raise ValueError(message)

    event = order_event("orders", "S1")
    error = await _dead_lettered_once(consumer, parked, engine, event, record_for(event))
    assert error.startswith("ValueError: card ") and "refused" in error


async def test_c13_a_handler_writing_a_nul_is_dead_lettered_not_a_stall(
    database_url: str, engine: Engine, kafka_bootstrap: str
) -> None:
    # Before: psycopg refuses a NUL in a text parameter client-side (DataError without a
    # SQLSTATE), which was classified ENVIRONMENT: retried without bound, partition down.
    consumer, parked = _parked_consumer(database_url, kafka_bootstrap, "c13e")
    group = consumer.group_id

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        await ctx.session.execute(
            sa.insert(payments).values(consumer_group=group, order_id="N\x00", amount=1)
        )

    event = order_event("orders", "N2")
    error = await _dead_lettered_once(consumer, parked, engine, event, record_for(event))
    assert paid(engine, group) == []
    assert "NUL" in error


async def test_c13_handler_failing_for_good_is_dead_lettered_with_failed_inbox_row(
    database_url: str, engine: Engine, kafka_bootstrap: str
) -> None:
    from ledgerbox.inbox.testing import InMemoryDeadLetterPublisher

    group = f"c13b-{uuid.uuid4().hex[:8]}"
    parked = InMemoryDeadLetterPublisher()
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=["orders"],
            database_url=database_url,
            kafka_bootstrap_servers=kafka_bootstrap,
            max_attempts=3,
            retry_base_s=0.01,
        ),
        dead_letters=parked,
    )
    calls: list[int] = []

    @consumer.handler("OrderPlaced")
    async def flaky(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        calls.append(ctx.attempt)
        await ctx.session.execute(
            sa.insert(payments).values(consumer_group=group, order_id="x", amount=1)
        )
        raise TimeoutError("payment gateway timed out")

    event = order_event("orders", "F1")
    retries = RETRIES.labels(group)._value.get()
    try:
        assert await consumer.process_record(record_for(event, offset=9)) is (Outcome.DEAD_LETTERED)
    finally:
        await consumer.aclose()
    assert calls == [1, 2, 3]
    assert RETRIES.labels(group)._value.get() == retries + 2
    assert paid(engine, group) == []  # every attempt rolled back
    [(topic, _key, value, headers)] = parked.records
    assert topic == "orders.dlq" and value == kafka_parts(event)[1]
    assert dict(headers)["ledgerbox_attempts"] == b"3"
    [(event_id, status, error)] = inbox_rows(engine, group)
    assert (event_id, status) == (event.event_id, InboxStatus.DEAD_LETTERED)
    assert error is not None and "TimeoutError" in error
    assert DUPLICATES.labels(group, "db")._value.get() == 0
