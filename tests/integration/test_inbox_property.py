"""Property: any interleaving of duplicate deliveries and crashes leaves the business tables
exactly as one clean delivery of each event does (G4), on the real database."""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.pool import NullPool

from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer, Outcome
from ledgerbox.inbox.testing import InMemoryDeadLetterPublisher, InMemoryDedupStore, record_for
from ledgerbox.outbox import EventEnvelope, OutboxWriter, TopicRouter

metadata = sa.MetaData()
balances = sa.Table(
    "prop_balances",
    metadata,
    sa.Column("consumer_group", sa.Text, primary_key=True),
    sa.Column("account", sa.Text, primary_key=True),
    sa.Column("balance", sa.Numeric(12, 2), nullable=False),
)
ledger = sa.Table(
    "prop_ledger",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("consumer_group", sa.Text, nullable=False),
    sa.Column("event_id", sa.Uuid, nullable=False),
)

WRITER = OutboxWriter(TopicRouter(default="prop"), source="/prop")
EVENTS = [
    WRITER.event(
        event_type="Credited",
        aggregate_type="account",
        aggregate_id=f"a{i % 2}",
        payload={"amount": f"{i + 1}.25"},
        idempotency_key=f"prop:{i}",
    )
    for i in range(4)
]


class Crash(ConnectionResetError):
    """The worker dies after its writes, before the commit (connection lost)."""


# One step: deliver event i; crash=True kills the attempt after the handler wrote.
steps = st.lists(st.tuples(st.integers(0, len(EVENTS) - 1), st.booleans()), max_size=12)


async def _apply(database_url: str, group: str, plan: list[tuple[int, bool]], redis: bool) -> None:
    engine = create_async_engine(database_url, poolclass=NullPool)
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=["prop"],
            database_url=database_url,
            kafka_bootstrap_servers="unused:9092",
            retry_base_s=0.001,
        ),
        async_engine=engine,
        dedup=InMemoryDedupStore() if redis else None,
        dead_letters=InMemoryDeadLetterPublisher(),
    )
    state = {"crash": False}

    @consumer.handler("Credited")
    async def credit(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        amount = Decimal(event.payload["amount"])
        stmt = sa.dialects.postgresql.insert(balances).values(
            consumer_group=group, account=event.aggregate_id, balance=amount
        )
        await ctx.session.execute(
            stmt.on_conflict_do_update(
                index_elements=[balances.c.consumer_group, balances.c.account],
                set_={"balance": balances.c.balance + amount},
            )
        )
        await ctx.session.execute(
            sa.insert(ledger).values(consumer_group=group, event_id=event.event_id)
        )
        if state["crash"]:
            raise Crash()

    try:
        # Kafka redelivers every uncommitted record: after the random prefix, each event once more.
        for index, crash in [*plan, *[(i, False) for i in range(len(EVENTS))]]:
            state["crash"] = crash
            outcome = await consumer.process_record(
                record_for(EVENTS[index], offset=index), abandon=lambda: state["crash"]
            )
            # A crash can only hit a handler that runs: a duplicate never reaches it.
            allowed = (
                {Outcome.ABANDONED, Outcome.DUPLICATE}
                if crash
                else {Outcome.APPLIED, Outcome.DUPLICATE}
            )
            assert outcome in allowed
    finally:
        await consumer.aclose()
        await engine.dispose()


def _state(engine: Engine, group: str) -> tuple[list[tuple[str, Decimal]], list[uuid.UUID]]:
    with engine.connect() as conn:
        bal = conn.execute(
            sa.select(balances.c.account, balances.c.balance)
            .where(balances.c.consumer_group == group)
            .order_by(balances.c.account)
        ).all()
        events = (
            conn.execute(sa.select(ledger.c.event_id).where(ledger.c.consumer_group == group))
            .scalars()
            .all()
        )
    return [(a, b) for a, b in bal], sorted(events)


def test_any_duplicates_and_crashes_equal_one_clean_delivery(
    database_url: str, engine: Engine
) -> None:
    metadata.create_all(engine)
    reference = f"ref-{uuid.uuid4().hex[:8]}"
    asyncio.run(_apply(database_url, reference, [], redis=False))
    expected = _state(engine, reference)
    assert len(expected[1]) == len(EVENTS)

    @settings(
        max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(plan=steps, redis=st.booleans())
    def check(plan: list[tuple[int, bool]], redis: bool) -> None:
        group = f"p-{uuid.uuid4().hex[:8]}"
        asyncio.run(_apply(database_url, group, plan, redis))
        assert _state(engine, group) == expected

    check()
