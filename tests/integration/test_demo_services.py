"""The example APIs against a real PostgreSQL: status codes, idempotency, one transaction."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest_asyncio
import sqlalchemy as sa
from sqlalchemy import Engine

from example_services._config import ServiceSettings
from example_services.orders.api import create_app as order_app
from example_services.payments.api import create_app as payment_app


@pytest_asyncio.fixture
async def orders(database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    app = order_app(ServiceSettings(order_database_url=database_url, orders_topic="t.orders"))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://o") as client,
    ):
        yield client


@pytest_asyncio.fixture
async def payments(database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    app = payment_app(ServiceSettings(payment_database_url=database_url))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as client,
    ):
        yield client


def outbox_rows(engine: Engine, order_id: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM outbox WHERE aggregate_id = :id"), {"id": order_id}
            ).scalar_one()
        )


async def test_place_order_then_retry_returns_the_first_order(
    orders: httpx.AsyncClient, engine: Engine
) -> None:
    body = {"customer_id": "c1", "amount": "12.34", "currency": "EUR"}
    key = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
    first = await orders.post("/orders", json=body, headers=key)
    assert first.status_code == 201, first.text
    order = first.json()
    assert order["status"] == "PENDING" and order["amount"] == "12.34" and order["version"] == 1
    again = await orders.post("/orders", json=body, headers=key)
    assert again.status_code == 200 and again.json()["id"] == order["id"]
    assert outbox_rows(engine, order["id"]) == 1
    got = await orders.get(f"/orders/{order['id']}")
    assert got.status_code == 200 and got.json()["id"] == order["id"]
    with engine.connect() as conn:
        event = conn.execute(
            sa.text("SELECT topic, event_type, payload FROM outbox WHERE aggregate_id = :id"),
            {"id": order["id"]},
        ).one()
    assert (event.topic, event.event_type) == ("t.orders", "OrderPlaced")
    assert event.payload["amount"] == "12.34" and event.payload["customer_id"] == "c1"


async def test_concurrent_twins_create_one_order(orders: httpx.AsyncClient, engine: Engine) -> None:
    body = {"customer_id": "c2", "amount": "5.00"}
    key = {"Idempotency-Key": f"twin-{uuid.uuid4()}"}
    responses = await asyncio.gather(
        *(orders.post("/orders", json=body, headers=key) for _ in range(4))
    )
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 200, 200, 201]
    assert len({r.json()["id"] for r in responses}) == 1
    assert outbox_rows(engine, responses[0].json()["id"]) == 1


async def test_bad_keys_and_bodies_are_4xx_with_a_message(orders: httpx.AsyncClient) -> None:
    body = {"customer_id": "c3", "amount": "1.00"}
    missing = await orders.post("/orders", json=body)
    assert missing.status_code == 400 and "Idempotency-Key" in missing.json()["detail"]
    for bad in (b"", b"x" * 129, b"has space", "caf\u00e9".encode()):
        response = await orders.post("/orders", json=body, headers={b"Idempotency-Key": bad})
        assert response.status_code == 400, (bad, response.text)
    for bad_body in (
        {"customer_id": "c3", "amount": "-1"},
        {"customer_id": "c3", "amount": "1.001"},
        {"customer_id": "", "amount": "1"},
        {"customer_id": "c3", "amount": "1", "currency": "euro"},
        {"customer_id": "c3", "amount": "1", "extra": 1},
    ):
        response = await orders.post("/orders", json=bad_body, headers={"Idempotency-Key": "ok"})
        assert response.status_code == 422, (bad_body, response.text)
    key = {"Idempotency-Key": f"reuse-{uuid.uuid4()}"}
    assert (await orders.post("/orders", json=body, headers=key)).status_code == 201
    other = await orders.post("/orders", json={**body, "amount": "2.00"}, headers=key)
    assert other.status_code == 422 and "different order" in other.json()["detail"]
    assert (await orders.get(f"/orders/{uuid.uuid4()}")).status_code == 404
    assert (await orders.get("/orders/not-a-uuid")).status_code == 422


async def test_top_up_is_idempotent(payments: httpx.AsyncClient) -> None:
    customer = f"c-{uuid.uuid4().hex[:8]}"
    assert (await payments.get(f"/wallets/{customer}")).status_code == 404
    key = {"Idempotency-Key": "seed-1"}
    first = await payments.post(
        f"/wallets/{customer}/top-up", json={"amount": "10.50"}, headers=key
    )
    assert first.status_code == 201 and first.json()["balance_after"] == "10.50"
    again = await payments.post(
        f"/wallets/{customer}/top-up", json={"amount": "10.50"}, headers=key
    )
    assert again.status_code == 200 and again.json() == first.json()
    other = await payments.post(
        f"/wallets/{customer}/top-up", json={"amount": "1.00"}, headers={"Idempotency-Key": "s2"}
    )
    assert other.status_code == 201
    wallet = (await payments.get(f"/wallets/{customer}")).json()
    assert wallet["balance"] == "11.50" and wallet["version"] == 2
    mismatch = await payments.post(
        f"/wallets/{customer}/top-up", json={"amount": "9.99"}, headers=key
    )
    assert mismatch.status_code == 422
    assert (
        await payments.post(f"/wallets/{customer}/top-up", json={"amount": "1"})
    ).status_code == 400
    assert (await payments.get(f"/payments/{uuid.uuid4()}")).status_code == 404


async def test_health_and_metrics(orders: httpx.AsyncClient, payments: httpx.AsyncClient) -> None:
    for client in (orders, payments):
        health = await client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200
        assert "example_http_requests_total" in metrics.text


async def test_late_payment_result_never_moves_an_order_backwards(
    orders: httpx.AsyncClient, database_url: str
) -> None:
    import datetime as dt

    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from example_services.orders._handlers import Applied, apply_payment_result
    from ledgerbox.outbox import EventEnvelope

    placed = await orders.post(
        "/orders",
        json={"customer_id": "c9", "amount": "3.00"},
        headers={"Idempotency-Key": f"late-{uuid.uuid4()}"},
    )
    order_id = placed.json()["id"]

    def result(event_type: str) -> EventEnvelope:
        return EventEnvelope(
            event_id=uuid.uuid4(),
            idempotency_key=f"k-{uuid.uuid4()}",
            event_type=event_type,
            topic="t.payments",
            partition_key=order_id,
            source="/test",
            aggregate_type="payment",
            aggregate_id=str(uuid.uuid4()),
            aggregate_version=1,
            occurred_at=dt.datetime.now(dt.UTC),
            payload={"order_id": order_id},
        )

    engine = create_async_engine(database_url)
    try:
        outcomes = []
        for event_type in ("PaymentSucceeded", "PaymentFailed", "PaymentSucceeded"):
            async with AsyncSession(engine) as session, session.begin():
                outcomes.append(await apply_payment_result(session, result(event_type)))
    finally:
        await engine.dispose()
    assert outcomes == [Applied.APPLIED, Applied.IGNORED, Applied.IGNORED]
    order = (await orders.get(f"/orders/{order_id}")).json()
    assert order["status"] == "PAID" and order["version"] == 2 and order["closed_at"]
