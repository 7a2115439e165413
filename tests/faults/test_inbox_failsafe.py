"""The inbox consumer fails safe (issue 12): whose fault is it, end to end, on real
PostgreSQL and Kafka. Cases C15 (environment faults), C17 (a dead-lettered event is final),
C18 (retention never removes a row Kafka can still redeliver); each test name carries the
number of the issue's finding it proves.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
import pytest_asyncio
import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer, TopicPartition
from sqlalchemy import Engine, create_engine, make_url
from sqlalchemy.ext.asyncio import AsyncSession

from ledgerbox import ConfigurationError, migrations
from ledgerbox._core.database_url import libpq_url
from ledgerbox.inbox import (
    ConsumerConfig,
    HandlerContext,
    InboxConsumer,
    InboxStatus,
    InboxTable,
    Outcome,
    UnhandledEventError,
)
from ledgerbox.inbox._metrics import HEALTH, UNHANDLED
from ledgerbox.inbox.testing import InMemoryDeadLetterPublisher, record_for
from ledgerbox.outbox import EventEnvelope
from tests._inbox_support import committed, order_event, poll, produce

REPO = Path(__file__).resolve().parents[2]
metadata = sa.MetaData()
payments = sa.Table(
    "fs_payments",
    metadata,
    sa.Column("consumer_group", sa.Text, primary_key=True),
    sa.Column("order_id", sa.Text, primary_key=True),
    sa.Column("amount", sa.Numeric(12, 2), nullable=False),
)


class PaymentDeclined(Exception):
    """A refusal the tests' consumers declare permanent (``dead_letter_on``)."""


def paid(url: str, group: str) -> list[str]:
    eng = create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as conn:
            rows = conn.execute(
                sa.select(payments.c.order_id)
                .where(payments.c.consumer_group == group)
                .order_by(payments.c.order_id)
            ).all()
    finally:
        eng.dispose()
    return [r[0] for r in rows]


def inbox_rows(url: str, group: str) -> list[tuple[uuid.UUID, int, int, str | None]]:
    eng = create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT event_id, status, attempts, last_error FROM inbox "
                    'WHERE consumer_group = :g ORDER BY "offset"'
                ),
                {"g": group},
            ).all()
    finally:
        eng.dispose()
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def execute(url: str, *statements: str, autocommit: bool = False) -> None:
    eng = create_engine(
        url,
        poolclass=sa.pool.NullPool,
        **({"isolation_level": "AUTOCOMMIT"} if autocommit else {}),
    )
    try:
        with eng.begin() as conn:
            for statement in statements:
                conn.execute(sa.text(statement))
    finally:
        eng.dispose()


async def end_offset(bootstrap: str, topic: str) -> int:
    """How many records partition 0 of ``topic`` holds (its end offset)."""
    probe = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await probe.start()
    try:
        tp = TopicPartition(topic, 0)
        return int((await probe.end_offsets([tp]))[tp])
    finally:
        await probe.stop()


def make_consumer(
    url: str, bootstrap: str, topic: str, group: str, dlq: str, **extra: Any
) -> InboxConsumer:
    settings: dict[str, Any] = {
        "commit_interval_ms": 20,
        "retry_base_s": 0.05,
        "retry_max_s": 0.3,
        **extra,
    }
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=url,
            kafka_bootstrap_servers=bootstrap,
            dead_letter_topic=dlq,
            **settings,
        )
    )

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        await ctx.session.execute(
            sa.insert(payments).values(
                consumer_group=ctx.group_id,
                order_id=event.payload["order_id"],
                amount=Decimal(event.payload["amount"]),
            )
        )

    return consumer


@pytest.fixture
def fresh_db(empty_database_url: str) -> str:
    """A database with the business table only: no ledgerbox tables (not migrated)."""
    eng = create_engine(empty_database_url, poolclass=sa.pool.NullPool)
    try:
        metadata.create_all(eng)
    finally:
        eng.dispose()
    return empty_database_url


@pytest.fixture
def migrated_db(fresh_db: str) -> str:
    migrations.upgrade_database(fresh_db)
    return fresh_db


@pytest.fixture
def app_role(migrated_db: str) -> Iterator[tuple[str, str]]:
    """A login role that is not a superuser, with the grants a consumer needs; yields
    ``(role, database url as that role)``."""
    role = f"fs_app_{uuid.uuid4().hex[:8]}"
    database = make_url(migrated_db).database
    execute(
        migrated_db,
        f"CREATE ROLE {role} LOGIN PASSWORD 'app-secret'",
        f"GRANT SELECT, INSERT, UPDATE ON inbox, fs_payments TO {role}",
        f"GRANT SELECT ON ledgerbox_alembic_version TO {role}",
    )
    url = make_url(migrated_db).set(username=role, password="app-secret")
    try:
        yield role, url.render_as_string(hide_password=False)
    finally:
        execute(
            migrated_db,
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'",  # noqa: S608 (a generated role name)
            f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}",
            f'REVOKE ALL ON DATABASE "{database}" FROM {role}',
        )
        execute(migrated_db, f"DROP ROLE {role}")


@pytest_asyncio.fixture
async def running() -> AsyncIterator[Callable[[InboxConsumer], asyncio.Task[None]]]:
    started: list[tuple[InboxConsumer, asyncio.Task[None]]] = []

    def start(consumer: InboxConsumer) -> asyncio.Task[None]:
        task = asyncio.create_task(consumer.run())
        started.append((consumer, task))
        return task

    yield start
    for consumer, _task in started:
        consumer.stop()
    for _consumer, task in started:
        await asyncio.wait_for(task, 60)


async def until(check: Callable[[], bool], what: str, within_s: float = 60) -> None:
    async def check_async() -> bool:
        return check()

    await poll(check_async, what, within_s)


# --------------------------------------------------------------------------- 1 (C15)


async def _c15(
    url: str,
    bootstrap: str,
    new_topic: Any,
    running: Any,
    caplog: pytest.LogCaptureFixture,
    *,
    break_it: Callable[[], Awaitable[None] | None],
    fix_it: Callable[[], Awaitable[None] | None],
    cause: str,
    started_broken: bool = False,
    consumer_url: str | None = None,
    consumer_settings: dict[str, Any] | None = None,
) -> None:
    """The C15 scenario: 50 records wait while the environment is broken; nothing is
    dead-lettered or committed past an unapplied record, health is down naming ``cause``;
    after ``fix_it`` all 50 are applied once, without a restart."""
    topic = await new_topic.acreate("fs-c15", partitions=1)
    dlq = await new_topic.acreate("fs-c15-dlq", partitions=1)
    group = f"c15-{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.INFO, logger="ledgerbox.inbox")
    consumer = make_consumer(
        consumer_url or url, bootstrap, topic, group, dlq, **(consumer_settings or {})
    )
    warm = 0
    if started_broken:
        result = break_it()
        if result is not None:
            await result
        task = running(consumer)
    else:
        task = running(consumer)
        # Warm up: the consumer runs, its pool holds connections, its statements are prepared.
        await produce(bootstrap, topic, [order_event(topic, f"w{i}", "1.00") for i in range(6)])
        warm = 6
        await until(lambda: len(paid(url, group)) == 6, "the warm-up records applied")
        assert consumer.health() == "ok"
        result = break_it()
        if result is not None:
            await result
    events = [order_event(topic, f"o{i:02d}", "2.50") for i in range(50)]
    await produce(bootstrap, topic, events)

    def down() -> bool:
        assert not task.done(), task
        return consumer.health() == "down"

    await until(down, "health down")
    await asyncio.sleep(2.0)  # the fault lasts: the consumer keeps retrying meanwhile
    assert consumer.health() == "down"
    assert consumer.health_cause is not None and cause in consumer.health_cause, (
        consumer.health_cause
    )
    assert len(consumer.health_cause.splitlines()) == 1
    assert HEALTH.labels(group)._value.get() == 2
    offset = await committed(bootstrap, group, topic)
    assert offset is None or offset <= warm  # nothing committed past an unapplied record
    assert len(paid(url, group)) == warm
    assert await end_offset(bootstrap, dlq) == 0

    result = fix_it()
    if result is not None:
        await result

    async def caught_up() -> bool:
        assert not task.done(), task
        return await committed(bootstrap, group, topic) == warm + 50

    await poll(caught_up, "all 50 records applied after the fix", within_s=90)
    expected = sorted([f"w{i}" for i in range(warm)] + [e.payload["order_id"] for e in events])
    assert paid(url, group) == expected  # each exactly once (primary key)
    rows = inbox_rows(url, group)
    assert {e.event_id for e in events} <= {r[0] for r in rows}  # (the drop lost the warm-up's)
    assert {r[1] for r in rows} == {InboxStatus.DONE}
    assert await end_offset(bootstrap, dlq) == 0
    assert consumer.health() == "ok" and consumer.health_cause is None
    assert HEALTH.labels(group)._value.get() == 0
    messages = [r.getMessage() for r in caplog.records if group in r.getMessage()]
    assert len([m for m in messages if " down: " in m]) == 1, messages  # one per change
    assert len([m for m in messages if "up again" in m]) == 1, messages


async def test_failsafe_01_c15_inbox_table_dropped_stops_and_resumes_after_migrate(
    migrated_db: str,
    kafka_bootstrap: str,
    new_topic: Any,
    running: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def drop() -> None:
        # Every ledgerbox table vanishes under a running consumer (a restore without them):
        # the list comes from the models, so a table a later revision adds is dropped too.
        tables = [t.name for t in migrations.target_metadata(migrations.Names()).sorted_tables]
        execute(migrated_db, f"DROP TABLE {', '.join([*tables, migrations.VERSION_TABLE])}")

    await _c15(
        migrated_db,
        kafka_bootstrap,
        new_topic,
        running,
        caplog,
        break_it=drop,
        fix_it=lambda: migrations.upgrade_database(migrated_db),
        cause='relation "inbox" does not exist',
    )


async def test_failsafe_01_c15_started_on_an_unmigrated_database_waits_for_migrate(
    fresh_db: str,
    kafka_bootstrap: str,
    new_topic: Any,
    running: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    database = make_url(fresh_db).database
    await _c15(
        fresh_db,
        kafka_bootstrap,
        new_topic,
        running,
        caplog,
        started_broken=True,
        break_it=lambda: None,
        fix_it=lambda: migrations.upgrade_database(fresh_db),
        cause=f'inbox table "inbox" does not exist in database "{database}": run ledgerbox migrate',
    )


async def test_failsafe_01_c15_revoked_grant_on_the_business_table(
    migrated_db: str,
    app_role: tuple[str, str],
    kafka_bootstrap: str,
    new_topic: Any,
    running: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    role, role_url = app_role
    await _c15(
        migrated_db,
        kafka_bootstrap,
        new_topic,
        running,
        caplog,
        consumer_url=role_url,
        break_it=lambda: execute(migrated_db, f"REVOKE INSERT ON fs_payments FROM {role}"),
        fix_it=lambda: execute(migrated_db, f"GRANT INSERT ON fs_payments TO {role}"),
        cause="permission denied for table fs_payments",
    )


async def test_failsafe_01_c15_database_turned_read_only(
    migrated_db: str,
    kafka_bootstrap: str,
    new_topic: Any,
    running: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    database = make_url(migrated_db).database
    others = f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{database}' AND pid <> pg_backend_pid()"  # noqa: E501, S608 (the test's database)

    def read_only() -> None:
        # A failover onto a read-only node: new connections are read-only, old ones drop.
        execute(
            migrated_db,
            f'ALTER DATABASE "{database}" SET default_transaction_read_only = on',
            autocommit=True,
        )
        execute(migrated_db, others)

    def writable() -> None:
        # Only the setting is reset: the consumer's read-only connections stay open.
        execute(
            migrated_db,
            "SET default_transaction_read_only = off",  # this session only
            f'ALTER DATABASE "{database}" RESET default_transaction_read_only',
            autocommit=True,
        )

    await _c15(
        migrated_db,
        kafka_bootstrap,
        new_topic,
        running,
        caplog,
        break_it=read_only,
        fix_it=writable,
        cause="read-only transaction",
    )


@pytest.mark.parametrize("lock_timeout", [None, "300ms"], ids=["stall-check", "lock-timeout"])
async def test_failsafe_01_c15_a_lock_another_session_holds(
    migrated_db: str,
    kafka_bootstrap: str,
    new_topic: Any,
    running: Any,
    caplog: pytest.LogCaptureFixture,
    lock_timeout: str | None,
) -> None:
    """A session holds a lock the handler's write needs and stays idle in its transaction
    (someone's psql, a migration waiting for its turn). Health goes ``down`` naming the
    partition and the lock, nothing is dead-lettered, nothing committed past the record;
    the lock released, all applied once. Without a ``lock_timeout`` the batch waits and the
    stall check (``stalled_after_s``) reports it (before: health stayed ``ok`` for as long
    as the lock was held); with the user's ``lock_timeout`` (URL ``options``) the wait is
    cancelled and retried, and the cause says what ran out."""
    blocker = psycopg.connect(libpq_url(migrated_db), autocommit=False)
    consumer_url = migrated_db
    if lock_timeout is not None:
        options = {"options": f"-c lock_timeout={lock_timeout}"}
        consumer_url = (
            make_url(migrated_db).update_query_dict(options).render_as_string(hide_password=False)
        )
    try:

        def lock() -> None:
            blocker.execute("LOCK TABLE fs_payments IN SHARE MODE")  # blocks INSERTs

        await _c15(
            migrated_db,
            kafka_bootstrap,
            new_topic,
            running,
            caplog,
            consumer_url=consumer_url,
            consumer_settings={"stalled_after_s": 1.0},
            break_it=lock,
            fix_it=blocker.rollback,
            cause=(
                "a batch has been running for"
                if lock_timeout is None
                else "lock timeout (the lock_timeout ran out: another transaction holds a lock"
            ),
        )
    finally:
        blocker.close()


def test_stalled_after_s_is_checked() -> None:
    url = "postgresql+psycopg://u:p@127.0.0.1:5433/x"
    assert make_consumer(url, "127.0.0.1:9", "t", "g", "t.dlq").config.stalled_after_s == 30.0
    for bad in (0, -1.0, float("nan"), float("inf"), "soon"):
        with pytest.raises(ConfigurationError, match="stalled_after_s"):
            make_consumer(url, "127.0.0.1:9", "t", "g", "t.dlq", stalled_after_s=bad)
    assert (
        make_consumer(url, "h:9", "t", "g", "d", stalled_after_s=None).config.stalled_after_s
        is None
    )


class DroppingPublisher(InMemoryDeadLetterPublisher):
    """Stores the record, then drops the inbox table: the inbox update that follows the
    dead-letter send meets a missing table."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url

    async def publish(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Any
    ) -> None:
        await super().publish(topic, key, value, headers)
        if len(self.records) == 1:
            await asyncio.to_thread(execute, self.url, "DROP TABLE inbox")


async def test_failsafe_01_dead_letter_path_waits_for_a_missing_inbox_table(
    migrated_db: str, kafka_bootstrap: str
) -> None:
    group = f"fs-dl-{uuid.uuid4().hex[:8]}"
    parked = DroppingPublisher(migrated_db)
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=["orders"],
            database_url=migrated_db,
            kafka_bootstrap_servers=kafka_bootstrap,
            retry_base_s=0.001,
            retry_max_s=0.001,  # before: 1000 quick retries, then the offset could move
            dead_letter_on=(PaymentDeclined,),
        ),
        dead_letters=parked,
    )

    @consumer.handler("OrderPlaced")
    async def decline(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        raise PaymentDeclined("card refused for good")

    event = order_event("orders", "d1")
    try:
        task = asyncio.create_task(consumer.process_record(record_for(event, offset=4)))
        await until(lambda: consumer.health() == "down", "health down on the inbox update")
        await asyncio.sleep(4.0)
        assert not task.done()  # the offset may not move: the row does not say DEAD_LETTERED
        assert consumer.health_cause is not None
        assert 'relation "inbox" does not exist' in consumer.health_cause
        eng = create_engine(migrated_db, poolclass=sa.pool.NullPool)
        try:
            InboxTable().table.create(eng)
        finally:
            eng.dispose()
        assert await asyncio.wait_for(task, 30) is Outcome.DEAD_LETTERED
    finally:
        await consumer.aclose()
    assert consumer.health() == "ok"
    [(event_id, status, _attempts, error)] = inbox_rows(migrated_db, group)
    assert (event_id, status) == (event.event_id, InboxStatus.DEAD_LETTERED)
    assert error is not None and "PaymentDeclined" in error
    assert len(parked.records) == 1


# --------------------------------------------------------------------------- 4


async def test_failsafe_04_runtime_error_is_retried_then_dead_lettered_unless_declared(
    database_url: str, engine: Engine, kafka_bootstrap: str
) -> None:
    metadata.create_all(engine)
    calls: dict[str, list[int]] = {}

    def consumer_with(**extra: Any) -> InboxConsumer:
        consumer = InboxConsumer(
            ConsumerConfig(
                group_id=f"fs4-{uuid.uuid4().hex[:8]}",
                topics=["orders"],
                database_url=database_url,
                kafka_bootstrap_servers=kafka_bootstrap,
                max_attempts=3,
                retry_base_s=0.01,
                retry_max_s=0.02,
                **extra,
            ),
            dead_letters=InMemoryDeadLetterPublisher(),
        )

        @consumer.handler("OrderPlaced")
        async def flaky(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
            calls.setdefault(event.payload["order_id"], []).append(ctx.attempt)
            if event.payload["order_id"] == "declined":
                raise PaymentDeclined("declined")
            if ctx.attempt < 3:
                raise RuntimeError("gateway hiccup")

        return consumer

    default = consumer_with()
    declared = consumer_with(dead_letter_on=(PaymentDeclined,), retry_on=(KeyError,))
    try:
        flaky = record_for(order_event("orders", "flaky"))
        assert await default.process_record(flaky) is Outcome.APPLIED
        declined = record_for(order_event("orders", "declined"), offset=1)
        assert await declared.process_record(declined) is Outcome.DEAD_LETTERED
    finally:
        await default.aclose()
        await declared.aclose()
    assert calls["flaky"] == [1, 2, 3]  # before: dead-lettered after attempt 1
    assert calls["declined"] == [1]  # declared permanent: one attempt


# --------------------------------------------------------------------------- 5


async def test_failsafe_05_unhandled_types_are_counted_warned_once_and_follow_on_unhandled(
    database_url: str, kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ledgerbox.inbox")

    def consumer_with(mode: str) -> tuple[InboxConsumer, InMemoryDeadLetterPublisher]:
        parked = InMemoryDeadLetterPublisher()
        consumer = InboxConsumer(
            ConsumerConfig(
                group_id=f"fs5-{mode}-{uuid.uuid4().hex[:8]}",
                topics=["orders"],
                database_url=database_url,
                kafka_bootstrap_servers=kafka_bootstrap,
                on_unhandled=mode,  # type: ignore[arg-type]
                retry_base_s=0.01,
                retry_max_s=0.05,
            ),
            dead_letters=parked,
        )
        return consumer, parked

    shipped = [order_event("orders", f"s{i}", kind="OrderShiped") for i in range(3)]  # typo
    ignore, _ = consumer_with("ignore")
    dead, parked = consumer_with("dead_letter")
    fail, _ = consumer_with("fail")
    try:
        outcomes = [
            await ignore.process_record(record_for(e, offset=i)) for i, e in enumerate(shipped)
        ]
        assert outcomes == [Outcome.IGNORED] * 3
        assert UNHANDLED.labels(ignore.group_id, "OrderShiped")._value.get() == 3
        warnings = [r for r in caplog.records if ignore.group_id in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        assert "OrderShiped" in warnings[0].getMessage()

        first = record_for(shipped[0], offset=0)
        assert await dead.process_record(first) is Outcome.DEAD_LETTERED
        copy = record_for(shipped[0], offset=7)  # a redelivery: final, no second record
        assert await dead.process_record(copy) is Outcome.ALREADY_DEAD_LETTERED
        [(_topic, _key, _value, headers)] = parked.records
        error_type = dict(headers)["ledgerbox_error_type"]
        assert error_type == f"ledgerbox.inbox.{UnhandledEventError.__qualname__}".encode()

        task = asyncio.create_task(fail.process_record(record_for(shipped[1], offset=1)))
        await until(lambda: fail.health() == "down", "health down for the unhandled type")
        assert fail.health_cause is not None and "'OrderShiped'" in fail.health_cause
        await asyncio.sleep(0.5)
        assert not task.done()  # the partition waits; nothing is acknowledged

        @fail.handler("OrderShiped")
        async def ship(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
            return None

        assert await asyncio.wait_for(task, 30) is Outcome.APPLIED
        assert fail.health() == "ok"
    finally:
        for consumer in (ignore, dead, fail):
            await consumer.aclose()


# --------------------------------------------------------------------------- 6


def app_from_env() -> InboxConsumer:
    """Factory for `python -m ledgerbox.inbox run|purge --app ...` in a subprocess.

    ``FS_BLOCK_ORDER`` (an order id) makes the handler block on that order, writing
    ``FS_BLOCK_MARKER`` first; ``FS_CALLS`` (a file) gets one line per handler call;
    ``FS_STALL_MARKER`` makes the process stall after each database commit (C18).
    """
    env = os.environ
    calls = env.get("FS_CALLS")
    settings: dict[str, Any] = {}
    for name in ("retention_s", "offset_retention_s"):
        if f"FS_{name.upper()}" in env:
            settings[name] = float(env[f"FS_{name.upper()}"])
    if "FS_AUTO_OFFSET_RESET" in env:
        settings["auto_offset_reset"] = env["FS_AUTO_OFFSET_RESET"]
    hooks = None
    if env.get("FS_STALL_MARKER"):
        from tests.integration.test_inbox_consumer import stall_after_db_commit

        marker = Path(env["FS_STALL_MARKER"])
        stall_on = env["FS_STALL_ON"]
        stall = stall_after_db_commit(marker)

        async def maybe_stall(event_ids: list[uuid.UUID]) -> None:
            if stall_on in {str(e) for e in event_ids}:
                assert stall.after_db_commit is not None
                await stall.after_db_commit(event_ids)

        from ledgerbox.inbox._handlers import ConsumerHooks

        hooks = ConsumerHooks(after_db_commit=maybe_stall)
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=env["FS_GROUP"],
            topics=[env["FS_TOPIC"]],
            database_url=env["FS_DATABASE_URL"],
            kafka_bootstrap_servers=env["KAFKA_BOOTSTRAP_SERVERS"],
            dead_letter_topic=env.get("FS_DLQ") or None,
            dead_letter_on=(PaymentDeclined,),
            commit_interval_ms=20,
            **settings,
        ),
        hooks=hooks,
    )

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        order = event.payload["order_id"]
        if calls:
            await asyncio.to_thread(_append, Path(calls), f"{order}\n")
        if order == env.get("FS_DECLINE_ORDER"):
            raise PaymentDeclined(f"order {order} declined for good")
        if order == env.get("FS_BLOCK_ORDER"):
            await asyncio.to_thread(Path(env["FS_BLOCK_MARKER"]).write_text, "in handler")
            await asyncio.Event().wait()  # until the test kills this process
        await ctx.session.execute(
            sa.insert(payments).values(
                consumer_group=ctx.group_id, order_id=order, amount=Decimal(event.payload["amount"])
            )
        )

    return consumer


def _append(path: Path, text: str) -> None:
    with path.open("a", encoding="utf-8") as out:
        out.write(text)


def cli(command: str, env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ledgerbox.inbox",
                command,
                "--app",
                "tests.faults.test_inbox_failsafe:app_from_env",
                *args,
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def said(log: Path) -> list[str]:
    """What a CLI run printed, less the INFO log lines of the test module's imports."""
    return [
        line
        for line in log.read_text().splitlines()
        if line.strip() and " INFO alembic" not in line
    ]


def base_env(url: str, bootstrap: str, topic: str, group: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEDGERBOX_", "FS_"))}
    env.update(
        FS_DATABASE_URL=url, KAFKA_BOOTSTRAP_SERVERS=bootstrap, FS_TOPIC=topic, FS_GROUP=group
    )
    return env


async def test_failsafe_06_run_waits_for_unreachable_kafka_in_one_line(
    database_url: str, engine: Engine, tmp_path: Path
) -> None:
    metadata.create_all(engine)
    env = base_env(database_url, f"127.0.0.1:{free_port()}", "fs6", f"fs6-{uuid.uuid4().hex[:6]}")
    log = tmp_path / "run.log"
    proc = cli("run", env, log)
    try:
        await asyncio.sleep(8)
        assert proc.poll() is None, log.read_text()  # still waiting, not crashed
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 60)
    text = log.read_text()
    assert code == 0, text
    assert "Traceback" not in text, text
    down = [line for line in text.splitlines() if " down: " in line]
    assert len(down) == 1 and "Kafka is unreachable at 127.0.0.1:" in down[0], text
    assert "up again" not in text  # stopped while waiting: not fixed
    assert "ERROR aiokafka" not in text  # no client line per refused connection


async def test_failsafe_06_refusals_are_one_line_without_a_traceback(
    database_url: str, engine: Engine, kafka_bootstrap: str, tmp_path: Path
) -> None:
    metadata.create_all(engine)
    group = f"fs6b-{uuid.uuid4().hex[:6]}"
    wrong = make_url(database_url).set(password="not-the-password")
    env = base_env(wrong.render_as_string(hide_password=False), kafka_bootstrap, "fs6", group)
    log = tmp_path / "run.log"
    proc = cli("run", env, log)
    code = await asyncio.to_thread(proc.wait, 60)
    lines = said(log)
    assert code == 2 and "Traceback" not in log.read_text(), log.read_text()
    assert len(lines) == 1, lines
    assert lines[0].startswith("ledgerbox consumer run: the database server at "), lines
    assert "refused the login" in lines[0] and "not-the-password" not in lines[0]
    assert lines[0].endswith("fix the user, the password or the database name of database_url")

    env = base_env(database_url, kafka_bootstrap, "fs6", group)
    log = tmp_path / "purge.log"
    proc = cli("purge", env, log, "--older-than-s", "60")
    code = await asyncio.to_thread(proc.wait, 60)
    lines = said(log)
    assert code == 2 and "Traceback" not in log.read_text(), log.read_text()
    assert len(lines) == 1 and "inside the dedup window" in lines[0], lines


class LateProxy:
    """A TCP port that refuses connections until :meth:`open`, then forwards to ``target``
    (``host:port``): Kafka unreachable at the start, reachable later."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.port = free_port()
        self.server: asyncio.Server | None = None

    async def open(self) -> None:
        self.server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))

    async def aclose(self) -> None:
        if self.server is not None:
            self.server.close()


async def test_failsafe_06_kafka_unreachable_at_start_then_reachable_resumes(
    database_url: str,
    engine: Engine,
    kafka_bootstrap: str,
    new_topic: Any,
    running: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    metadata.create_all(engine)
    caplog.set_level(logging.INFO, logger="ledgerbox.inbox")
    topic = await new_topic.acreate("fs6c", partitions=1)
    group = f"fs6c-{uuid.uuid4().hex[:6]}"
    await produce(kafka_bootstrap, topic, [order_event(topic, f"k{i}") for i in range(3)])
    proxy = LateProxy(kafka_bootstrap.split(",")[0])
    consumer = make_consumer(database_url, f"127.0.0.1:{proxy.port}", topic, group, f"{topic}.dlq")
    try:
        task = running(consumer)

        def down() -> bool:
            assert not task.done(), task
            return consumer.health() == "down"

        await until(down, "health down while Kafka does not answer")
        assert consumer.health_cause is not None and "kafka" in consumer.health_cause
        await asyncio.sleep(2)
        await proxy.open()  # the broker answers now (the bootstrap address did not change)

        async def caught_up() -> bool:
            assert not task.done(), task
            return await committed(kafka_bootstrap, group, topic) == 3

        await poll(caught_up, "the 3 records applied once Kafka answers", within_s=90)
        assert paid(database_url, group) == ["k0", "k1", "k2"]
        assert consumer.health() == "ok"
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 60)
        await proxy.aclose()
    messages = [r.getMessage() for r in caplog.records if group in r.getMessage()]
    assert len([m for m in messages if " down: " in m]) == 1, messages


# --------------------------------------------------------------------------- 9 (C18)


async def test_failsafe_09_c18_purge_keeps_the_row_of_an_uncommitted_record(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any, tmp_path: Path
) -> None:
    metadata.create_all(engine)
    topic = await new_topic.acreate("fs-c18", partitions=1)
    group = f"c18-{uuid.uuid4().hex[:8]}"
    e1 = order_event(topic, "E1", "42.00")
    marker = tmp_path / "stalled"
    env = base_env(database_url, kafka_bootstrap, topic, group)
    # The shortest dedup window the configuration accepts: the offset horizon, 1 s here.
    env.update(
        FS_RETENTION_S="1",
        FS_OFFSET_RETENTION_S="1",
        FS_AUTO_OFFSET_RESET="latest",
        FS_STALL_MARKER=str(marker),
        FS_STALL_ON=str(e1.event_id),
    )
    log = tmp_path / "consumer.log"
    first = cli("run", env, log)
    try:
        # "latest": records count from when the consumer got the partition; E0 until then.
        e0 = order_event(topic, "E0", "1.00")

        async def e0_committed() -> bool:
            assert first.poll() is None, log.read_text()
            if "E0" not in paid(database_url, group):
                await produce(kafka_bootstrap, topic, [e0])
                await asyncio.sleep(0.5)
                return False
            end = await end_offset(kafka_bootstrap, topic)
            return await committed(kafka_bootstrap, group, topic) == end

        await poll(e0_committed, "E0 applied and committed", within_s=90)
        await produce(kafka_bootstrap, topic, [e1])

        async def stalled() -> bool:
            assert first.poll() is None, log.read_text()
            return marker.exists() and marker.read_text().endswith("\n")

        await poll(stalled, "the consumer to stall after E1's DB commit")
        first.send_signal(signal.SIGKILL)  # between E1's DB commit and its offset commit
        await asyncio.to_thread(first.wait, 30)
    finally:
        if first.poll() is None:
            first.kill()
    assert paid(database_url, group) == ["E0", "E1"]
    e1_offset = await end_offset(kafka_bootstrap, topic) - 1
    assert await committed(kafka_bootstrap, group, topic) == e1_offset

    await asyncio.sleep(1.5)  # both rows are older than the dedup window now
    purge_env = {k: v for k, v in env.items() if k not in ("FS_STALL_MARKER", "FS_STALL_ON")}
    purge = cli("purge", purge_env, tmp_path / "purge.log")
    assert await asyncio.to_thread(purge.wait, 60) == 0, (tmp_path / "purge.log").read_text()
    assert "deleted 1 inbox rows" in (tmp_path / "purge.log").read_text()  # E0's row only
    assert [r[0] for r in inbox_rows(database_url, group)] == [e1.event_id]

    second = cli("run", purge_env, log)
    try:

        async def caught_up() -> bool:
            assert second.poll() is None, log.read_text()
            return await committed(kafka_bootstrap, group, topic) == e1_offset + 1

        await poll(caught_up, "the restarted consumer to commit the redelivered E1")
    finally:
        second.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(second.wait, 60) == 0, log.read_text()
    assert paid(database_url, group) == ["E0", "E1"]  # E1's effect exists once


# --------------------------------------------------------------------------- 10 (C17)


async def test_failsafe_10_c17_dead_lettered_event_stays_final_after_a_kill(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any, tmp_path: Path
) -> None:
    metadata.create_all(engine)
    topic = await new_topic.acreate("fs-c17", partitions=1)
    dlq = await new_topic.acreate("fs-c17-dlq", partitions=1)
    group = f"c17-{uuid.uuid4().hex[:8]}"
    e1, e2 = order_event(topic, "D1"), order_event(topic, "D2")
    await produce(kafka_bootstrap, topic, [e1, e2])
    calls, block = tmp_path / "calls", tmp_path / "in-handler"
    env = base_env(database_url, kafka_bootstrap, topic, group)
    env.update(
        FS_DLQ=dlq,
        FS_CALLS=str(calls),
        FS_DECLINE_ORDER="D1",
        FS_BLOCK_ORDER="D2",
        FS_BLOCK_MARKER=str(block),
    )
    log = tmp_path / "consumer.log"
    first = cli("run", env, log)
    try:

        async def in_d2() -> bool:
            assert first.poll() is None, log.read_text()
            return block.exists()

        # D1 is dead-lettered, then D2's handler holds the batch: no offset is committed.
        await poll(in_d2, "D1 dead-lettered and the consumer inside D2's handler")
        first.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.wait, 30)
    finally:
        if first.poll() is None:
            first.kill()
    assert await committed(kafka_bootstrap, group, topic) is None
    assert await end_offset(kafka_bootstrap, dlq) == 1
    d1_calls = calls.read_text().split().count("D1")

    env.pop("FS_BLOCK_ORDER")
    second = cli("run", env, log)
    try:

        async def caught_up() -> bool:
            assert second.poll() is None, log.read_text()
            return await committed(kafka_bootstrap, group, topic) == 2

        await poll(caught_up, "the restarted consumer to commit both records")
    finally:
        second.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(second.wait, 60) == 0, log.read_text()
    assert calls.read_text().split().count("D1") == d1_calls  # the handler did not run again
    assert await end_offset(kafka_bootstrap, dlq) == 1  # exactly one dead-letter record
    rows = {r[0]: r for r in inbox_rows(database_url, group)}
    assert rows[e1.event_id][1] == InboxStatus.DEAD_LETTERED
    assert rows[e1.event_id][3] is not None and "PaymentDeclined" in rows[e1.event_id][3]
    assert paid(database_url, group) == ["D2"]


async def test_failsafe_10_c17_a_copy_of_a_dead_lettered_event_is_acknowledged(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any, running: Any
) -> None:
    metadata.create_all(engine)
    topic = await new_topic.acreate("fs-c17b", partitions=1)
    dlq = await new_topic.acreate("fs-c17b-dlq", partitions=1)
    group = f"c17b-{uuid.uuid4().hex[:8]}"
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=database_url,
            kafka_bootstrap_servers=kafka_bootstrap,
            dead_letter_topic=dlq,
            dead_letter_on=(PaymentDeclined,),
            commit_interval_ms=20,
        )
    )
    calls: list[str] = []

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        calls.append(event.payload["order_id"])
        if event.payload["order_id"] == "D1":
            raise PaymentDeclined("declined for good")
        await ctx.session.execute(
            sa.insert(payments).values(
                consumer_group=group, order_id=event.payload["order_id"], amount=1
            )
        )

    e1 = order_event(topic, "D1")
    await produce(kafka_bootstrap, topic, [e1])
    task = running(consumer)

    async def at(offset: int) -> bool:
        assert not task.done(), task
        return await committed(kafka_bootstrap, group, topic) == offset

    await poll(lambda: at(1), "D1 dead-lettered and committed")
    assert calls == ["D1"] and await end_offset(kafka_bootstrap, dlq) == 1
    # The relay emits a second copy after a confirmation timeout: same event id, new offset.
    await produce(kafka_bootstrap, topic, [e1, order_event(topic, "D3")])
    await poll(lambda: at(3), "the copy and D3 committed")
    assert calls.count("D1") == 1  # the handler did not run for the copy
    assert await end_offset(kafka_bootstrap, dlq) == 1  # exactly one dead-letter record
    [(_event_id, status, _attempts, _error)] = [
        r for r in inbox_rows(database_url, group) if r[0] == e1.event_id
    ]
    assert status == InboxStatus.DEAD_LETTERED
    assert paid(database_url, group) == ["D3"]
