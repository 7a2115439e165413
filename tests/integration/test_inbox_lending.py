"""Batches across partitions (docs/inbox.md, "Across partitions") against real Kafka and PostgreSQL:
records waiting on several partitions share one transaction, each partition's in offset
order, every event applied once; a record that keeps failing holds up only its partition."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncSession

from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer
from ledgerbox.outbox import EventEnvelope
from tests._inbox_support import order_event, poll, produce

PARTITIONS, PER_PARTITION = 4, 30


@pytest.fixture(scope="module", autouse=True)
def _table(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE TABLE IF NOT EXISTS lending_applied (id bigserial PRIMARY KEY,"
                " grp text NOT NULL, part int NOT NULL, seq int NOT NULL, tx xid8 NOT NULL)"
            )
        )


def applied(engine: Engine, group: str) -> list[tuple[int, int, int]]:
    """(partition, seq, transaction) per applied event, in the order they were applied."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT part, seq, tx::text::bigint FROM lending_applied WHERE grp = :g ORDER BY id"
            ),
            {"g": group},
        ).all()
    return [(r[0], r[1], r[2]) for r in rows]


def bare_consumer(
    database_url: str, bootstrap: str, topic: str, group: str, **config: Any
) -> InboxConsumer:
    """A consumer of ``topic`` in ``group`` without handlers (offsets committed every 20 ms)."""
    return InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=database_url,
            kafka_bootstrap_servers=bootstrap,
            commit_interval_ms=20,
            **config,
        )
    )


def consumer_for(
    database_url: str,
    bootstrap: str,
    topic: str,
    group: str,
    released: asyncio.Event | None = None,
    **config: Any,
) -> InboxConsumer:
    """A consumer recording each event's partition, sequence and transaction; with
    ``released``, partition 0's first event fails until it is set."""
    consumer = bare_consumer(database_url, bootstrap, topic, group, **config)

    @consumer.handler("OrderPlaced")
    async def record(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        seq = int(event.payload["amount"])
        if released is not None and (ctx.partition, seq) == (0, 0) and not released.is_set():
            raise RuntimeError("not yet")
        await ctx.session.execute(
            sa.text(
                "INSERT INTO lending_applied (grp, part, seq, tx)"
                " VALUES (:g, :p, :s, pg_current_xact_id())"
            ),
            {"g": ctx.group_id, "p": ctx.partition, "s": seq},
        )

    return consumer


async def fill(bootstrap: str, topic: str, per_partition: int) -> None:
    """``per_partition`` events on each partition; payload ``amount`` = its sequence."""
    for p in range(PARTITIONS):
        events = [order_event(topic, f"p{p}-{s}", amount=str(s)) for s in range(per_partition)]
        await produce(bootstrap, topic, events, partition=p)


async def run_until(consumer: InboxConsumer, engine: Engine, count: int) -> None:
    task = asyncio.create_task(consumer.run())
    try:

        async def done() -> bool:
            assert not task.done(), task
            return len(applied(engine, consumer.group_id)) >= count

        await poll(done, f"{count} events applied")
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 60)


def check_once_in_order(rows: list[tuple[int, int, int]], per_partition: int) -> None:
    for p in range(PARTITIONS):
        assert [s for q, s, _tx in rows if q == p] == list(range(per_partition)), p


@pytest.mark.parametrize("across", [True, False])
async def test_records_waiting_on_several_partitions_share_a_transaction(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any, across: bool
) -> None:
    topic = await new_topic.acreate("lend", partitions=PARTITIONS)
    await fill(kafka_bootstrap, topic, PER_PARTITION)
    group = f"lend-{uuid.uuid4().hex[:8]}"
    consumer = consumer_for(
        database_url, kafka_bootstrap, topic, group, batch_across_partitions=across
    )
    await run_until(consumer, engine, PARTITIONS * PER_PARTITION)
    rows = applied(engine, group)
    assert len(rows) == PARTITIONS * PER_PARTITION, "each event applied once"
    check_once_in_order(rows, PER_PARTITION)
    spans = {tx: {q for q, _s, t in rows if t == tx} for _p, _s, tx in rows}
    widest = max(len(parts) for parts in spans.values())
    if across:
        assert widest >= 2, "records waiting on several partitions share a transaction"
    else:
        assert widest == 1, "one partition per transaction"


async def test_a_record_that_keeps_failing_holds_up_only_its_partition(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any
) -> None:
    """Partition 0's first record fails until the test lets it pass: the other partitions'
    records, waiting with it, are all applied meanwhile (a lent batch that rolls back gives
    them back; each partition then runs on its own), then partition 0 goes on in order."""
    topic = await new_topic.acreate("lend-stuck", partitions=PARTITIONS)
    await fill(kafka_bootstrap, topic, 10)
    group = f"lend-stuck-{uuid.uuid4().hex[:8]}"
    released = asyncio.Event()
    consumer = consumer_for(
        database_url,
        kafka_bootstrap,
        topic,
        group,
        released,
        max_attempts=10_000,
        retry_base_s=0.01,
        retry_max_s=0.05,
    )
    task = asyncio.create_task(consumer.run())
    try:

        async def others_done() -> bool:
            assert not task.done(), task
            rows = applied(engine, group)
            return sum(1 for q, _s, _t in rows if q != 0) == (PARTITIONS - 1) * 10

        await poll(others_done, "the other partitions applied while partition 0 retries")
        assert not [r for r in applied(engine, group) if r[0] == 0], "partition 0 waits"
        released.set()

        async def all_done() -> bool:
            return len(applied(engine, group)) == PARTITIONS * 10

        await poll(all_done, "partition 0 applied after its record passes")
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 60)
    check_once_in_order(applied(engine, group), 10)


async def test_a_lone_event_in_a_lent_batch_is_applied_not_given_back(
    database_url: str, kafka_bootstrap: str
) -> None:
    """A run of one event (here: its handler is async, the next records' sync) in a batch
    holding two partitions' records gets its own transaction there, like any run; only what
    cannot share a transaction at all ends the batch (a record that does not parse)."""
    from sqlalchemy.orm import Session

    from ledgerbox.inbox import Outcome
    from ledgerbox.inbox.testing import FakeRecord, record_for

    group = f"lend-lone-{uuid.uuid4().hex[:8]}"
    consumer = bare_consumer(database_url, kafka_bootstrap, "orders", group)
    ran: list[str] = []

    @consumer.handler("OrderPlaced")
    async def placed(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        ran.append(event.payload["order_id"])

    @consumer.handler("OrderShipped")
    def shipped(ctx: HandlerContext[Session], event: EventEnvelope) -> None:
        ran.append(event.payload["order_id"])

    lone = record_for(order_event("orders", "own"), partition=0, offset=0)
    lent = [
        record_for(order_event("orders", f"lent{i}", kind="OrderShipped"), partition=1, offset=i)
        for i in range(2)
    ]
    garbage = FakeRecord("orders", 1, 2, b"k", b"\xff", ())
    try:
        outcomes = await consumer._batches.process(
            [lone, *lent, garbage], lambda: False, ("orders", 0)
        )
    finally:
        await consumer.aclose()
    assert outcomes == [Outcome.APPLIED] * 3 + [Outcome.ABANDONED]
    assert ran == ["own", "lent0", "lent1"]


async def test_a_handler_sees_the_events_of_its_transaction(
    database_url: str, kafka_bootstrap: str
) -> None:
    """``ctx.batch``: in a batch, the events whose handlers run in it, in order (not a copy
    within the batch, not one the inbox already holds); on the per-message path (a single
    record, a batch that rolled back) the event alone."""
    from ledgerbox.inbox.testing import record_for

    group = f"lend-batch-{uuid.uuid4().hex[:8]}"
    consumer = bare_consumer(database_url, kafka_bootstrap, "orders", group, retry_base_s=0.01)
    seen: list[tuple[str, list[str]]] = []
    failed: set[str] = set()

    @consumer.handler("OrderPlaced")
    async def note(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        name = event.payload["order_id"]
        seen.append((name, [e.payload["order_id"] for e in ctx.batch]))
        assert "batch=" not in repr(ctx), "a logged context does not dump the whole batch"
        if name == "e5" and name not in failed:
            failed.add(name)
            raise RuntimeError("once")  # the batch rolls back; e4 and e5 rerun one by one

    e0, e1, e2, e3, e4, e5 = (order_event("orders", f"e{i}") for i in range(6))
    try:
        await consumer.process_batch([record_for(e0, offset=0)])
        assert seen == [("e0", ["e0"])], "a single record: the event alone"
        seen.clear()
        batch = [e0, e1, e2, e1, e3]  # e0 applied before, e1 twice
        await consumer.process_batch([record_for(e, offset=i + 1) for i, e in enumerate(batch)])
        assert seen == [(n, ["e1", "e2", "e3"]) for n in ("e1", "e2", "e3")]
        seen.clear()
        await consumer.process_batch([record_for(e4, offset=6), record_for(e5, offset=7)])
        assert seen == [
            ("e4", ["e4", "e5"]),
            ("e5", ["e4", "e5"]),
            ("e4", ["e4"]),
            ("e5", ["e5"]),
        ], "a batch that rolled back reruns its events one per transaction"
    finally:
        await consumer.aclose()
