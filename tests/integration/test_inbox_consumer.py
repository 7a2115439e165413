"""Inbox consumer against real PostgreSQL, Kafka and Redis: one effect per event and group."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import sqlalchemy as sa
from redis.asyncio import Redis
from sqlalchemy import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ledgerbox._core.database_url import database_label
from ledgerbox._core.redis_url import redis_label
from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer, Outcome
from ledgerbox.inbox import _runner as runner_module
from ledgerbox.inbox._handlers import ConsumerHooks
from ledgerbox.inbox._metrics import CLIENT_REPLACED, DUPLICATES, PROCESSED
from ledgerbox.inbox.testing import record_for
from ledgerbox.outbox import EventEnvelope, OutboxTable, OutboxWriter, TopicRouter
from tests._inbox_support import committed, order_event, poll, produce

REPO = Path(__file__).resolve().parents[2]
metadata = sa.MetaData()
payments = sa.Table(
    "it_payments",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("consumer_group", sa.Text, nullable=False),
    sa.Column("order_id", sa.Text, nullable=False),
    sa.Column("amount", sa.Numeric(12, 2), nullable=False),
    sa.Column("handler", sa.Text, nullable=False),
)


@pytest.fixture(scope="module", autouse=True)
def _tables(engine: Engine) -> None:
    metadata.create_all(engine)


def payment_rows(engine: Engine, group: str) -> list[tuple[str, Decimal, str]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(payments.c.order_id, payments.c.amount, payments.c.handler)
            .where(payments.c.consumer_group == group)
            .order_by(payments.c.id)
        ).all()
    return [(r[0], r[1], r[2]) for r in rows]


def make_consumer(
    database_url: str,
    bootstrap: str,
    topic: str,
    group: str,
    *,
    hooks: ConsumerHooks | None = None,
    **extra: Any,
) -> InboxConsumer:
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
    )

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        await ctx.session.execute(
            sa.insert(payments).values(
                consumer_group=ctx.group_id,
                order_id=event.payload["order_id"],
                amount=Decimal(event.payload["amount"]),
                handler="async",
            )
        )

    return consumer


@pytest_asyncio.fixture
async def running() -> AsyncIterator[Callable[[InboxConsumer], Awaitable[None]]]:
    started: list[tuple[InboxConsumer, asyncio.Task[None]]] = []

    async def start(consumer: InboxConsumer) -> None:
        started.append((consumer, asyncio.create_task(consumer.run())))

    yield start
    for consumer, _task in started:
        consumer.stop()
    for _consumer, task in started:
        await asyncio.wait_for(task, 60)


async def test_same_event_delivered_five_times_applies_once(
    database_url: str,
    engine: Engine,
    kafka_bootstrap: str,
    new_topic: Any,
    redis_url: str,
    redis_prefix: str,
    running: Any,
) -> None:
    topic = await new_topic.acreate("inbox-dup", partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    event = order_event(topic, "17")
    await produce(kafka_bootstrap, topic, [event] * 5)
    before_db = DUPLICATES.labels(group, "db")._value.get()
    consumer = make_consumer(
        database_url,
        kafka_bootstrap,
        topic,
        group,
        redis_url=redis_url,
        redis_key_prefix=redis_prefix,
    )
    await running(consumer)

    async def all_committed() -> bool:
        return await committed(kafka_bootstrap, group, topic) == 5

    await poll(all_committed, "offset 5 committed")
    assert payment_rows(engine, group) == [("17", Decimal("100.00"), "async")]
    assert PROCESSED.labels(group)._value.get() == 1
    redis_dups = DUPLICATES.labels(group, "redis")._value.get()
    db_dups = DUPLICATES.labels(group, "db")._value.get() - before_db
    assert redis_dups + db_dups == 4  # whichever path caught them (Redis is shared, may blink)


async def test_handler_sees_where_and_when_the_record_was_written(
    database_url: str, kafka_bootstrap: str, new_topic: Any, running: Any
) -> None:
    """HandlerContext carries the record's topic, partition, offset and Kafka timestamp."""
    topic = await new_topic.acreate("inbox-ctx", partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    before_ms = int(time.time() * 1000)
    await produce(kafka_bootstrap, topic, [order_event(topic, "1"), order_event(topic, "2")])
    after_ms = int(time.time() * 1000)
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=database_url,
            kafka_bootstrap_servers=kafka_bootstrap,
        )
    )
    seen: list[tuple[str, int, int, int | None]] = []

    @consumer.handler("OrderPlaced")
    async def placed(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        seen.append((ctx.topic, ctx.partition, ctx.offset, ctx.timestamp_ms))

    await running(consumer)

    async def both() -> bool:
        return len(seen) == 2

    await poll(both, "both records handled")
    assert [s[:3] for s in seen] == [(topic, 0, 0), (topic, 0, 1)]
    for *_, stamp in seen:
        assert stamp is not None and before_ms - 1000 <= stamp <= after_ms + 1000


def stall_after_db_commit(marker: Path) -> ConsumerHooks:
    """Hooks that append the committed event ids to ``marker``, then block forever: the
    process stays between its database commit and its offset commit until it is killed."""

    async def stall(event_ids: list[uuid.UUID]) -> None:
        lines = "".join(f"{event_id}\n" for event_id in event_ids)
        await asyncio.to_thread(_append, marker, lines)
        await asyncio.Event().wait()  # until the test kills this process

    return ConsumerHooks(after_db_commit=stall)


def _append(path: Path, text: str) -> None:
    with path.open("a", encoding="utf-8") as out:
        out.write(text)


def app_from_env() -> InboxConsumer:
    """Factory for `python -m ledgerbox.inbox run --app ...` in a subprocess (kill -9 test).

    ``INBOX_IT_STALL_MARKER`` (a file path) installs :func:`stall_after_db_commit`.
    """
    env = os.environ
    marker = env.get("INBOX_IT_STALL_MARKER")
    return make_consumer(
        env["INBOX_IT_DATABASE_URL"],
        env["KAFKA_BOOTSTRAP_SERVERS"],
        env["INBOX_IT_TOPIC"],
        env["INBOX_IT_GROUP"],
        hooks=stall_after_db_commit(Path(marker)) if marker else None,
        redis_url=env.get("INBOX_IT_REDIS_URL") or None,
        redis_key_prefix=env.get("INBOX_IT_REDIS_PREFIX", "ledgerbox:"),
    )


def start_cli(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ledgerbox.inbox",
                "run",
                "--app",
                "tests.integration.test_inbox_consumer:app_from_env",
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def test_redelivery_after_kill_between_db_commit_and_offset_commit(
    database_url: str,
    engine: Engine,
    kafka_bootstrap: str,
    new_topic: Any,
    redis_url: str,
    redis_prefix: str,
    redis_client: Redis,
    tmp_path: Path,
) -> None:
    topic = await new_topic.acreate("inbox-kill", partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    event = order_event(topic, "21", "42.50")
    await produce(kafka_bootstrap, topic, [event])
    marker = tmp_path / "stalled"
    env = {
        **os.environ,
        "INBOX_IT_DATABASE_URL": database_url,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "INBOX_IT_TOPIC": topic,
        "INBOX_IT_GROUP": group,
        "INBOX_IT_REDIS_URL": redis_url,
        "INBOX_IT_REDIS_PREFIX": redis_prefix,
        "INBOX_IT_STALL_MARKER": str(marker),
    }
    log = tmp_path / "consumer.log"
    first = start_cli(env, log)
    try:

        async def stalled() -> bool:
            assert first.poll() is None, log.read_text()
            return marker.exists() and marker.read_text().endswith("\n")

        await poll(stalled, "the consumer to stall after its DB commit")
        assert marker.read_text().split() == [str(event.event_id)]
        # The effect committed, the offset did not, Redis never heard of it.
        assert payment_rows(engine, group) == [("21", Decimal("42.50"), "async")]
        done_key = f"{redis_prefix}inbox:*{group}:done:{event.event_id}"  # scoped or not
        assert [key async for key in redis_client.scan_iter(match=done_key)] == []
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    assert await committed(kafka_bootstrap, group, topic) is None

    env.pop("INBOX_IT_STALL_MARKER")
    second = start_cli(env, log)
    try:

        async def caught_up() -> bool:
            assert second.poll() is None, log.read_text()
            return await committed(kafka_bootstrap, group, topic) == 1

        await poll(caught_up, "the restarted consumer to commit the redelivered record")
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0, log.read_text()
    assert payment_rows(engine, group) == [("21", Decimal("42.50"), "async")]
    # Each run said what it consumes and where (no secret); only the clean stop says so.
    text = log.read_text()
    started = [line for line in text.splitlines() if f"consumer group {group} starting: " in line]
    assert len(started) == 2, text
    assert started[-1].endswith(
        f"consumer group {group} starting: topics {topic}, "
        f"database {database_label(database_url)}, kafka {kafka_bootstrap} (PLAINTEXT), "
        f"redis {redis_label(redis_url)} (hints, aggregate locks off), event loop "
        + ("uvloop" if importlib.util.find_spec("uvloop") else "asyncio")  # event_loop "auto"
    ), started
    assert text.count(f"consumer group {group} stopped") == 1, text
    password = make_url(database_url).password
    assert not password or password not in text


async def test_two_consumer_groups_each_apply_the_event_once(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any, running: Any
) -> None:
    topic = await new_topic.acreate("inbox-groups", partitions=2)
    groups = [f"ga-{uuid.uuid4().hex[:8]}", f"gb-{uuid.uuid4().hex[:8]}"]
    event = order_event(topic, "31")
    await produce(kafka_bootstrap, topic, [event, event], partition=1)
    for group in groups:
        await running(make_consumer(database_url, kafka_bootstrap, topic, group))

    async def both_done() -> bool:
        offsets = [await committed(kafka_bootstrap, g, topic, 1) for g in groups]
        return offsets == [2, 2]

    await poll(both_done, "both groups to commit")
    for group in groups:
        assert payment_rows(engine, group) == [("31", Decimal("100.00"), "async")]


async def test_sync_and_async_handlers_apply_and_stage_outbox_events(
    database_url: str, engine: Engine, kafka_bootstrap: str
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    topic = "orders.events"
    writer = OutboxWriter(TopicRouter(default="payments.events"), source="/payment-service")
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=database_url,
            kafka_bootstrap_servers=kafka_bootstrap,
        )
    )
    threads: list[str] = []

    def paid_event(order_id: str) -> EventEnvelope:
        return writer.event(
            event_type="PaymentSucceeded",
            aggregate_type="payment",
            aggregate_id=order_id,
            payload={"order_id": order_id},
            idempotency_key=f"pay:{group}:{order_id}",
        )

    @consumer.handler("OrderPlaced")
    async def pay_async(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        assert isinstance(ctx.session, AsyncSession)
        await ctx.session.execute(
            sa.insert(payments).values(
                consumer_group=group,
                order_id=event.payload["order_id"],
                amount=Decimal(event.payload["amount"]),
                handler="async",
            )
        )
        writer.stage(ctx.session, paid_event(event.payload["order_id"]))

    @consumer.handler("OrderPlacedSync")
    def pay_sync(ctx: HandlerContext[Session], event: EventEnvelope) -> None:
        import threading

        assert isinstance(ctx.session, Session)
        threads.append(threading.current_thread().name)
        ctx.session.execute(
            sa.insert(payments).values(
                consumer_group=group,
                order_id=event.payload["order_id"],
                amount=Decimal(event.payload["amount"]),
                handler="sync",
            )
        )
        writer.stage(ctx.session, paid_event(event.payload["order_id"]))

    try:
        e1 = order_event(topic, "41")
        e2 = order_event(topic, "42", "7.25", kind="OrderPlacedSync")
        outcomes = [
            await consumer.process_record(record_for(e, offset=i))
            for i, e in enumerate([e1, e2, e1, e2])
        ]
    finally:
        await consumer.aclose()
    assert outcomes == [Outcome.APPLIED, Outcome.APPLIED, Outcome.DUPLICATE, Outcome.DUPLICATE]
    assert payment_rows(engine, group) == [
        ("41", Decimal("100.00"), "async"),
        ("42", Decimal("7.25"), "sync"),
    ]
    assert threads and threads[0] != "MainThread"
    outbox = OutboxTable().table
    with engine.connect() as conn:
        staged = (
            conn.execute(
                sa.select(outbox.c.aggregate_id)
                .where(outbox.c.idempotency_key.like(f"pay:{group}:%"))
                .order_by(outbox.c.id)
            )
            .scalars()
            .all()
        )
    assert staged == ["41", "42"]


async def test_rebalance_to_a_second_consumer_loses_no_offset_and_applies_once(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any, running: Any
) -> None:
    topic = await new_topic.acreate("inbox-rebalance", partitions=3)
    group = f"g-{uuid.uuid4().hex[:8]}"
    events = [order_event(topic, f"r{i}", "1.00") for i in range(30)]
    for p in range(3):
        await produce(kafka_bootstrap, topic, events[p::3], partition=p)
    first = make_consumer(database_url, kafka_bootstrap, topic, group)
    await running(first)
    await poll(lambda: _count_async(engine, group, 1), "the first consumer to start applying")
    second = make_consumer(database_url, kafka_bootstrap, topic, group)
    await running(second)
    more = [order_event(topic, f"s{i}", "1.00") for i in range(30)]
    for p in range(3):
        await produce(kafka_bootstrap, topic, more[p::3], partition=p)

    async def all_committed() -> bool:
        offsets = [await committed(kafka_bootstrap, group, topic, p) for p in range(3)]
        return offsets == [20, 20, 20]

    await poll(all_committed, "all 60 records committed", within_s=120)
    rows = payment_rows(engine, group)
    assert sorted(r[0] for r in rows) == sorted(e.payload["order_id"] for e in events + more)


async def _count_async(engine: Engine, group: str, at_least: int) -> bool:
    return len(payment_rows(engine, group)) >= at_least


async def test_batch_applies_once_in_order_and_falls_back_one_by_one_on_error(
    database_url: str, engine: Engine, kafka_bootstrap: str
) -> None:
    from ledgerbox.inbox.testing import FakeRecord, InMemoryDeadLetterPublisher

    group = f"g-{uuid.uuid4().hex[:8]}"
    parked = InMemoryDeadLetterPublisher()
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=["orders"],
            database_url=database_url,
            kafka_bootstrap_servers=kafka_bootstrap,
            max_attempts=2,
            retry_base_s=0.01,
            dead_letter_on=(ValueError,),  # "boom" is declared permanent: one attempt
        ),
        dead_letters=parked,
    )
    order: list[str] = []

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        order.append(event.payload["order_id"])
        if event.payload["order_id"] == "boom":
            raise ValueError("permanent: cannot pay this order")
        await ctx.session.execute(
            sa.insert(payments).values(
                consumer_group=group,
                order_id=event.payload["order_id"],
                amount=Decimal(event.payload["amount"]),
                handler="async",
            )
        )

    e1, e2, boom, e4 = (order_event("orders", o) for o in ("b1", "b2", "boom", "b4"))
    events = [e1, e2, e1, boom, e4]
    records = [record_for(e, offset=i) for i, e in enumerate(events)]
    poison = FakeRecord("orders", 0, 5, b"k", b"\xff", ())
    after = record_for(order_event("orders", "b6"), offset=6)
    try:
        first = await consumer.process_batch([*records, poison, after])
        again = await consumer.process_batch(records[:3])
    finally:
        await consumer.aclose()
    assert first == [
        Outcome.APPLIED,
        Outcome.APPLIED,
        Outcome.DUPLICATE,
        Outcome.DEAD_LETTERED,
        Outcome.APPLIED,
        Outcome.DEAD_LETTERED,
        Outcome.APPLIED,
    ]
    assert again == [Outcome.DUPLICATE] * 3
    assert [r[0] for r in payment_rows(engine, group)] == ["b1", "b2", "b4", "b6"]
    assert [topic for topic, *_ in parked.records] == ["orders.dlq", "orders.dlq"]
    # The batch ran b1, b2, boom (rolled back), then one by one: b1, b2, boom (permanent: one
    # attempt, dead-lettered), b4; b6 after the poison record.
    assert order == ["b1", "b2", "boom", "b1", "b2", "boom", "b4", "b6"]


async def test_replayed_dead_letter_takes_over_its_dead_lettered_row_batched_and_alone(
    database_url: str, engine: Engine, kafka_bootstrap: str
) -> None:
    from ledgerbox.inbox import InboxStatus
    from ledgerbox.inbox.testing import InMemoryDeadLetterPublisher

    group = f"g-{uuid.uuid4().hex[:8]}"
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=["orders"],
            database_url=database_url,
            kafka_bootstrap_servers=kafka_bootstrap,
            max_attempts=1,
        ),
        dead_letters=InMemoryDeadLetterPublisher(),
    )
    failing = {"r1", "r2"}
    calls: list[str] = []

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        calls.append(event.payload["order_id"])
        if event.payload["order_id"] in failing:
            raise ValueError("permanent until fixed")
        await ctx.session.execute(
            sa.insert(payments).values(
                consumer_group=group,
                order_id=event.payload["order_id"],
                amount=Decimal(event.payload["amount"]),
                handler="async",
            )
        )

    r1, r2, ok = (order_event("orders", o) for o in ("r1", "r2", "ok"))
    records = [record_for(e, offset=i) for i, e in enumerate([r1, r2, ok])]
    inbox_rows = sa.text(
        "SELECT event_id, status, attempts, last_error IS NULL FROM inbox"
        ' WHERE consumer_group = :g ORDER BY "offset"'
    )
    try:
        first = await consumer.process_batch(records)
        with engine.connect() as conn:
            parked = conn.execute(inbox_rows, {"g": group}).all()
        failing.clear()  # the bug is fixed
        # A redelivery alone does not run a dead-lettered event again (final, C17) ...
        handled = list(calls)
        unasked = await consumer.process_batch([records[0], records[1]])
        assert calls == handled
        # ... the operator's replay request does.
        assert await consumer.request_replay([r1.event_id, r2.event_id, ok.event_id]) == 2
        replay_batch = await consumer.process_batch([records[0], records[2]])
        replay_alone = await consumer.process_record(records[1])
        again = await consumer.process_batch(records)
    finally:
        await consumer.aclose()
    assert first == [Outcome.DEAD_LETTERED, Outcome.DEAD_LETTERED, Outcome.APPLIED]
    assert unasked == [Outcome.ALREADY_DEAD_LETTERED] * 2
    assert [(r[1], r[3]) for r in parked] == [(InboxStatus.DEAD_LETTERED, False)] * 2 + [
        (InboxStatus.DONE, True)
    ]
    assert replay_batch == [Outcome.APPLIED, Outcome.DUPLICATE]
    assert replay_alone is Outcome.APPLIED
    assert again == [Outcome.DUPLICATE] * 3
    with engine.connect() as conn:
        final = conn.execute(inbox_rows, {"g": group}).all()
    assert [(r[0], r[1], r[2], r[3]) for r in final] == [
        (r1.event_id, InboxStatus.DONE, 2, True),
        (r2.event_id, InboxStatus.DONE, 2, True),
        (ok.event_id, InboxStatus.DONE, 1, True),
    ]
    assert sorted(r[0] for r in payment_rows(engine, group)) == ["ok", "r1", "r2"]


async def test_redis_dedup_store_claims_once_refuses_done_events_and_expires(
    redis_client: Any, redis_prefix: str
) -> None:
    from ledgerbox.inbox import RedisDedupStore

    store = RedisDedupStore(redis_client, redis_prefix)
    event = uuid.uuid4()
    assert await store.claim("g", event, "w1", ttl_ms=60_000)
    assert not await store.claim("g", event, "w2", ttl_ms=60_000)
    await store.unclaim("g", event, "w2")  # not the owner: no effect
    assert not await store.claim("g", event, "w2", ttl_ms=60_000)
    await store.unclaim("g", event, "w1")
    assert await store.claim("g", event, "w2", ttl_ms=50)
    await poll(lambda: store.claim("g", event, "w3", ttl_ms=60_000), "w2's marker to expire (C11)")
    await store.mark_done("g", event, ttl_s=60)
    await store.unclaim("g", event, "w3")
    assert await store.is_done("g", event) and not await store.is_done("other", event)
    assert not await store.claim("g", event, "w4", ttl_ms=60_000)  # done: refused at once
    assert await store.claim("other", event, "w4", ttl_ms=60_000)  # groups stay apart


async def test_a_client_whose_fetch_task_died_is_replaced_and_no_record_is_left(
    database_url: str,
    engine: Engine,
    kafka_bootstrap: str,
    new_topic: Any,
    running: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """aiokafka#1038 (seen in the chaos soak): under uvloop a fetch written to a connection
    the broker had just closed raised RuntimeError in aiokafka's fetch task, which died;
    ``getmany`` then returned nothing forever while the heartbeats kept the partitions on
    this member, and the consumer applied no more events. The same RuntimeError is put in
    the fetch task here (the loop under test is asyncio's)."""
    topic, group, runner, first_client = await five_committed(
        database_url, kafka_bootstrap, new_topic, running, "inbox-fetch-dies"
    )

    async def closed_transport(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError(
            "unable to perform operation on <TCPTransport closed=True reading=False"
            " 0x5602331a7210>; the handler is closed"
        )

    first_client._fetcher._proc_fetch_request = closed_transport
    caplog.set_level(logging.WARNING, logger="ledgerbox.inbox")
    await send_and_commit(
        kafka_bootstrap, topic, group, "b", 10, "the 5 events sent after the fetch task died"
    )
    assert sorted(r[0] for r in payment_rows(engine, group)) == sorted(
        [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(5)]
    )
    assert runner.kafka is not first_client
    assert_replaced_once(caplog, group, "its fetch task died: RuntimeError: unable to perform")
    assert_closed(first_client)


async def test_a_client_whose_fetch_hangs_is_replaced_and_no_record_is_left(
    database_url: str,
    engine: Engine,
    kafka_bootstrap: str,
    new_topic: Any,
    running: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other way a client stops fetching: its fetch task lives but a request never
    ends (the soak's order consumer that got partitions after a broker stall and fetched
    nothing for 90 s). No fetch response for FETCH_STALL_S (3 s here) replaces the
    client."""
    monkeypatch.setattr(runner_module, "FETCH_STALL_S", 3.0)
    topic, group, runner, first_client = await five_committed(
        database_url, kafka_bootstrap, new_topic, running, "inbox-fetch-hangs"
    )

    async def never_answered(*_args: Any, **_kwargs: Any) -> Any:
        await asyncio.Event().wait()

    first_client._fetcher._proc_fetch_request = never_answered
    caplog.set_level(logging.WARNING, logger="ledgerbox.inbox")
    await send_and_commit(
        kafka_bootstrap, topic, group, "b", 10, "the 5 events sent while the fetch hung"
    )
    assert len(payment_rows(engine, group)) == 10
    assert runner.kafka is not first_client
    assert_replaced_once(caplog, group, f"no fetch response for {topic}[0] in")
    assert_closed(first_client)


async def five_committed(
    database_url: str, bootstrap: str, new_topic: Any, running: Any, name: str, **extra: Any
) -> tuple[str, str, runner_module.KafkaRunner, Any]:
    """A consumer of a new one-partition topic ``name`` that applied and committed 5 events
    (``a0``..``a4``): its topic, group, runner and the runner's current Kafka client."""
    topic = await new_topic.acreate(name, partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    consumer = make_consumer(database_url, bootstrap, topic, group, **extra)
    await running(consumer)
    await send_and_commit(bootstrap, topic, group, "a", 5, "the first 5 events")
    runner = consumer._runner
    assert runner is not None and runner.kafka is not None
    return topic, group, runner, runner.kafka


async def send_and_commit(
    bootstrap: str, topic: str, group: str, prefix: str, total: int, what: str
) -> None:
    """Send 5 events (order ids ``prefix0``..``prefix4``) and wait until the group's
    committed offset is ``total``."""
    await produce(bootstrap, topic, [order_event(topic, f"{prefix}{i}", "1.00") for i in range(5)])

    async def all_committed() -> bool:
        return await committed(bootstrap, group, topic) == total

    await poll(all_committed, f"{what} committed")


def assert_replaced_once(caplog: pytest.LogCaptureFixture, group: str, cause: str) -> None:
    """Exactly one replacement, for ``cause``, counted by its metric, and the health back up
    after it."""
    why = "no_fetch_response" if cause.startswith("no fetch response") else "fetch_task_died"
    other = {"no_fetch_response": "fetch_task_died", "fetch_task_died": "no_fetch_response"}
    assert CLIENT_REPLACED.labels(group, why)._value.get() == 1
    assert CLIENT_REPLACED.labels(group, other[why])._value.get() == 0
    lines = [r.getMessage() for r in caplog.records]
    failed = [x for x in lines if "Kafka client failed" in x]
    assert len(failed) == 1, lines
    assert f"consumer group {group} down: Kafka client failed ({cause}" in failed[0], lines
    assert any(f"consumer group {group} up again" in x for x in lines), lines


def assert_closed(kafka: Any) -> None:
    """The replaced client runs no task and holds no connection."""
    assert kafka._closed
    assert kafka._fetcher._fetch_task.done()
    assert not any(conn.connected() for conn in kafka._client._conns.values())


async def test_a_commit_hanging_on_the_failed_client_does_not_hold_its_replacement(
    database_url: str,
    engine: Engine,
    kafka_bootstrap: str,
    new_topic: Any,
    running: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An offset commit in flight on the failed client (its coordinator gone quiet) held
    the commit lock with no bound, and the replacement waited behind it forever. It now
    gets stop_timeout_s (1 s here) once the records in process finished."""
    topic, group, _runner, first_client = await five_committed(
        database_url, kafka_bootstrap, new_topic, running, "inbox-commit-hangs", stop_timeout_s=1.0
    )
    hanging = asyncio.Event()

    async def commit_never_answered(*_args: Any, **_kwargs: Any) -> None:
        hanging.set()
        await asyncio.Event().wait()

    first_client.commit = commit_never_answered
    await produce(kafka_bootstrap, topic, [order_event(topic, "b0", "1.00")])
    await asyncio.wait_for(hanging.wait(), 30)  # the commit loop now holds the lock

    async def closed_transport(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")

    first_client._fetcher._proc_fetch_request = closed_transport
    caplog.set_level(logging.WARNING, logger="ledgerbox.inbox")
    await send_and_commit(
        kafka_bootstrap, topic, group, "c", 11, "the events after the hanging commit (new client)"
    )
    assert len(payment_rows(engine, group)) == 11
    assert_replaced_once(caplog, group, "its fetch task died: RuntimeError")
    assert_closed(first_client)


async def test_a_buffer_of_one_record_pauses_and_resumes_its_partition(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any, running: Any
) -> None:
    """``max_buffered_records=1`` (accepted by the config): the fetch loop paused the
    partition at one queued record and resumed it only below ``1 // 2 == 0``: never. The
    partition was never fetched again and health stayed ok (an adversarial review,
    2026-12-05: 1 of 6 records applied)."""
    topic = await new_topic.acreate("inbox-buffer-one", partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    await produce(kafka_bootstrap, topic, [order_event(topic, "b0")])
    await running(
        make_consumer(database_url, kafka_bootstrap, topic, group, max_buffered_records=1)
    )

    async def applied(n: int) -> bool:
        return len(payment_rows(engine, group)) == n

    await poll(lambda: applied(1), "the first record applied")
    for i in range(1, 6):
        await produce(kafka_bootstrap, topic, [order_event(topic, f"b{i}")])
    await poll(lambda: applied(6), "all six records applied", within_s=30)

    async def all_committed() -> bool:
        return await committed(kafka_bootstrap, group, topic) == 6

    await poll(all_committed, "the offsets of all six committed", within_s=30)
