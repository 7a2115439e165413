"""The example APIs against a real PostgreSQL: status codes, idempotency, one transaction."""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import httpx
import pytest
import pytest_asyncio
import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from example_services._config import ServiceSettings
from example_services.orders.api import create_app as order_app
from example_services.orders.api import (
    order_placed as placed_event,
)
from example_services.orders.api import (
    order_writer,
    place_order_statement,
    place_order_tx,
)
from example_services.payments.api import create_app as payment_app
from ledgerbox.outbox import EventEnvelope


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


async def test_a_nul_or_a_lone_surrogate_in_a_field_is_a_422_not_a_500(
    orders: httpx.AsyncClient, payments: httpx.AsyncClient
) -> None:
    # Before: the 422 echoes the input, and FastAPI's UTF-8 rendering of a lone surrogate
    # raised UnicodeEncodeError (a 500). A NUL was a 422 already.
    headers = {"Idempotency-Key": "ok", "content-type": "application/json"}
    for field in ('"c\\u0000"', '"c\\ud800"'):
        raw = f'{{"customer_id": {field}, "amount": "1.00"}}'.encode()
        response = await orders.post("/orders", content=raw, headers=headers)
        assert response.status_code == 422, (raw, response.text)
        assert response.json()["detail"][0]["loc"] == ["body", "customer_id"]
    raw = b'{"amount": "\\ud800"}'
    response = await payments.post("/wallets/c1/top-up", content=raw, headers=headers)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "amount"]


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


async def test_metrics_count_requests_by_route_and_status(orders: httpx.AsyncClient) -> None:
    # The pure ASGI middleware reads the matched route from the scope and the status from
    # the response start: both must reach the counter, for answers of the endpoint and for
    # errors raised before it runs (a 404 of the route, a 400 of the key rule).
    body = {"customer_id": "c-metrics", "amount": "1.00"}
    assert (
        await orders.post("/orders", json=body, headers={"Idempotency-Key": f"m-{uuid.uuid4()}"})
    ).status_code == 201
    assert (await orders.post("/orders", json=body)).status_code == 400
    assert (await orders.get(f"/orders/{uuid.uuid4()}")).status_code == 404
    assert (await orders.get("/no-such-route")).status_code == 404
    text = (await orders.get("/metrics")).text

    def count(method: str, route: str, status: int) -> float:
        for line in text.splitlines():
            if (
                line.startswith("example_http_requests_total{")
                and all(f'{k}="{v}"' in line for k, v in (("method", method), ("route", route)))
                and f'status="{status}"' in line
            ):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    assert count("POST", "/orders", 201) >= 1
    assert count("POST", "/orders", 400) >= 1
    assert count("GET", "/orders/{order_id}", 404) >= 1
    assert count("GET", "unmatched", 404) >= 1
    assert 'example_http_request_duration_seconds_count{route="/orders"' in text


async def test_place_order_writes_order_event_and_history_in_one_transaction(
    orders: httpx.AsyncClient, engine: Engine
) -> None:
    key = {"Idempotency-Key": f"hist-{uuid.uuid4()}"}
    body = {"customer_id": "c-hist", "amount": "7.25"}
    first = await orders.post("/orders", json=body, headers=key)
    assert first.status_code == 201, first.text
    order = first.json()
    assert order["created_at"] and order["closed_at"] is None and order["currency"] == "EUR"
    assert (await orders.post("/orders", json=body, headers=key)).status_code == 200
    with engine.connect() as conn:
        history = conn.execute(
            sa.text(
                "SELECT h.event_id, h.event_type, h.from_status, h.to_status,"
                " h.version_before, h.version_after, h.outcome, o.event_id AS outbox_event_id,"
                " h.applied_at >= r.created_at AS after_order"
                " FROM order_events_applied h JOIN outbox o ON o.aggregate_id = :id"
                " JOIN orders r ON r.id = h.order_id WHERE h.order_id = CAST(:id AS uuid)"
            ),
            {"id": order["id"]},
        ).all()
    assert len(history) == 1, "one history entry per order, none for the replay"
    entry = history[0]
    assert (entry.event_type, entry.from_status, entry.to_status, entry.outcome) == (
        "OrderPlaced",
        None,
        "PENDING",
        "applied",
    )
    assert (entry.version_before, entry.version_after) == (0, 1)
    assert entry.event_id == entry.outbox_event_id and entry.after_order


async def test_place_order_tx_answers_a_known_key_and_places_when_the_key_is_new_after_all(
    orders: httpx.AsyncClient, async_engine: AsyncEngine
) -> None:
    """(``orders``: the app's start-up created the service's tables.) ``place_order_tx``
    without HTTP. A known key: no row, the stored event back, nothing
    written. The statement found the key but ``astage_once`` then inserts (the row vanished
    in between, e.g. retention cleanup; forced here with a statement that returns nothing):
    the order is placed with the event, as a new request."""
    writer = order_writer(ServiceSettings(orders_topic="t.orders"))
    statement = place_order_statement(writer)

    def order_of(event: EventEnvelope, order_id: uuid.UUID) -> dict[str, Any]:
        return {
            "id": order_id, "customer_id": "c-tx", "amount": Decimal("3.00"), "currency": "EUR",
            "status": "PENDING", "event_id": event.event_id,
        }  # fmt: skip

    def event_of(order_id: uuid.UUID, key: str) -> EventEnvelope:
        return placed_event(writer, order_id, "c-tx", Decimal("3.00"), "EUR", key)

    first_id, again_id, late_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    first = event_of(first_id, "tx-1")
    async with async_engine.begin() as conn:
        staged, row = await place_order_tx(
            conn, writer, statement, first, order_of(first, first_id)
        )
        assert staged.created and row is not None and row["id"] == first_id
    again = event_of(again_id, "tx-1")
    async with async_engine.begin() as conn:
        staged, row = await place_order_tx(
            conn, writer, statement, again, order_of(again, again_id)
        )
        assert not staged.created and row is None and staged.event == first
    late = event_of(late_id, "tx-2")
    nothing = sa.text("SELECT 1 AS id WHERE false")
    async with async_engine.begin() as conn:
        staged, row = await place_order_tx(conn, writer, nothing, late, order_of(late, late_id))
        assert staged.created and row is not None and row["id"] == late_id
    async with async_engine.connect() as conn:
        placed = await conn.execute(sa.text("SELECT id FROM orders WHERE customer_id = 'c-tx'"))
        assert set(placed.scalars().all()) == {first_id, late_id}
        keys = await conn.execute(
            sa.text("SELECT count(*) FROM outbox WHERE partition_key = 'c-tx'")
        )
        assert keys.scalar_one() == 2


async def test_database_unreachable_is_503_with_the_retry_hint() -> None:
    # Nothing listens on the port: the POST's first statement fails to connect. The answer
    # says what happened and what to do (retry with the same key), never a bare 500.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql+psycopg://postgres:postgres@127.0.0.1:{port}/nowhere"
    app = order_app(ServiceSettings(order_database_url=url, migrate_on_start=False))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://o") as client,
    ):
        response = await client.post(
            "/orders",
            json={"customer_id": "c1", "amount": "1.00"},
            headers={"Idempotency-Key": "k-unreachable"},
        )
    assert response.status_code == 503, response.text
    detail = response.json()["detail"]
    assert "database unavailable" in detail and "same Idempotency-Key" in detail


@pytest_asyncio.fixture
async def payment_tables(payments: httpx.AsyncClient, database_url: str) -> AsyncIterator[str]:
    # The payment app's startup created the payment tables in ``database_url``.
    yield database_url


def order_placed(customer: str, amount: str, order_id: uuid.UUID | None = None) -> EventEnvelope:
    oid = order_id or uuid.uuid4()
    return EventEnvelope(
        event_id=uuid.uuid4(),
        idempotency_key=f"k-{uuid.uuid4()}",
        event_type="OrderPlaced",
        topic="t.orders",
        partition_key=customer,
        source="/test",
        aggregate_type="order",
        aggregate_id=str(oid),
        aggregate_version=1,
        occurred_at=dt.datetime.now(dt.UTC),
        payload={"order_id": str(oid), "customer_id": customer, "amount": amount},
    )


async def test_pay_order_batch_reads_ahead_once_debits_each_and_stages_results_in_one_insert(
    payments: httpx.AsyncClient, payment_tables: str, engine: Engine
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from example_services.payments._handlers import pay_order, payment_writer
    from example_services.payments._models import PaymentStatus

    customer, other = f"c-{uuid.uuid4().hex[:8]}", f"c-{uuid.uuid4().hex[:8]}"
    for who, amount in ((customer, "20.00"), (other, "3.00")):
        assert (
            await payments.post(
                f"/wallets/{who}/top-up",
                json={"amount": amount},
                headers={"Idempotency-Key": f"f-{who}"},
            )
        ).status_code == 201
    writer = payment_writer("t.payments")
    events = [order_placed(customer, "5.00") for _ in range(3)] + [order_placed(customer, "9.00")]
    events.insert(2, order_placed(other, "2.00"))  # another customer in the same batch
    outbox_inserts: list[str] = []
    reads: list[str] = []
    async_engine = create_async_engine(payment_tables)

    def note(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO OUTBOX"):
            outbox_inserts.append(statement)
        if statement.lstrip().upper().startswith("SELECT"):
            reads.append(statement)

    sa.event.listen(async_engine.sync_engine, "before_cursor_execute", note)
    try:
        async with AsyncSession(async_engine) as session, session.begin():
            # As the consumer calls it: each event with the batch it is part of.
            outcomes = [await pay_order(session, event, writer, events) for event in events]
        # The payments and the wallets of all five orders: ONE read, at the first call; each
        # debit then used the balance and version the one before it left.
        assert len(reads) == 1, reads
        assert outcomes.pop(2) is PaymentStatus.SUCCEEDED  # the other customer's order
        assert (await payments.get(f"/wallets/{other}")).json()["balance"] == "1.00"
        # A second delivery of the first order under a new event id: nothing is written.
        again = order_placed(customer, "5.00", uuid.UUID(events[0].payload["order_id"]))
        async with AsyncSession(async_engine) as session, session.begin():
            assert await pay_order(session, again, writer) is None
    finally:
        await async_engine.dispose()
    assert outcomes == [PaymentStatus.SUCCEEDED] * 3 + [PaymentStatus.FAILED]
    # The handler's statements are Core / text (no autoflush): the five staged results go
    # out in ONE multi-row INSERT at commit, not one round trip per event.
    assert len(outbox_inserts) == 1, outbox_inserts
    wallet = (await payments.get(f"/wallets/{customer}")).json()
    assert wallet["balance"] == "5.00" and wallet["version"] == 4  # top-up + 3 debits
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT p.status, p.reason, p.balance_after, o.event_type FROM payments p"
                " JOIN outbox o ON o.aggregate_id = p.id::text"
                " WHERE p.customer_id = :c ORDER BY p.created_at, p.balance_after DESC"
            ),
            {"c": customer},
        ).all()
    assert [(r.status, r.reason, str(r.balance_after), r.event_type) for r in rows] == [
        ("SUCCEEDED", None, "15.00", "PaymentSucceeded"),
        ("SUCCEEDED", None, "10.00", "PaymentSucceeded"),
        ("SUCCEEDED", None, "5.00", "PaymentSucceeded"),
        ("FAILED", "insufficient funds", "5.00", "PaymentFailed"),
    ]


async def test_pay_order_without_a_wallet_fails_the_payment(
    payments: httpx.AsyncClient, payment_tables: str
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from example_services.payments._handlers import pay_order, payment_writer
    from example_services.payments._models import PaymentStatus

    event = order_placed(f"c-{uuid.uuid4().hex[:8]}", "1.00")
    async_engine = create_async_engine(payment_tables)
    try:
        async with AsyncSession(async_engine) as session, session.begin():
            outcome = await pay_order(session, event, payment_writer("t.payments"))
    finally:
        await async_engine.dispose()
    assert outcome is PaymentStatus.FAILED
    payment = (await payments.get(f"/payments/{event.payload['order_id']}")).json()
    assert payment["status"] == "FAILED" and payment["reason"] == "no wallet"
    assert payment["balance_after"] is None


def bump_version_before(
    async_engine: Any, engine: Engine, marker: str, sql: str, params: dict[str, Any]
) -> None:
    """Before the statement containing ``marker`` runs, commit ``sql`` from another
    connection: the row the handler read moves to a new version under its feet."""

    def race(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if marker in statement:
            with engine.begin() as other:
                other.execute(sa.text(sql), params)

    sa.event.listen(async_engine.sync_engine, "before_cursor_execute", race)


async def test_pay_order_on_a_wallet_changed_since_read_is_a_version_conflict(
    payments: httpx.AsyncClient, payment_tables: str, engine: Engine
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from example_services.payments._handlers import pay_order, payment_writer
    from ledgerbox.inbox import VersionConflictError

    customer = f"c-{uuid.uuid4().hex[:8]}"
    await payments.post(
        f"/wallets/{customer}/top-up", json={"amount": "10.00"}, headers={"Idempotency-Key": "t"}
    )
    event = order_placed(customer, "4.00")
    async_engine = create_async_engine(payment_tables)
    bump_version_before(
        async_engine,
        engine,
        "WITH debited AS",
        "UPDATE wallets SET balance = balance + 1, version = version + 1 WHERE customer_id = :c",
        {"c": customer},
    )
    try:
        with pytest.raises(VersionConflictError) as raised:
            async with AsyncSession(async_engine) as session, session.begin():
                await pay_order(session, event, payment_writer("t.payments"))
    finally:
        await async_engine.dispose()
    assert raised.value.table == "wallets" and raised.value.expected_version == 1
    assert raised.value.key == {"customer_id": customer}
    # Nothing of the losing attempt stays: only the racing credit moved the wallet.
    wallet = (await payments.get(f"/wallets/{customer}")).json()
    assert wallet["balance"] == "11.00" and wallet["version"] == 2
    assert (await payments.get(f"/payments/{event.payload['order_id']}")).status_code == 404


def bump_version_at(
    async_engine: Any, engine: Engine, marker: str, nth: int, sql: str, params: dict[str, Any]
) -> None:
    """As :func:`bump_version_before`, before the ``nth`` statement (1-based) containing
    ``marker`` only: a row read ahead for a batch moves before a later event's write."""
    seen = 0

    def race(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        nonlocal seen
        if marker in statement:
            seen += 1
            if seen == nth:
                with engine.begin() as other:
                    other.execute(sa.text(sql), params)

    sa.event.listen(async_engine.sync_engine, "before_cursor_execute", race)


@pytest.mark.parametrize("amount", ["4.00", "50.00"], ids=["debit", "failed-payment"])
async def test_a_wallet_changed_after_the_batch_read_is_a_version_conflict(
    payments: httpx.AsyncClient, payment_tables: str, engine: Engine, amount: str
) -> None:
    """Read ahead: the batch read both customers' wallets at version 1 with its first order
    (another customer's, debited); a top-up of this customer's wallet commits before the
    second order's write. That write - a debit, or a failed payment ("insufficient funds" on
    the balance read) - is a conflict with the version read, never a decision on a stale
    balance. (Once the batch wrote a wallet it holds the row's lock: nobody else changes it
    before the batch ends.)"""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from example_services.payments._handlers import pay_order, payment_writer
    from ledgerbox.inbox import VersionConflictError

    customer, first = f"c-{uuid.uuid4().hex[:8]}", f"c-{uuid.uuid4().hex[:8]}"
    for who in (customer, first):
        await payments.post(
            f"/wallets/{who}/top-up", json={"amount": "10.00"}, headers={"Idempotency-Key": who}
        )
    batch = [order_placed(first, "1.00"), order_placed(customer, amount)]
    async_engine = create_async_engine(payment_tables)
    top_up = (
        "UPDATE wallets SET balance = balance + 100, version = version + 1 WHERE customer_id = :c"
    )
    bump_version_at(async_engine, engine, "INSERT INTO payments", 2, top_up, {"c": customer})
    try:
        with pytest.raises(VersionConflictError) as raised:
            async with AsyncSession(async_engine) as session, session.begin():
                for event in batch:
                    await pay_order(session, event, payment_writer("t.payments"), batch)
    finally:
        await async_engine.dispose()
    assert raised.value.expected_version == 1 and raised.value.key == {"customer_id": customer}
    wallet = (await payments.get(f"/wallets/{customer}")).json()
    assert wallet["balance"] == "110.00" and wallet["version"] == 2  # the top-up only
    assert (await payments.get(f"/wallets/{first}")).json()["balance"] == "10.00"
    for event in batch:
        assert (await payments.get(f"/payments/{event.payload['order_id']}")).status_code == 404


async def test_the_read_ahead_does_not_outlive_its_transaction(
    payments: httpx.AsyncClient, payment_tables: str
) -> None:
    """A session used again after a rollback reads again: the order the rolled-back
    transaction had paid is paid now, not skipped as "already paid"."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from example_services.payments._handlers import pay_order, payment_writer
    from example_services.payments._models import PaymentStatus

    customer = f"c-{uuid.uuid4().hex[:8]}"
    await payments.post(
        f"/wallets/{customer}/top-up", json={"amount": "10.00"}, headers={"Idempotency-Key": "r"}
    )
    event = order_placed(customer, "4.00")
    writer = payment_writer("t.payments")
    async_engine = create_async_engine(payment_tables)
    try:
        async with AsyncSession(async_engine) as session:
            with pytest.raises(RuntimeError):
                async with session.begin():
                    assert await pay_order(session, event, writer, [event]) is not None
                    raise RuntimeError("a later statement fails: all of it rolls back")
            async with session.begin():
                again = await pay_order(session, event, writer, [event])
    finally:
        await async_engine.dispose()
    assert again is PaymentStatus.SUCCEEDED
    wallet = (await payments.get(f"/wallets/{customer}")).json()
    assert wallet["balance"] == "6.00" and wallet["version"] == 2


async def place_orders(orders: httpx.AsyncClient, customer: str, count: int) -> list[uuid.UUID]:
    """``count`` new orders of ``customer`` (1.00 each) through the order API: their ids."""
    ids = []
    for n in range(count):
        placed = await orders.post(
            "/orders",
            json={"customer_id": customer, "amount": "1.00"},
            headers={"Idempotency-Key": f"{customer}-{n}-{uuid.uuid4()}"},
        )
        ids.append(uuid.UUID(placed.json()["id"]))
    return ids


async def test_an_order_changed_after_the_batch_read_is_a_version_conflict(
    orders: httpx.AsyncClient, database_url: str, engine: Engine
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from example_services.orders._handlers import apply_payment_result
    from ledgerbox.inbox import VersionConflictError

    ids = await place_orders(orders, "c-race2", 2)
    batch = [
        order_placed("c-race2", "1.00", oid).model_copy(update={"event_type": "PaymentSucceeded"})
        for oid in ids
    ]
    async_engine = create_async_engine(database_url)
    bump_version_at(
        async_engine,
        engine,
        "WITH moved AS",
        2,
        "UPDATE orders SET version = version + 1 WHERE id = CAST(:id AS uuid)",
        {"id": str(ids[1])},
    )
    try:
        with pytest.raises(VersionConflictError) as raised:
            async with AsyncSession(async_engine) as session, session.begin():
                for event in batch:
                    await apply_payment_result(session, event, batch)
    finally:
        await async_engine.dispose()
    assert raised.value.expected_version == 1 and raised.value.key == {"id": ids[1]}
    for oid in ids:
        assert (await orders.get(f"/orders/{oid}")).json()["status"] == "PENDING"


async def test_payment_result_on_an_order_changed_since_read_is_a_version_conflict(
    orders: httpx.AsyncClient, database_url: str, engine: Engine
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from example_services.orders._handlers import apply_payment_result
    from ledgerbox.inbox import VersionConflictError

    placed = await orders.post(
        "/orders",
        json={"customer_id": "c-race", "amount": "2.00"},
        headers={"Idempotency-Key": f"race-{uuid.uuid4()}"},
    )
    order_id = placed.json()["id"]
    result = order_placed("c-race", "2.00", uuid.UUID(order_id)).model_copy(
        update={"event_type": "PaymentSucceeded"}
    )
    async_engine = create_async_engine(database_url)
    bump_version_before(
        async_engine,
        engine,
        "WITH moved AS",
        "UPDATE orders SET version = version + 1 WHERE id = CAST(:id AS uuid)",
        {"id": order_id},
    )
    try:
        with pytest.raises(VersionConflictError) as raised:
            async with AsyncSession(async_engine) as session, session.begin():
                await apply_payment_result(session, result)
    finally:
        await async_engine.dispose()
    assert raised.value.table == "orders" and raised.value.expected_version == 1
    order = (await orders.get(f"/orders/{order_id}")).json()
    assert order["status"] == "PENDING" and order["version"] == 2 and order["closed_at"] is None
    with engine.connect() as conn:
        entries = conn.execute(
            sa.text("SELECT count(*) FROM order_events_applied WHERE order_id = CAST(:id AS uuid)"),
            {"id": order_id},
        ).scalar_one()
    assert entries == 1  # OrderPlaced only: the losing attempt wrote no history


async def test_payment_results_of_a_batch_read_their_orders_once(
    orders: httpx.AsyncClient, database_url: str
) -> None:
    """The order consumer's read ahead (``ctx.batch``): one statement reads every order of
    the batch; a second result for an order the batch already moved sees the new state."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from example_services.orders._handlers import Applied, apply_payment_result

    ids = await place_orders(orders, "c-batch", 2)
    unknown = uuid.uuid4()
    batch = [
        order_placed("c-batch", "1.00", oid).model_copy(update={"event_type": kind})
        for oid, kind in (
            (ids[0], "PaymentSucceeded"),
            (ids[1], "PaymentFailed"),
            (ids[0], "PaymentFailed"),
            (unknown, "PaymentSucceeded"),
        )
    ]
    reads: list[str] = []
    async_engine = create_async_engine(database_url)
    sa.event.listen(
        async_engine.sync_engine,
        "before_cursor_execute",
        lambda _c, _cur, statement, *_a: (
            reads.append(statement) if statement.lstrip().upper().startswith("SELECT") else None
        ),
    )
    try:
        async with AsyncSession(async_engine) as session, session.begin():
            outcomes = [await apply_payment_result(session, e, batch) for e in batch]
    finally:
        await async_engine.dispose()
    assert outcomes == [Applied.APPLIED, Applied.APPLIED, Applied.IGNORED, Applied.UNKNOWN_ORDER]
    assert len(reads) == 1, reads
    first, second = [(await orders.get(f"/orders/{oid}")).json() for oid in ids]
    assert (first["status"], first["version"]) == ("PAID", 2)
    assert (second["status"], second["version"]) == ("CANCELLED", 2)


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


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"amount": "-5.00"}, "amount"),  # a negative debit would credit the wallet
        ({"amount": "0"}, "amount"),
        ({"amount": "1.005"}, "amount"),  # the columns keep 2 places: the event and the
        ({"amount": "NaN"}, "amount"),  # debit would disagree
        ({"amount": "Infinity"}, "amount"),
        ({"amount": "five"}, "amount"),
        ({"amount": None}, "amount"),
        ({"order_id": "not-a-uuid"}, "order_id"),
        ({"customer_id": ""}, "customer_id"),
        ({"customer_id": None}, "customer_id"),
        # What the order API refuses, the consumer refuses too (one CustomerId). (A NUL
        # never gets here: an envelope refuses it, its record is unparseable.)
        ({"customer_id": " "}, "customer_id"),
        ({"customer_id": "\u00fc"}, "customer_id"),
        ({"customer_id": 17}, "customer_id"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else "-".join(f"{k}={w}" for k, w in v.items()),
)
async def test_a_malformed_order_placed_is_refused_and_writes_nothing(
    payments: httpx.AsyncClient, payment_tables: str, change: dict[str, Any], field: str
) -> None:
    """The payment handler checks the event's payload before it decides anything: an
    amount that is not a positive decimal with at most two places, an order id that is not
    a UUID or an empty customer raise MalformedEventError naming the field (the consumer
    dead-letters it at once); the wallet, the payments and the outbox are untouched. Before:
    a negative amount was "paid" and credited the wallet."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from example_services._events import MalformedEventError
    from example_services.payments._handlers import pay_order, payment_writer

    customer = f"c-{uuid.uuid4().hex[:8]}"
    assert (
        await payments.post(
            f"/wallets/{customer}/top-up",
            json={"amount": "10.00"},
            headers={"Idempotency-Key": f"m-{customer}"},
        )
    ).status_code == 201
    good = order_placed(customer, "1.00")
    bad = order_placed(customer, "1.00")
    bad = bad.model_copy(update={"payload": {**bad.payload, **change}})
    if change.get(field, "") is None:
        del bad.payload[field]  # absent, not null
    async_engine = create_async_engine(payment_tables)
    try:
        with pytest.raises(MalformedEventError, match=field) as raised:
            async with AsyncSession(async_engine) as session, session.begin():
                await pay_order(session, bad, payment_writer("t.payments"), [good, bad])
        # The batch's other event is still paid on its own.
        async with AsyncSession(async_engine) as session, session.begin():
            await pay_order(session, good, payment_writer("t.payments"), [good, bad])
    finally:
        await async_engine.dispose()
    message = str(raised.value)
    assert "\n" not in message and "OrderPlaced" in message and str(bad.event_id) in message
    wallet = (await payments.get(f"/wallets/{customer}")).json()
    assert (wallet["balance"], wallet["version"]) == ("9.00", 2)  # top-up + the good debit
    assert (await payments.get(f"/payments/{bad.payload.get('order_id')}")).status_code in (
        404,
        422,
    )


async def test_a_malformed_payment_result_is_refused(
    orders: httpx.AsyncClient, database_url: str
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from example_services._events import MalformedEventError
    from example_services.orders._handlers import apply_payment_result

    result = order_placed("c-bad", "1.00").model_copy(update={"event_type": "PaymentSucceeded"})
    result.payload["order_id"] = "not-a-uuid"
    async_engine = create_async_engine(database_url)
    try:
        with pytest.raises(MalformedEventError, match="order_id"):
            async with AsyncSession(async_engine) as session, session.begin():
                await apply_payment_result(session, result, [result])
    finally:
        await async_engine.dispose()


@pytest.mark.parametrize("service", ["orders", "payments"])
def test_the_example_consumers_dead_letter_a_malformed_event_at_once(service: str) -> None:
    """MalformedEventError is the event's fault: dead-lettered on the first attempt, not
    retried ``max_attempts`` times (30 for the payment consumer)."""
    from example_services._events import MalformedEventError
    from example_services.orders.consumer import create_consumer as order_consumer
    from example_services.payments.consumer import create_consumer as payment_consumer
    from ledgerbox._core.faults import Fault
    from ledgerbox.inbox._policy import classify

    settings = ServiceSettings(database_url="postgresql+psycopg://u:p@127.0.0.1:1/x")
    consumer = (order_consumer if service == "orders" else payment_consumer)(settings)
    verdict = classify(
        MalformedEventError("OrderPlaced e: payload invalid"),
        retry_on=consumer.config.retry_on,
        dead_letter_on=consumer.config.dead_letter_on,
    )
    assert verdict is Fault.MESSAGE
