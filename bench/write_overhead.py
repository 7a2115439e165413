"""Write-path overhead: a business transaction with one staged outbox event vs without.

Each transaction inserts one order row in a sync SQLAlchemy ``Session`` and commits; the
"with" variant also stages one event (``OutboxWriter.stage``: ``session.add``, inserted at
the same flush). Variants alternate transaction by transaction (interleaved) so machine noise
hits both alike; the ratio of total times is reported per round and the median over rounds.
Target: ``write_overhead_ratio <= 1.15``.

Run: ``python -m bench write_overhead`` (services up, ``DATABASE_URL`` set).
"""

from __future__ import annotations

import time
import uuid
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from bench._common import fresh_database, median, write_result
from ledgerbox.outbox import OutboxWriter, TopicRouter, idempotency_key

TRANSACTIONS = 2_000
ROUNDS = 3


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
    return {
        "write_overhead_ratio": median(ratios),
        "write_overhead_ratios": ratios,
        "write_with_event_s": with_all,
        "write_without_event_s": without_all,
        "write_transactions_per_variant": TRANSACTIONS,
        "write_with_event_ms_per_tx": median(with_all) / TRANSACTIONS * 1000,
        "write_without_event_ms_per_tx": median(without_all) / TRANSACTIONS * 1000,
    }


if __name__ == "__main__":
    result = run()
    print(write_result("write_overhead", result))
    for key, value in result.items():
        print(f"{key}: {value}")
