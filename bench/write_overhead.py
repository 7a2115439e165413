"""Write-path overhead: a business transaction with one staged outbox event vs without.

``write_overhead_ratio`` (target <= 1.35): each transaction inserts one order row in a sync
SQLAlchemy ``Session`` and commits; the "with" variant also stages one event
(``OutboxWriter.stage``: ``session.add``, inserted at the same flush).

``write_overhead_order_tx`` (target <= 1.15): the example order service's real transaction
(``example_services/orders/api.py``, ``POST /orders`` without HTTP, the service's
code imported, so the two cannot drift apart): the ``OrderPlaced`` event built, then on an
``AsyncConnection`` the service's ``place_order_tx`` (the order row, its history row, the
event and the row back in one statement); without the event, the service's ``PLACE_ORDER``
alone (the same statement without the event). (Until 2026-12-05 the bench ran the
service's earlier three statements and a separate ``astage_once``.)

Variants alternate transaction by transaction (interleaved) so machine noise hits both
alike; the ratio of total times is reported per round and the median over rounds.

``BENCH_WRITE_INDEX_COST=1`` also reports what each index (and the NOTIFY trigger) of the
outbox costs a producer: the one-row transaction with every index vs with that one dropped,
interleaved, in ms per transaction (``write_index_cost_ms``; docs/performance.md).

Run: ``python -m bench write_overhead`` (services up, ``DATABASE_URL`` set).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from bench._common import fresh_database, median, write_result
from example_services.orders.api import (
    PLACE_ORDER,
    order_placed,
    place_order_statement,
    place_order_tx,
)
from ledgerbox.outbox import OutboxWriter, TopicRouter, idempotency_key

TRANSACTIONS = int(os.environ.get("BENCH_WRITE_TRANSACTIONS", "2000"))
ROUNDS = 3
INDEX_COST = os.environ.get("BENCH_WRITE_INDEX_COST", "") == "1"

#: What the index-cost runs drop, one at a time (DDL to drop it; the name it is reported as).
_DROPS: dict[str, str] = {
    "pk (id)": "ALTER TABLE outbox DROP CONSTRAINT outbox_pkey",
    "uq_outbox_event_id": "ALTER TABLE outbox DROP CONSTRAINT uq_outbox_event_id",
    "uq_outbox_idempotency_key": "ALTER TABLE outbox DROP CONSTRAINT uq_outbox_idempotency_key",
    "ix_outbox_shard_txid": "DROP INDEX ix_outbox_shard_txid",
    "ix_outbox_held (partial)": "DROP INDEX ix_outbox_held",
    "NOTIFY trigger": "DROP TRIGGER outbox_notify ON outbox",
}


def _round(engine: sa.Engine, orders: sa.Table, writer: OutboxWriter) -> tuple[float, float]:
    with_s = without_s = 0.0
    for i in range(2 * TRANSACTIONS):
        staged = i % 2 == 0
        order_id = uuid.uuid4()
        start = time.perf_counter()
        with Session(engine) as session, session.begin():
            session.execute(
                orders.insert().values(id=order_id, customer_id="c1", amount=Decimal("10.00"))
            )
            if staged:
                writer.stage(
                    session,
                    writer.event(
                        event_type="OrderPlaced",
                        aggregate_type="order",
                        aggregate_id=order_id,
                        aggregate_version=1,
                        payload={"order_id": order_id, "amount": Decimal("10.00")},
                        idempotency_key=idempotency_key("order", order_id),
                    ),
                )
        elapsed = time.perf_counter() - start
        if staged:
            with_s += elapsed
        else:
            without_s += elapsed
    return with_s, without_s


async def _order_round(
    engine: Any, writer: OutboxWriter, statement: sa.TextClause, n: int
) -> tuple[float, float]:
    """The order service's transaction, with and without its event, interleaved."""
    with_s = without_s = 0.0
    for i in range(2 * n):
        staged = i % 2 == 0
        order_id = uuid.uuid4()
        start = time.perf_counter()
        await _place_order(engine, writer, statement, order_id, staged)
        elapsed = time.perf_counter() - start
        if staged:
            with_s += elapsed
        else:
            without_s += elapsed
    return with_s, without_s


async def _place_order(
    engine: Any,
    writer: OutboxWriter,
    statement: sa.TextClause,
    order_id: uuid.UUID,
    staged: bool,
) -> None:
    """``POST /orders`` of example_services/orders/api.py after validation, without HTTP: the
    event built, then in one transaction the service's own ``place_order_tx`` (the order,
    its history row and the event in one statement). Without the event: the same
    transaction's ``PLACE_ORDER`` alone (the order and its history, no event)."""
    customer = f"c{order_id.int % 1000}"
    order = {
        "id": order_id,
        "customer_id": customer,
        "amount": Decimal("10.00"),
        "currency": "EUR",
        "status": "PENDING",
        "event_id": uuid.uuid5(uuid.NAMESPACE_URL, order_id.hex),
    }
    if not staged:
        async with engine.begin() as conn:
            (await conn.execute(PLACE_ORDER, order)).mappings().one()
        return
    event = order_placed(writer, order_id, customer, Decimal("10.00"), "EUR", order_id.hex)
    order["event_id"] = event.event_id
    async with engine.begin() as conn:
        placed, row = await place_order_tx(conn, writer, statement, event, order)
        assert placed.created and row is not None


def _order_tx() -> dict[str, Any]:
    from example_services.orders._models import metadata

    with fresh_database("bench_order") as url:
        sync = sa.create_engine(url)
        metadata.create_all(sync)
        sync.dispose()
        writer = OutboxWriter(
            TopicRouter(by_event_type={"OrderPlaced": "orders.events"}), source="/order-service"
        )

        async def rounds() -> list[tuple[float, float]]:
            engine = create_async_engine(url, pool_size=2)
            try:
                statement = place_order_statement(writer)
                await _order_round(engine, writer, statement, TRANSACTIONS // 4)  # warm-up
                return [
                    await _order_round(engine, writer, statement, TRANSACTIONS)
                    for _ in range(ROUNDS)
                ]
            finally:
                await engine.dispose()

        measured = asyncio.run(rounds())
    ratios = [w / wo for w, wo in measured]
    return {
        "write_overhead_order_tx": median(ratios),
        "write_overhead_order_tx_ratios": ratios,
        "write_order_tx_with_event_ms": median([w for w, _ in measured]) / TRANSACTIONS * 1000,
        "write_order_tx_without_event_ms": median([w for _, w in measured]) / TRANSACTIONS * 1000,
    }


def _index_costs() -> dict[str, Any]:
    """ms per one-row transaction with every index and with each one dropped (interleaved:
    one database per variant, transactions alternating between them)."""
    variants = ["all", *_DROPS]
    urls: dict[str, str] = {}
    stack: list[Any] = []
    try:
        for variant in variants:
            ctx = fresh_database("bench_index")
            urls[variant] = ctx.__enter__()
            stack.append(ctx)
            if variant != "all":
                with sa.create_engine(urls[variant]).begin() as conn:
                    conn.execute(sa.text(_DROPS[variant]))
        engines = {v: sa.create_engine(u, pool_size=1) for v, u in urls.items()}
        metadata = sa.MetaData()
        orders = _orders_table(metadata)
        for engine in engines.values():
            metadata.create_all(engine)
        writer = OutboxWriter(TopicRouter(default="orders.events"), source="/bench")
        times: dict[str, list[float]] = {v: [] for v in variants}
        for tx in range(TRANSACTIONS // 4 + TRANSACTIONS * len(variants)):
            variant = variants[tx % len(variants)]
            elapsed = _one_tx(engines[variant], orders, writer, staged=True)
            if tx >= TRANSACTIONS // 4:  # after a warm-up
                times[variant].append(elapsed)
        for engine in engines.values():
            engine.dispose()
    finally:
        for ctx in reversed(stack):
            ctx.__exit__(None, None, None)
    base = median(times["all"]) * 1000
    return {
        "write_index_cost_ms": {
            "all (ms per tx)": round(base, 3),
            **{f"{v} (ms saved)": round(base - median(times[v]) * 1000, 3) for v in _DROPS},
        }
    }


def _orders_table(metadata: sa.MetaData) -> sa.Table:
    return sa.Table(
        "orders",
        metadata,
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("customer_id", sa.Text, nullable=False),
        sa.Column("amount", sa.Numeric(12, 2), nullable=False),
    )


def _one_tx(engine: sa.Engine, orders: sa.Table, writer: OutboxWriter, *, staged: bool) -> float:
    order_id = uuid.uuid4()
    start = time.perf_counter()
    with Session(engine) as session, session.begin():
        session.execute(
            orders.insert().values(id=order_id, customer_id="c1", amount=Decimal("10.00"))
        )
        if staged:
            writer.stage(session, _event(writer, order_id))
    return time.perf_counter() - start


def _event(writer: OutboxWriter, order_id: uuid.UUID) -> Any:
    return writer.event(
        event_type="OrderPlaced",
        aggregate_type="order",
        aggregate_id=order_id,
        aggregate_version=1,
        payload={"order_id": order_id, "amount": Decimal("10.00")},
        idempotency_key=idempotency_key("order", order_id),
    )


def run() -> dict[str, Any]:
    """Run the benchmark; return the figures (seconds, ratio)."""
    with fresh_database("bench_write") as url:
        engine = sa.create_engine(url, pool_size=2)
        metadata = sa.MetaData()
        orders = sa.Table(
            "orders",
            metadata,
            sa.Column("id", sa.Uuid, primary_key=True),
            sa.Column("customer_id", sa.Text, nullable=False),
            sa.Column("amount", sa.Numeric(12, 2), nullable=False),
        )
        metadata.create_all(engine)
        writer = OutboxWriter(TopicRouter(default="orders.events"), source="/bench")
        _round(engine, orders, writer)  # warm-up: connections, statement caches
        ratios, with_all, without_all = [], [], []
        for _ in range(ROUNDS):
            with_s, without_s = _round(engine, orders, writer)
            with_all.append(with_s)
            without_all.append(without_s)
            ratios.append(with_s / without_s)
        engine.dispose()
    result: dict[str, Any] = {
        "write_overhead_ratio": median(ratios),
        "write_overhead_ratios": ratios,
        "write_with_event_s": with_all,
        "write_without_event_s": without_all,
        "write_transactions_per_variant": TRANSACTIONS,
        "write_with_event_ms_per_tx": median(with_all) / TRANSACTIONS * 1000,
        "write_without_event_ms_per_tx": median(without_all) / TRANSACTIONS * 1000,
    }
    result.update(_order_tx())
    if INDEX_COST:
        result.update(_index_costs())
    return result


if __name__ == "__main__":
    result = run()
    print(write_result("write_overhead", result))
    for key, value in result.items():
        print(f"{key}: {value}")
