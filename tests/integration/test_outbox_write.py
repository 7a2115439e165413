"""The outbox write path against a real PostgreSQL (G1, C07 producer half, C08 duplicate half)."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import uuid
from decimal import Decimal
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from pydantic import AwareDatetime, BaseModel
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
)
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    mapped_column,
    relationship,
    scoped_session,
    sessionmaker,
)

from ledgerbox import migrations
from ledgerbox._core.identifiers import wake_gate_key
from ledgerbox.outbox import (
    EventEnvelope,
    EventIdConflictError,
    EventStatus,
    EventValidationError,
    OutboxTable,
    OutboxWriter,
    PayloadTooLargeError,
    TopicRouter,
    envelope_from_row,
    idempotency_key,
    shard_of,
)

TABLE = OutboxTable()
WRITER = OutboxWriter(TopicRouter(default="orders.events"), source="/order-service", table=TABLE)


class Money(BaseModel):
    amount: Decimal
    order_id: uuid.UUID
    at: AwareDatetime


@pytest.fixture(scope="module")
def orders(engine: Engine) -> sa.Table:
    metadata = sa.MetaData()
    table = sa.Table(
        "orders",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("amount", sa.Numeric(12, 2), nullable=False),
    )
    metadata.create_all(engine)
    return table


@pytest.fixture(autouse=True)
def _empty(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE outbox"))
        conn.execute(sa.text("DROP TABLE IF EXISTS orders_tmp"))


def _event(n: int, payload: object | None = None, key: str | None = None) -> EventEnvelope:
    return WRITER.event(
        event_type="OrderPlaced",
        aggregate_type="order",
        aggregate_id=n,
        aggregate_version=1,
        payload=payload if payload is not None else {"order_id": n},  # type: ignore[arg-type]
        idempotency_key=key or idempotency_key("order", n),
    )


def _count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one())


def test_g1_commit_writes_the_row_rollback_writes_nothing_sync_session(
    engine: Engine, orders: sa.Table
) -> None:
    with Session(engine) as session, session.begin():
        session.execute(orders.insert().values(id=1, amount=Decimal("10.00")))
        WRITER.stage(session, _event(1))
    with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
        session.execute(orders.insert().values(id=2, amount=Decimal("10.00")))
        WRITER.stage(session, _event(2))
        session.flush()  # the row reached the database before the rollback
        raise RuntimeError("business rule failed")
    with engine.connect() as conn:
        rows = conn.execute(sa.select(TABLE.table)).mappings().all()
    assert [r["aggregate_id"] for r in rows] == ["1"]
    row = rows[0]
    assert row["status"] == EventStatus.PENDING
    assert row["shard"] == shard_of("1")
    assert row["topic"] == "orders.events" and row["source"] == "/order-service"
    assert row["published_at"] is None


def test_g1_core_connection_and_stage_many(engine: Engine) -> None:
    with engine.begin() as conn:
        WRITER.stage_many(conn, [_event(10), _event(11), _event(12)])
    with pytest.raises(RuntimeError), engine.begin() as conn:
        WRITER.stage(conn, _event(13))
        raise RuntimeError
    with engine.connect() as conn:
        ids = conn.execute(sa.text("SELECT aggregate_id FROM outbox ORDER BY id")).scalars().all()
    assert ids == ["10", "11", "12"]


async def test_g1_async_session(async_engine: AsyncEngine, engine: Engine) -> None:
    async with AsyncSession(async_engine) as session, session.begin():
        WRITER.stage(session, _event(20))
    with pytest.raises(RuntimeError):
        async with AsyncSession(async_engine) as session, session.begin():
            WRITER.stage(session, _event(21))
            await session.flush()
            raise RuntimeError
    assert _count(engine) == 1


def test_c07_uncommitted_event_is_invisible_to_other_transactions(engine: Engine) -> None:
    """Producer half of C07: until COMMIT no other transaction (the relay) can see the row."""
    with Session(engine) as producer:
        producer.begin()
        WRITER.stage(producer, _event(30))
        producer.flush()
        assert _count(engine) == 0  # the relay's view while the producer waits before COMMIT
        producer.commit()
    assert _count(engine) == 1
    with Session(engine) as producer:
        producer.begin()
        WRITER.stage(producer, _event(31))
        producer.flush()
        producer.rollback()
    assert _count(engine) == 1


def test_c08_same_idempotency_key_twice_writes_one_row_and_returns_the_first(
    engine: Engine,
) -> None:
    key = idempotency_key("order", "customer-1", "http-key-1")
    with Session(engine) as session, session.begin():
        first = WRITER.stage_once(session, _event(40, {"order_id": 40}, key))
    assert first.created
    with Session(engine) as session, session.begin():
        retry = WRITER.stage_once(session, _event(41, {"order_id": 41}, key))
    assert not retry.created
    assert retry.event.payload == {"order_id": 40}
    assert retry.event.event_id == first.event.event_id
    assert _count(engine) == 1


def test_c08_plain_stage_duplicate_fails_the_commit_and_is_recognised(engine: Engine) -> None:
    key = idempotency_key("order", "customer-2", "http-key-2")
    with Session(engine) as session, session.begin():
        WRITER.stage(session, _event(50, key=key))
    with pytest.raises(IntegrityError) as info, Session(engine) as session, session.begin():
        WRITER.stage(session, _event(51, key=key))
    assert WRITER.is_duplicate(info.value)
    assert _count(engine) == 1
    # A unique violation of another constraint is not an idempotency duplicate.
    with pytest.raises(IntegrityError) as other, engine.begin() as conn:
        conn.execute(sa.text("CREATE TEMP TABLE u (x int UNIQUE)"))
        conn.execute(sa.text("INSERT INTO u VALUES (1), (1)"))
    assert not WRITER.is_duplicate(other.value)


def test_c08_concurrent_duplicate_waits_for_the_first_and_sees_it(engine: Engine) -> None:
    key = idempotency_key("order", "customer-3", "http-key-3")
    inserted = threading.Event()
    results: list[bool] = []

    def second() -> None:
        inserted.wait(10)
        with Session(engine) as session, session.begin():
            results.append(WRITER.stage_once(session, _event(61, key=key)).created)

    worker = threading.Thread(target=second)
    worker.start()
    with Session(engine) as session, session.begin():
        assert WRITER.stage_once(session, _event(60, key=key)).created
        inserted.set()
        worker.join(0.5)
        assert worker.is_alive()  # blocked on the unique index until we commit
    worker.join(20)
    assert results == [False]
    assert _count(engine) == 1


def test_c08_stage_once_meets_the_event_id_of_an_uncommitted_row_with_another_key(
    engine: Engine,
) -> None:
    """A unique conflict on the event id (not the idempotency key) was a raw IntegrityError
    (uq_outbox_event_id) out of stage_once: the twins of one request race between the two
    unique indexes under load (the demo's concurrent twins saw a 500). Every unique conflict
    is now stage_once's answer: a duplicate when the key is stored, else a typed error."""
    first = _event(70, key="key-a")
    other = first.model_copy(update={"idempotency_key": "key-b"})
    inserted = threading.Event()
    outcome: list[BaseException | bool] = []

    def second() -> None:
        inserted.wait(10)
        try:
            with Session(engine) as session, session.begin():
                outcome.append(WRITER.stage_once(session, other).created)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=second)
    worker.start()
    with Session(engine) as session, session.begin():
        assert WRITER.stage_once(session, first).created
        inserted.set()
        worker.join(0.5)
        assert worker.is_alive()  # waits on the event-id index until we commit
    worker.join(20)
    (error,) = outcome
    assert isinstance(error, EventIdConflictError), repr(error)
    assert str(first.event_id) in str(error) and "key-b" in str(error)
    assert _count(engine) == 1


def test_c08_concurrent_twins_always_get_one_insert_and_duplicates(engine: Engine) -> None:
    """Four transactions stage the same event at once, 30 times: every round one insert and
    three duplicates, never a unique violation (the race between the idempotency-key and the
    event-id index)."""
    for round_ in range(30):
        event = _event(80 + round_, key=f"twin-{round_}-{uuid.uuid4()}")
        start = threading.Barrier(4)
        outcome: list[BaseException | bool] = []

        def twin(
            event: EventEnvelope = event,
            start: threading.Barrier = start,
            outcome: list[BaseException | bool] = outcome,
        ) -> None:
            start.wait(10)
            try:
                with engine.begin() as conn:
                    outcome.append(WRITER.stage_once(conn, event).created)
            except BaseException as exc:
                outcome.append(exc)

        threads = [threading.Thread(target=twin) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert sorted(map(repr, outcome)) == ["False", "False", "False", "True"], outcome


def test_decimal_uuid_and_aware_microsecond_datetime_round_trip_exactly(engine: Engine) -> None:
    original = Money(
        amount=Decimal("100.10"),
        order_id=uuid.UUID("0a8f2c1e-5b7d-4e3f-9a21-7c6d5e4f3a2b"),
        at=dt.datetime(
            2026, 11, 29, 23, 59, 59, 999999, tzinfo=dt.timezone(-dt.timedelta(hours=3))
        ),
    )
    occurred = dt.datetime(2026, 11, 29, 10, 0, 0, 123456, tzinfo=dt.UTC)
    event = WRITER.event(
        event_type="PaymentRequested", aggregate_type="payment", aggregate_id="p1",
        payload=original, idempotency_key="money-1", occurred_at=occurred,
    )  # fmt: skip
    with Session(engine) as session, session.begin():
        WRITER.stage(session, event)
    with engine.connect() as conn:
        row = conn.execute(sa.select(TABLE.table)).mappings().one()
    back = envelope_from_row(row)
    assert back.occurred_at == occurred
    restored = back.payload_as(Money)
    assert restored == original
    assert str(restored.amount) == "100.10"
    assert restored.at.utcoffset() == -dt.timedelta(hours=3)


def test_oversized_payload_is_rejected_at_write_time(engine: Engine) -> None:
    event = _event(70, {"blob": "x" * (1_048_576 + 1)})
    with pytest.raises(PayloadTooLargeError), Session(engine) as session, session.begin():
        WRITER.stage(session, event)
    assert _count(engine) == 0


def _notify_conninfo(database_url: str) -> str:
    return database_url.replace("postgresql+psycopg://", "postgresql://")


def _drain_notifies(conn: psycopg.Connection[object]) -> list[str]:
    return [n.channel for n in conn.notifies(timeout=0.5, stop_after=None)]


def test_notify_only_after_commit_once_per_transaction_never_after_rollback(
    engine: Engine, database_url: str
) -> None:
    with psycopg.connect(_notify_conninfo(database_url), autocommit=True) as listener:
        listener.execute(f'LISTEN "{TABLE.notify_channel}"')
        # Writers notify while a relay waits for it, holding the wake gate (relay._gate).
        listener.execute("SELECT pg_advisory_lock(%s, %s)", wake_gate_key(TABLE.notify_channel))
        with Session(engine) as session:
            session.begin()
            WRITER.stage(session, _event(80))
            session.flush()
            WRITER.stage_many(session, [_event(81), _event(82)])
            session.flush()
            assert _drain_notifies(listener) == []  # nothing before COMMIT
            session.commit()
        assert _drain_notifies(listener) == [TABLE.notify_channel]  # exactly one
        with Session(engine) as session:
            session.begin()
            WRITER.stage(session, _event(83))
            session.flush()
            session.rollback()
        assert _drain_notifies(listener) == []


def test_traceparent_of_the_active_span_goes_into_the_headers(engine: Engine) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("place-order") as span:
        event = _event(90)
        trace_id = format(span.get_span_context().trace_id, "032x")
    assert event.headers["traceparent"].split("-")[1] == trace_id
    with Session(engine) as session, session.begin():
        WRITER.stage(session, event)
    with engine.connect() as conn:
        headers = conn.execute(sa.text("SELECT headers FROM outbox")).scalar_one()
    assert headers["traceparent"] == event.headers["traceparent"]


def test_configurable_schema_and_table_names_end_to_end(engine: Engine, database_url: str) -> None:
    names = migrations.Names(schema="ledger", outbox_table="events_out", inbox_table="events_in")
    migrations.upgrade_database(database_url, names)
    table = OutboxTable("events_out", schema="ledger")
    writer = OutboxWriter(TopicRouter(default="t"), source="/s", table=table)
    with Session(engine) as session, session.begin():
        event = writer.event(
            event_type="E", aggregate_type="a", aggregate_id=1, payload={}, idempotency_key="k"
        )
        writer.stage(session, event)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM ledger.events_out")).scalar_one() == 1
        assert conn.execute(sa.text("SELECT count(*) FROM ledger.events_in")).scalar_one() == 0


def test_async_stage_once_reports_duplicates(async_engine: AsyncEngine, engine: Engine) -> None:
    async def run() -> tuple[bool, bool]:
        key = idempotency_key("order", "c", "async-1")
        async with AsyncSession(async_engine) as session, session.begin():
            first = await WRITER.astage_once(session, _event(100, key=key))
        async with AsyncSession(async_engine) as session, session.begin():
            second = await WRITER.astage_once(session, _event(101, key=key))
        return first.created, second.created

    assert asyncio.run(run()) == (True, False)
    assert _count(engine) == 1


def test_stage_once_stores_what_stage_stores_and_is_not_compiled_per_call(engine: Engine) -> None:
    """``stage_once`` binds every column like ``stage`` (JSON payload and headers, Decimal,
    aware datetimes) and its statement is not compiled per call (it used to be recompiled
    every time: SQLAlchemy has no cache key for ``on_conflict_do_nothing``)."""
    from sqlalchemy.engine import default

    cache: list[object] = []

    def seen(conn, cursor, statement, params, context, executemany) -> None:  # type: ignore[no-untyped-def]
        if "ON CONFLICT DO NOTHING" in statement:
            cache.append(context.cache_hit)

    occurred = dt.datetime(2026, 11, 29, 10, 0, 0, 123456, tzinfo=dt.UTC)
    payload = Money(
        amount=Decimal("100.10"),
        order_id=uuid.UUID("0a8f2c1e-5b7d-4e3f-9a21-7c6d5e4f3a2b"),
        at=dt.datetime(2026, 11, 29, 23, 59, 59, 999999, tzinfo=dt.timezone(dt.timedelta(hours=5))),
    )
    sa.event.listen(engine, "after_cursor_execute", seen)
    try:
        for i, how in enumerate(("stage", "stage_once", "stage_once", "stage_once")):
            event = WRITER.event(
                event_type="PaymentRequested", aggregate_type="payment", aggregate_id=f"p{i}",
                aggregate_version=i + 1, payload=payload, idempotency_key=f"same-row-{i}",
                occurred_at=occurred, headers={"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"},
            )  # fmt: skip
            with Session(engine) as session, session.begin():
                getattr(WRITER, how)(session, event)
            with engine.connect() as conn:
                row = conn.execute(
                    sa.select(TABLE.table).where(TABLE.table.c.event_id == event.event_id)
                ).mappings().one()  # fmt: skip
            assert envelope_from_row(row) == event, how
            assert row["shard"] == shard_of(event.partition_key)
            assert row["status"] == EventStatus.PENDING
    finally:
        sa.event.remove(engine, "after_cursor_execute", seen)
    assert len(cache) == 3
    # psycopg runs the driver's own SQL (nothing compiled); another driver the cached text.
    assert all(c in (default.CACHE_HIT, default.NO_CACHE_KEY) for c in cache[1:]), cache


def test_stage_once_in_a_session_with_per_table_binds(
    engine: Engine, async_engine: AsyncEngine
) -> None:
    """A session without a default bind (``binds={table: engine}``) routes stage_once like
    the mapped rows (it used to fail: a text statement names no table)."""
    key = idempotency_key("order", "c", "binds-1")
    with Session(binds={TABLE.table: engine}) as session, session.begin():
        first = WRITER.stage_once(session, _event(200, key=key))
    with Session(binds={TABLE.table: engine}) as session, session.begin():
        second = WRITER.stage_once(session, _event(201, key=key))

    async def run() -> bool:
        async with AsyncSession(binds={TABLE.table: async_engine}) as session, session.begin():
            third = await WRITER.astage_once(session, _event(202, key=key))
        return third.created

    assert (first.created, second.created, asyncio.run(run())) == (True, False, False)
    assert second.event.event_id == first.event.event_id
    assert _count(engine) == 1


def test_session_staged_events_go_in_at_the_flush_as_one_driver_insert(
    engine: Engine, orders: sa.Table
) -> None:
    """Events staged in a Session are written at its flush by one INSERT per flush (not by
    the unit of work: their row objects leave the session; in psycopg's own SQL: nothing
    compiled), in staging order, in the session's transaction; a session with per-table
    binds routes them like the rows."""
    statements: list[str] = []

    def seen(
        conn: object, cursor: object, statement: str, params: object, context: Any, *_: object
    ) -> None:
        if statement.lstrip().startswith("INSERT INTO outbox"):
            statements.append(statement)
            assert context.compiled is None, "compiled by SQLAlchemy"

    sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        with Session(engine) as session, session.begin():
            session.execute(orders.insert().values(id=30, amount=Decimal("1.00")))
            WRITER.stage_many(session, [_event(30), _event(31), _event(32)])
            session.flush()
            # One executemany of the table's INSERT: the unit of work would have sent its
            # "insertmanyvalues" form, which returns the ids for its identity map.
            assert len(statements) == 1 and "RETURNING" not in statements[0]
            assert not session.new
            in_tx = session.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one()
            assert in_tx == 3 and _count(engine) == 0  # visible in the transaction only
            WRITER.stage(session, _event(33))
        with Session(binds={TABLE.table: engine}) as session, session.begin():
            WRITER.stage(session, _event(34))
        factory = sessionmaker(engine, class_=type("AppSession", (Session,), {}))
        with factory.begin() as session:
            WRITER.stage_many(session, [_event(35), _event(36)])
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)
    assert len(statements) == 4 and "RETURNING" not in statements[3]
    with engine.connect() as conn:
        ids = conn.execute(sa.text("SELECT aggregate_id FROM outbox ORDER BY id")).scalars().all()
    assert ids == ["30", "31", "32", "33", "34", "35", "36"]


def test_an_event_staged_in_a_savepoint_rolled_back_before_any_flush_is_not_written(
    engine: Engine,
) -> None:
    with Session(engine) as session, session.begin():
        WRITER.stage(session, _event(40))
        nested = session.begin_nested()
        WRITER.stage(session, _event(41))
        nested.rollback()  # 41 was never flushed: the rollback takes it out of the session
        WRITER.stage(session, _event(42))
    with engine.connect() as conn:
        ids = conn.execute(sa.text("SELECT aggregate_id FROM outbox ORDER BY id")).scalars().all()
    assert ids == ["40", "42"]


async def test_events_staged_by_the_callers_own_before_flush_listener_are_written(
    async_engine: AsyncEngine, engine: Engine
) -> None:
    """A domain-events listener staging at flush time (after ledgerbox's own listener ran)
    still gets its events written, through the unit of work; sync and async sessions."""

    def stage_domain_event(session: Session, *_: object) -> None:
        pending = session.info.pop("domain_events", [])
        for n in pending:
            WRITER.stage(session, _event(n))

    with Session(engine) as session:
        sa.event.listen(session, "before_flush", stage_domain_event)
        with session.begin():
            session.info["domain_events"] = [50]
            WRITER.stage(session, _event(51))
    async with AsyncSession(async_engine) as asession:
        sa.event.listen(asession.sync_session, "before_flush", stage_domain_event)
        async with asession.begin():
            asession.info["domain_events"] = [52]
            WRITER.stage(asession, _event(53))
    with engine.connect() as conn:
        ids = conn.execute(sa.text("SELECT aggregate_id FROM outbox ORDER BY id")).scalars().all()
    assert sorted(ids) == ["50", "51", "52", "53"]


def test_two_writers_of_one_table_keep_the_staging_order_of_a_key(engine: Engine) -> None:
    """Two writers (say, two sources) sharing one outbox table, staging events of one
    aggregate interleaved in one transaction: ids follow the staging order, as the unit of
    work wrote them before the flush's INSERT (it grouped the rows by writer: 1, 3, 2)."""
    other = OutboxWriter(TopicRouter(default="orders.events"), source="/billing", table=TABLE)
    with Session(engine) as session, session.begin():
        WRITER.stage(session, _event(70, key="k-70"))
        other.stage(session, _event(70, {"n": 2}, key="k-71"))
        WRITER.stage(session, _event(70, {"n": 3}, key="k-72"))
    with engine.connect() as conn:
        keys = conn.execute(sa.text("SELECT idempotency_key FROM outbox ORDER BY id")).scalars()
        assert keys.all() == ["k-70", "k-71", "k-72"]


def test_a_duplicate_failing_the_flush_leaves_the_session_needing_a_rollback(
    engine: Engine, orders: sa.Table
) -> None:
    """The flush's INSERT failing (a duplicate key) fails the flush as the unit of work does:
    the session must be rolled back, so a second ``commit`` raises instead of returning over
    a transaction PostgreSQL rolled back (it returned, the order row was lost). In a savepoint
    only the savepoint fails; the outer transaction commits its own rows and events."""
    first = _event(80)
    with Session(engine) as session, session.begin():
        WRITER.stage(session, first)
    twin = first.model_copy(update={"event_id": uuid.uuid4()})
    with Session(engine) as session:
        session.execute(orders.insert().values(id=80, amount=Decimal("1.00")))
        WRITER.stage(session, twin)
        with pytest.raises(IntegrityError) as caught:
            session.commit()
        assert WRITER.is_duplicate(caught.value)
        with pytest.raises(sa.exc.PendingRollbackError):
            session.commit()
        session.rollback()
        with session.begin():  # the session is usable again
            WRITER.stage(session, _event(81))
    with Session(engine) as session, session.begin():
        session.execute(orders.insert().values(id=82, amount=Decimal("1.00")))
        with pytest.raises(IntegrityError) as caught, session.begin_nested():
            WRITER.stage(session, twin)
        assert WRITER.is_duplicate(caught.value)
        WRITER.stage(session, _event(82))
    with engine.connect() as conn:
        ids = conn.execute(sa.text("SELECT aggregate_id FROM outbox ORDER BY id")).scalars().all()
        order_ids = conn.execute(sa.text("SELECT id FROM orders WHERE id >= 80 ORDER BY id"))
        assert (ids, order_ids.scalars().all()) == (["80", "81", "82"], [82])


def test_stage_honours_a_schema_translate_map(engine: Engine) -> None:
    """``stage`` (Session flush and Core ``Connection``) writes into the table the connection's
    ``schema_translate_map`` names, as the unit of work and the Core insert did: the driver
    SQL names the table as configured, so it wrote a tenant's events into ``public.outbox``
    (``stage_once`` is documented not to translate: docs/outbox.md)."""
    with engine.begin() as conn:
        conn.execute(sa.text("DROP SCHEMA IF EXISTS tenant_a CASCADE"))
        conn.execute(sa.text("CREATE SCHEMA tenant_a"))
        conn.execute(sa.text("CREATE TABLE tenant_a.outbox (LIKE public.outbox INCLUDING ALL)"))
    tenant = engine.execution_options(schema_translate_map={None: "tenant_a"})
    try:
        with Session(tenant) as session, session.begin():
            WRITER.stage(session, _event(90))
        with tenant.begin() as conn:
            WRITER.stage_many(conn, [_event(91), _event(92)])
        with engine.connect() as conn:
            ids = conn.execute(sa.text("SELECT aggregate_id FROM tenant_a.outbox ORDER BY id"))
            assert (ids.scalars().all(), _count(engine)) == (["90", "91", "92"], 0)
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text("DROP SCHEMA tenant_a CASCADE"))


def test_a_routing_session_gets_the_outbox_mapper_at_the_flush(engine: Engine) -> None:
    """A ``Session`` subclass overriding ``get_bind`` (SQLAlchemy's "custom vertical
    partitioning" recipe) is asked with the outbox ``Mapper``, as the unit of work asked it:
    the flush's INSERT passed the mapped class, and ``mapper.class_`` raised AttributeError;
    ``stage_once`` routes the same way."""
    asked: list[object] = []

    class RoutingSession(Session):
        def get_bind(self, mapper: Any = None, clause: Any = None, **kw: Any) -> Any:
            asked.append(mapper.class_ if mapper is not None else None)
            return engine

    with RoutingSession() as session, session.begin():
        WRITER.stage(session, _event(100))
        assert WRITER.stage_once(session, _event(101)).created
    assert TABLE.row_class in asked and _count(engine) == 2


def test_stage_then_stage_once_of_one_aggregate_keep_the_call_order(engine: Engine) -> None:
    """``stage`` defers its INSERT to the flush, ``stage_once`` inserts at once: the event
    staged first got the higher id (the relay published the second event first)."""
    with Session(engine) as session, session.begin():
        WRITER.stage(session, _event(90, key="k-90"))
        WRITER.stage_many(session, [_event(90, {"n": 2}, key="k-91")])
        assert WRITER.stage_once(session, _event(90, {"n": 3}, key="k-92")).created
        WRITER.stage(session, _event(90, {"n": 4}, key="k-93"))
    with engine.connect() as conn:
        keys = conn.execute(sa.text("SELECT idempotency_key FROM outbox ORDER BY id")).scalars()
        assert keys.all() == ["k-90", "k-91", "k-92", "k-93"]


async def test_stage_then_astage_once_keep_the_call_order(
    async_engine: AsyncEngine, engine: Engine
) -> None:
    async with AsyncSession(async_engine) as session, session.begin():
        WRITER.stage(session, _event(91, key="k-94"))
        assert (await WRITER.astage_once(session, _event(91, {"n": 2}, key="k-95"))).created
    with engine.connect() as conn:
        keys = conn.execute(sa.text("SELECT idempotency_key FROM outbox ORDER BY id")).scalars()
        assert keys.all() == ["k-94", "k-95"]


def test_a_staged_duplicate_fails_stage_once_as_its_flush_would_and_nothing_commits(
    engine: Engine, orders: sa.Table
) -> None:
    # stage_once now writes the events staged before it: a staged duplicate raises there
    # (not at the commit). The caller sees the flush's IntegrityError, the session needs a
    # rollback (a commit cannot return over the aborted transaction) and nothing of the
    # transaction - business row, staged events, the stage_once event - is committed.
    with Session(engine) as session, session.begin():
        WRITER.stage(session, _event(95, key="k-dup"))
    with Session(engine) as session:
        session.begin()
        session.execute(orders.insert().values(id=95, amount=Decimal("1.00")))
        WRITER.stage(session, _event(96, key="k-new"))
        WRITER.stage(session, _event(95, key="k-dup"))
        with pytest.raises(IntegrityError) as raised:
            WRITER.stage_once(session, _event(97, key="k-once"))
        assert WRITER.is_duplicate(raised.value)
        with pytest.raises(sa.exc.PendingRollbackError):
            session.commit()
        session.rollback()
    with engine.connect() as conn:
        keys = conn.execute(sa.text("SELECT idempotency_key FROM outbox ORDER BY id")).scalars()
        assert keys.all() == ["k-dup"]
        assert conn.execute(sa.text("SELECT count(*) FROM orders WHERE id = 95")).scalar() == 0


def test_stage_once_in_a_rolled_back_savepoint_keeps_the_events_staged_before_it(
    engine: Engine,
) -> None:
    # begin_nested() flushes the events staged before it, so the savepoint's rollback drops
    # only what stage_once wrote inside it.
    with Session(engine) as session, session.begin():
        WRITER.stage(session, _event(98, key="k-98"))
        savepoint = session.begin_nested()
        assert WRITER.stage_once(session, _event(98, {"n": 2}, key="k-99")).created
        savepoint.rollback()
        assert WRITER.stage_once(session, _event(98, {"n": 3}, key="k-100")).created
    with engine.connect() as conn:
        keys = conn.execute(sa.text("SELECT idempotency_key FROM outbox ORDER BY id")).scalars()
        assert keys.all() == ["k-98", "k-100"]


def test_stage_and_stage_once_through_a_scoped_session(engine: Engine) -> None:
    """A ``scoped_session`` (the registry most web apps use) is accepted by both; stage_once
    raised AttributeError ('scoped_session' object has no attribute 'dialect')."""
    registry = scoped_session(sessionmaker(engine))
    try:
        with registry.begin():
            WRITER.stage(registry, _event(95, key="k-96"))
            assert WRITER.stage_once(registry, _event(95, {"n": 2}, key="k-97")).created
        assert not WRITER.stage_once(registry, _event(95, {"n": 2}, key="k-97")).created
        registry.rollback()
    finally:
        registry.remove()
    with engine.connect() as conn:
        keys = conn.execute(sa.text("SELECT idempotency_key FROM outbox ORDER BY id")).scalars()
        assert keys.all() == ["k-96", "k-97"]


async def test_astage_once_through_an_async_scoped_session(
    async_engine: AsyncEngine, engine: Engine
) -> None:
    registry = async_scoped_session(
        async_sessionmaker(async_engine), scopefunc=asyncio.current_task
    )
    try:
        async with registry.begin():
            WRITER.stage(registry, _event(96, key="k-98"))
            assert (await WRITER.astage_once(registry, _event(96, {"n": 2}, key="k-99"))).created
    finally:
        await registry.remove()
    with engine.connect() as conn:
        keys = conn.execute(sa.text("SELECT idempotency_key FROM outbox ORDER BY id")).scalars()
        assert keys.all() == ["k-98", "k-99"]


def test_model_construct_validates_like_the_constructor() -> None:
    # Before: pydantic's model_construct skipped every validator and stage wrote the result
    # (a NUL failed the flush with a raw DataError, an empty key or a naive time was stored).
    from pydantic import ValidationError

    fields = dict(_event(90))
    for bad, what in (
        ({"event_type": "Order\x00Placed"}, "NUL"),
        ({"partition_key": ""}, "partition_key"),
        ({"occurred_at": dt.datetime(2026, 1, 1)}, "occurred_at"),
        ({"surprise": 1}, "surprise"),
    ):
        with pytest.raises(ValidationError, match=what):
            EventEnvelope.model_construct(**{**fields, **bad})
    assert EventEnvelope.model_construct(**fields) == EventEnvelope(**fields)


@pytest.mark.parametrize(
    "payload",
    [{"x": Decimal("1.5")}, {"x": float("nan")}, {"at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)}],
)
def test_an_envelope_built_with_a_payload_event_would_convert_is_refused_at_stage(
    engine: Engine, orders: sa.Table, payload: dict[str, Any]
) -> None:
    # Before: json's TypeError (Decimal, datetime) from stage, or PostgreSQL's DataError for
    # a NaN at the flush. OutboxWriter.event() converts these; the constructor does not.
    event = EventEnvelope(**{**dict(_event(91)), "payload": payload})
    for stage in (WRITER.stage, WRITER.stage_once):
        with Session(engine) as session, session.begin():
            session.execute(orders.insert().values(id=910, amount=Decimal("1.00")))
            with pytest.raises(EventValidationError, match="payload is not JSON-ready"):
                stage(session, event)
            session.rollback()
    assert _count(engine) == 0


def test_model_copy_with_an_update_is_validated_and_staged_like_a_new_event(
    engine: Engine,
) -> None:
    from pydantic import ValidationError

    event = _event(95)
    with pytest.raises(ValidationError, match="partition_key"):
        event.model_copy(update={"partition_key": ""})
    with pytest.raises(ValidationError, match="occurred_at"):
        event.model_copy(update={"occurred_at": dt.datetime(2026, 1, 1)})
    moved = event.model_copy(update={"partition_key": "customer-7"})
    assert moved.partition_key == "customer-7" and moved.event_id == event.event_id
    with Session(engine) as session, session.begin():
        WRITER.stage(session, moved)
    with engine.connect() as conn:
        stored = conn.execute(sa.text("SELECT partition_key FROM outbox")).scalar_one()
    assert stored == "customer-7"


@pytest.mark.timeout(30)
def test_a_circular_payload_is_refused_at_stage_instead_of_hanging_the_constructor(
    engine: Engine,
) -> None:
    # Before: the constructor's storable-text walk looped forever on a payload that contains
    # itself (100% CPU in the request that built the event, never an error).
    from pydantic import ValidationError

    loop: dict[str, Any] = {"amount": 1}
    loop["self"] = loop
    event = EventEnvelope(**{**dict(_event(96)), "payload": loop})
    with Session(engine) as session, session.begin():
        with pytest.raises(EventValidationError, match="payload is not JSON-ready"):
            WRITER.stage(session, event)
        session.rollback()
    assert _count(engine) == 0
    shared = {"note": "same dict twice is fine"}
    assert EventEnvelope(**{**dict(_event(97)), "payload": {"a": shared, "b": [shared]}})
    loop["bad"] = "a\x00b"
    with pytest.raises(ValidationError, match="NUL"):
        EventEnvelope(**{**dict(_event(98)), "payload": loop})


def test_a_payload_nested_too_deeply_is_refused_at_stage_with_event_validation_error(
    engine: Engine,
) -> None:
    # Before: json's RecursionError escaped stage (not an EventValidationError).
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(5000):
        node["a"] = {}
        node = node["a"]
    event = EventEnvelope(**{**dict(_event(99)), "payload": deep})
    good = _event(100)
    for stage in (WRITER.stage_many, WRITER.stage_once):
        with Session(engine) as session, session.begin():
            with pytest.raises(EventValidationError, match="nested too deeply"):
                if stage is WRITER.stage_many:
                    WRITER.stage_many(session, [good, event])
                else:
                    WRITER.stage_once(session, event)
            session.rollback()
    assert _count(engine) == 0


def test_the_deprecated_copy_validates_like_model_copy(engine: Engine) -> None:
    # Before: pydantic's deprecated copy(update=...) skipped every validator, and stage wrote
    # an empty partition key or a naive occurred_at, and failed the flush on a NUL.
    from pydantic import PydanticDeprecatedSince20, ValidationError

    event = _event(101)
    with pytest.warns(PydanticDeprecatedSince20):
        for bad, what in (
            ({"partition_key": ""}, "partition_key"),
            ({"occurred_at": dt.datetime(2026, 1, 1)}, "occurred_at"),
            ({"event_type": "Order\x00Placed"}, "NUL"),
        ):
            with pytest.raises(ValidationError, match=what):
                event.copy(update={**bad, "event_id": uuid.uuid4()})
        with pytest.raises(ValidationError, match="partition_key"):
            event.copy(exclude={"partition_key"})
        moved = event.copy(update={"partition_key": "customer-8"})
        assert event.copy() == event
    assert moved.partition_key == "customer-8" and moved.event_id == event.event_id
    with Session(engine) as session, session.begin():
        WRITER.stage(session, moved)
    assert _count(engine) == 1


class _Base(DeclarativeBase):
    pass


class _Ledger(_Base):
    """An aggregate mapped for the unit of work, with children kept by delete-orphan."""

    __tablename__ = "write_order_ledger"
    id: Mapped[int] = mapped_column(primary_key=True)
    balance: Mapped[int]
    lines: Mapped[list[_Line]] = relationship(cascade="all, delete-orphan")


class _Line(_Base):
    __tablename__ = "write_order_line"
    id: Mapped[int] = mapped_column(primary_key=True)
    ledger_id: Mapped[int] = mapped_column(sa.ForeignKey("write_order_ledger.id"))


@pytest.fixture(scope="module")
def ledger_tables(engine: Engine) -> None:
    _Base.metadata.create_all(engine)


def _statements(engine: Engine) -> tuple[list[str], Any]:
    seen: list[str] = []

    def record(conn: object, cursor: object, statement: str, *_: object) -> None:
        seen.append(statement.lstrip().split("(")[0].split(" SET")[0].strip())

    sa.event.listen(engine, "before_cursor_execute", record)
    return seen, lambda: sa.event.remove(engine, "before_cursor_execute", record)


def _outbox_ids(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(sa.text("SELECT aggregate_id FROM outbox ORDER BY id")).scalars().all()
        )


def test_g3_a_flushs_outbox_rows_go_in_after_its_unit_of_work(
    engine: Engine, ledger_tables: None
) -> None:
    """The outbox id is the relay's order: taken after the flush's own statements (the
    UPDATE that locks the aggregate row, an INSERT), so writers that serialize on the row get
    ids in commit order (tests/faults/test_relay_order.py has the two-writer case)."""
    with Session(engine) as session, session.begin():
        session.add(_Ledger(id=1, balance=0))
    seen, stop = _statements(engine)
    try:
        with Session(engine) as session, session.begin():
            ledger = session.get(_Ledger, 1)
            assert ledger is not None
            ledger.balance = _Ledger.balance + 5  # type: ignore[assignment]
            WRITER.stage(session, _event(90))
            session.add(_Ledger(id=2, balance=0))
    finally:
        stop()
    writes = [s for s in seen if not s.startswith("SELECT")]
    assert sorted(writes[:2]) == ["INSERT INTO write_order_ledger", "UPDATE write_order_ledger"]
    assert writes[2:] == ["INSERT INTO outbox"]
    assert _outbox_ids(engine) == ["90"]


def test_a_flush_with_only_a_dropped_orphan_still_writes_the_staged_event(
    engine: Engine, ledger_tables: None
) -> None:
    """A pending orphan (delete-orphan, taken from its parent outside of any session) is
    dropped by the flush without a statement: the unit of work
    then runs nothing, and no ``after_flush`` comes. The staged event is written anyway."""
    line = _Line(id=1)
    draft = _Ledger(id=6, balance=0, lines=[line])  # never in a session
    with Session(engine) as session, session.begin():
        session.add(line)
        draft.lines.remove(line)  # an orphan now: the flush drops it without a statement
        WRITER.stage(session, _event(91))
        session.flush()
        assert session.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 1
    assert _outbox_ids(engine) == ["91"]


def test_a_partial_flush_writes_the_staged_events(engine: Engine, ledger_tables: None) -> None:
    """``session.flush([obj])`` (a subset) writes the staged events at once."""
    with Session(engine) as session, session.begin():
        other = _Ledger(id=3, balance=0)
        session.add(other)
        WRITER.stage(session, _event(92))
        session.flush([other])
        assert session.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 1
    assert _outbox_ids(engine) == ["92"]


def _drop_drafts(session: Session, *_: object) -> None:
    """A user's ``before_flush`` listener (after ledgerbox's): drafts are never flushed."""
    for obj in list(session.new):
        if isinstance(obj, _Ledger) and obj.balance < 0:
            session.expunge(obj)


def _reject_drafts(session: Session, *_: object) -> None:
    """A user's validating ``before_flush`` listener (after ledgerbox's)."""
    for obj in session.new:
        if isinstance(obj, _Ledger) and obj.balance < 0:
            raise ValueError("negative balance")


def test_with_a_listener_after_ledgerboxs_the_events_go_in_before_the_unit_of_work(
    engine: Engine, ledger_tables: None
) -> None:
    """Another ``before_flush`` listener runs after ledgerbox's: it may take the rest of the
    flush out or raise, and then no ``after_flush`` comes. So the events are written at once,
    before the unit of work, in the flush's transaction: never kept past it. Before: kept
    for an ``after_flush`` that never came, they were dropped by a later savepoint's
    rollback, written inside a later savepoint, or written by the session's NEXT transaction
    after a ``close()`` (adversarial review, 2026-12-04)."""
    with Session(engine) as session:
        sa.event.listen(session, "before_flush", _drop_drafts)
        with session.begin():  # an unrelated savepoint rolls back: the outer event stays
            session.add(_Ledger(id=4, balance=-1))  # a draft the listener drops
            WRITER.stage(session, _event(93))
            session.flush()
            with pytest.raises(IntegrityError), session.begin_nested():
                session.add(_Ledger(id=4, balance=-1))
                session.execute(sa.text("INSERT INTO write_order_ledger VALUES (7, 0), (7, 0)"))
        with session.begin():  # a savepoint begun after: its rollback keeps the outer event
            session.add(_Ledger(id=4, balance=-1))
            WRITER.stage(session, _event(94))
            session.flush()
            nested = session.begin_nested()
            session.add(_Ledger(id=8, balance=1))
            session.flush()
            nested.rollback()
        session.add(_Ledger(id=4, balance=-1))  # never committed: closed
        WRITER.stage(session, _event(95))
        session.flush()
        session.close()
        with session.begin():
            WRITER.stage(session, _event(96))
    with Session(engine) as session:
        sa.event.listen(session, "before_flush", _reject_drafts)
        session.add(_Ledger(id=4, balance=-1))
        WRITER.stage(session, _event(97))
        with pytest.raises(ValueError):
            session.flush()
        session.close()  # a rejected request: closed, then the session is reused
        with session.begin():
            WRITER.stage(session, _event(98))
        session.add(_Ledger(id=4, balance=-1))
        WRITER.stage(session, _event(99))
        with pytest.raises(ValueError):
            session.flush()
        session.rollback()
        with session.begin():
            WRITER.stage(session, _event(100))
    assert _outbox_ids(engine) == ["93", "94", "96", "98", "100"]


def test_rows_kept_for_a_unit_of_work_that_never_ran_are_still_written_or_dropped_with_it(
    engine: Engine, ledger_tables: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The net under the prediction: if a flush before the commit's own ever decided
    otherwise than ``_unit_of_work_runs`` (a SQLAlchemy that changed: pinned < 2.1, whose
    ``Session._flush`` it mirrors), rows kept for its ``after_flush`` are written before the
    commit, and dropped with a transaction that ends without committing (``close()``)."""
    from ledgerbox.outbox import _writer

    monkeypatch.setattr(_writer, "_unit_of_work_runs", lambda session: True)
    with Session(engine) as session, session.begin():
        WRITER.stage(session, _event(110))
        session.flush()  # nothing else to flush: no after_flush, the rows are kept
    with Session(engine) as session, session.begin():
        WRITER.stage(session, _event(111))
        session.flush()
        WRITER.stage(session, _event(112))
        session.flush()  # 111 is kept again with 112, in that order; the commit writes both
    with Session(engine) as session:
        WRITER.stage(session, _event(113))
        session.flush()
        session.close()  # never committed: dropped
        with session.begin():
            WRITER.stage(session, _event(114))
            session.flush()
    assert _outbox_ids(engine) == ["110", "111", "112", "114"]


def test_a_failed_unit_of_work_drops_the_events_kept_for_after_it(
    engine: Engine, ledger_tables: None
) -> None:
    """The flush's unit of work fails (duplicate primary key): the events kept for after it
    are rolled back with it and never written in the session's next transaction."""
    with Session(engine) as session, session.begin():
        session.add(_Ledger(id=5, balance=0))
    with Session(engine) as session:
        session.add(_Ledger(id=5, balance=0))  # a duplicate: the unit of work fails
        WRITER.stage(session, _event(95))
        with pytest.raises(IntegrityError):
            session.flush()
        session.rollback()
        with session.begin():
            WRITER.stage(session, _event(97))
    assert _outbox_ids(engine) == ["97"]


# -- stage_once_sql / stage_once_params: the event in the caller's own statement -------------


def _place(writer: OutboxWriter, prefix: str = "outbox_") -> sa.TextClause:
    """A business insert that happens only if the event is new, and the event, in ONE
    statement (the pattern of docs/outbox.md, "The event in your own statement")."""
    return sa.text(  # the library's SQL (validated table name, checked prefix)
        f"WITH staged AS ({writer.stage_once_sql(prefix=prefix)}),"  # noqa: S608
        " placed AS (INSERT INTO orders_tmp (id, amount) SELECT :id, :amount FROM staged"
        " RETURNING id) SELECT id FROM placed"
    )


@pytest.fixture
def orders_tmp(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE orders_tmp (id int PRIMARY KEY, amount numeric)"))


def test_stage_once_sql_in_a_cte_stores_what_stage_once_stores(
    engine: Engine, orders_tmp: None
) -> None:
    """Every column as ``stage_once`` binds it (JSON payload and headers, Decimal, aware
    microsecond datetimes, the shard), the business row in the same statement."""
    occurred = dt.datetime(2026, 11, 29, 10, 0, 0, 123456, tzinfo=dt.UTC)
    payload = Money(
        amount=Decimal("100.10"),
        order_id=uuid.UUID("0a8f2c1e-5b7d-4e3f-9a21-7c6d5e4f3a2b"),
        at=dt.datetime(2026, 11, 29, 23, 59, 59, 999999, tzinfo=dt.timezone(dt.timedelta(hours=5))),
    )
    events = [
        WRITER.event(
            event_type="PaymentRequested",
            aggregate_type="payment",
            aggregate_id=f"p{i}",
            aggregate_version=None if i else 3,
            payload=payload,
            idempotency_key=f"cte-{i}",
            occurred_at=occurred,
            headers={"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"},
        )
        for i in range(2)
    ]
    with engine.begin() as conn:
        for i, event in enumerate(events):
            params = {**WRITER.stage_once_params(event), "id": i, "amount": Decimal("1.50")}
            assert conn.execute(_place(WRITER), params).scalar_one() == i
        reference = WRITER.event(
            event_type="PaymentRequested", aggregate_type="payment", aggregate_id="p0",
            aggregate_version=3, payload=payload, idempotency_key="cte-ref",
            occurred_at=occurred, headers={"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"},
        )  # fmt: skip
        assert WRITER.stage_once(conn, reference).created
    with engine.connect() as conn:
        rows = {
            r["idempotency_key"]: r for r in conn.execute(sa.select(TABLE.table)).mappings().all()
        }
        assert conn.execute(sa.text("SELECT count(*) FROM orders_tmp")).scalar_one() == 2
    for event in events:
        row = rows[event.idempotency_key]
        assert envelope_from_row(row) == event
        assert row["shard"] == shard_of(event.partition_key)
        assert row["status"] == EventStatus.PENDING and row["txid"] is not None
    same = ("payload", "headers", "occurred_at", "shard", "topic", "source", "aggregate_version")
    assert {c: rows["cte-0"][c] for c in same} == {c: rows["cte-ref"][c] for c in same}


def test_stage_once_sql_a_known_key_returns_no_row_and_the_business_write_is_skipped(
    engine: Engine, orders_tmp: None
) -> None:
    """A retried request (same idempotency key) inserts nothing: the statement returns no
    row, as ``stage_once`` answers ``created=False``, and ``stage_once`` then gives the event
    stored first. A rolled-back statement leaves nothing behind."""
    key = idempotency_key("order", "c", "cte-retry")
    first, retry = _event(1, key=key), _event(2, key=key)
    with engine.begin() as conn:
        params = {**WRITER.stage_once_params(first), "id": 1, "amount": 1}
        assert conn.execute(_place(WRITER), params).first() is not None
    with engine.begin() as conn:
        params = {**WRITER.stage_once_params(retry), "id": 2, "amount": 2}
        assert conn.execute(_place(WRITER), params).first() is None
        staged = WRITER.stage_once(conn, retry)
        assert not staged.created and staged.event == first
    with engine.connect() as conn:
        conn.execute(_place(WRITER), {**WRITER.stage_once_params(_event(3)), "id": 3, "amount": 3})
        conn.rollback()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id FROM orders_tmp")).scalars().all() == [1]
    assert _count(engine) == 1


def test_stage_once_sql_twins_wait_on_the_key_and_one_statement_wins(
    engine: Engine, orders_tmp: None
) -> None:
    """Two transactions run the statement for one key: the second waits on the unique index
    until the first ends; first commits -> the second gets no row; first rolls back -> the
    second inserts."""
    for first_commits in (True, False):
        key = idempotency_key("order", "twin", str(first_commits))
        a, b = _event(10, key=key), _event(11, key=key)
        base = 100 if first_commits else 200
        with engine.connect() as one, engine.connect() as two:
            params = {**WRITER.stage_once_params(a), "id": base, "amount": 1}
            assert one.execute(_place(WRITER), params).first() is not None
            result: list[object] = []

            def second(
                two: sa.Connection = two,
                b: EventEnvelope = b,
                base: int = base,
                result: list[object] = result,
            ) -> None:
                params = {**WRITER.stage_once_params(b), "id": base + 1, "amount": 1}
                result.append(two.execute(_place(WRITER), params).first())
                two.commit()

            waiter = threading.Thread(target=second)
            waiter.start()
            waiter.join(0.5)
            assert waiter.is_alive(), "the twin must wait for the first transaction"
            if first_commits:
                one.commit()
            else:
                one.rollback()
            waiter.join(10)
            assert not waiter.is_alive()
            assert (result[0] is None) is first_commits
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id FROM orders_tmp ORDER BY id")).scalars().all() == [
            100,
            201,
        ]


def test_stage_once_sql_checks_its_prefix_and_the_payload_before_any_io() -> None:
    from ledgerbox import ConfigurationError

    assert ":evt_event_id" in WRITER.stage_once_sql(prefix="evt_")
    assert set(WRITER.stage_once_params(_event(1), prefix="evt_")) >= {
        "evt_event_id",
        "evt_payload",
    }
    for bad in ("", "1x", "a-b", "x y", "a;"):
        with pytest.raises(ConfigurationError, match="prefix"):
            WRITER.stage_once_sql(prefix=bad)
        with pytest.raises(ConfigurationError, match="prefix"):
            WRITER.stage_once_params(_event(1), prefix=bad)
    small = OutboxWriter(TopicRouter(default="t"), source="/s", max_payload_bytes=10)
    big = small.event(
        event_type="E", aggregate_type="a", aggregate_id=1, payload={"x": "y" * 20},
        idempotency_key="big",
    )  # fmt: skip
    with pytest.raises(PayloadTooLargeError):
        small.stage_once_params(big)


def test_stage_once_sql_names_a_configured_schema_and_table(
    engine: Engine, database_url: str
) -> None:
    names = migrations.Names(schema="ledger", outbox_table="events_out", inbox_table="events_in")
    migrations.upgrade_database(database_url, names)
    writer = OutboxWriter(
        TopicRouter(default="t"), source="/s", table=OutboxTable("events_out", schema="ledger")
    )
    event = writer.event(
        event_type="E", aggregate_type="a", aggregate_id=1, payload={}, idempotency_key="sq"
    )
    with engine.begin() as conn:
        staged = writer.stage_once_sql()
        statement = sa.text(f"WITH staged AS ({staged}) SELECT id FROM staged")  # noqa: S608
        assert conn.execute(statement, writer.stage_once_params(event)).first() is not None
    with engine.connect() as conn:
        assert (
            conn.execute(
                sa.text("SELECT count(*) FROM ledger.events_out WHERE idempotency_key = 'sq'")
            ).scalar_one()
            == 1
        )


def test_stage_once_sql_in_a_cte_wakes_the_waiting_relay_once_after_commit(
    engine: Engine, database_url: str, orders_tmp: None
) -> None:
    """The outbox's NOTIFY trigger fires for the INSERT inside a CTE as for any other: once,
    at COMMIT, never for a rolled-back statement."""
    with psycopg.connect(_notify_conninfo(database_url), autocommit=True) as listener:
        listener.execute(f'LISTEN "{TABLE.notify_channel}"')
        listener.execute("SELECT pg_advisory_lock(%s, %s)", wake_gate_key(TABLE.notify_channel))
        with engine.connect() as conn:
            for i in (1, 2):
                params = {**WRITER.stage_once_params(_event(90 + i)), "id": i, "amount": 1}
                assert conn.execute(_place(WRITER), params).first() is not None
            assert _drain_notifies(listener) == []  # nothing before COMMIT
            conn.commit()
        assert _drain_notifies(listener) == [TABLE.notify_channel]
        with engine.connect() as conn:
            params = {**WRITER.stage_once_params(_event(93)), "id": 3, "amount": 1}
            assert conn.execute(_place(WRITER), params).first() is not None
            conn.rollback()
        assert _drain_notifies(listener) == []
