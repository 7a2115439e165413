"""Least privilege (docs/security.md, "Least privilege"): the roles of the doc, created from its
own SQL, run the real daemons: the app role writes events, the relay role publishes them and
cleans up, the consumer role applies them; each role is refused what it does not need, and a
missing grant is named by `relay check` / `consumer check`."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ledgerbox.outbox import EventEnvelope, OutboxWriter, TopicRouter
from tests._roles import Roles, doc_roles, execute
from tests._services import TopicFactory
from tests.security import _support as s

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def roles(database_url: str, engine: Engine) -> Iterator[Roles]:
    s.metadata.create_all(engine)
    with doc_roles(database_url) as made:
        # The consumer's own business table: the user grants it (the doc says so).
        execute(
            database_url, f"GRANT SELECT, INSERT, UPDATE ON sec_orders TO {made.names['consumer']}"
        )
        yield made


def _order_event(writer: OutboxWriter, kind: str, order: str) -> EventEnvelope:
    return writer.event(
        event_type=kind,
        aggregate_type="order",
        aggregate_id=order,
        payload={"order_id": order, "amount": "10.00"},
        idempotency_key=f"{order}:{kind}",
    )


def _stage(url: str, topic: str, orders: list[tuple[str, str]]) -> None:
    """Stage ``(event type, order id)`` events as the application does, under ``url``'s role:
    ``stage`` for all, ``stage_once`` once more for the first (a duplicate, read back)."""
    writer = OutboxWriter(TopicRouter(default=topic), source="/roles-test")
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    events = [_order_event(writer, kind, order) for kind, order in orders]
    try:
        with Session(engine) as session, session.begin():
            for event in events:
                writer.stage(session, event)
        with Session(engine) as session, session.begin():
            again = writer.stage_once(session, events[0])
        assert not again.created and again.event.event_id == events[0].event_id
    finally:
        engine.dispose()


def _count(url: str, sql: str) -> int:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(sql)).scalar_one())
    finally:
        engine.dispose()


async def _until(check: object, what: str, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {what}")
        await asyncio.sleep(0.3)


async def test_the_daemons_run_under_the_doc_roles(
    roles: Roles,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: TopicFactory,
    tmp_path: Path,
) -> None:
    topic = await new_topic.acreate("roles", partitions=2)
    dlq = await new_topic.acreate("roles-dlq", partitions=1)
    group = f"roles-{uuid.uuid4().hex[:6]}"
    _stage(
        roles.urls["app"],
        topic,
        [("OrderPlaced", "o1"), ("OrderPlaced", "o2"), ("OrderRejected", "o3")],
    )
    relay_env = s.clean_env(
        DATABASE_URL=roles.urls["relay"],
        KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
        LEDGERBOX_RELAY_LEASE_TTL_S="3",
        LEDGERBOX_RELAY_HEARTBEAT_INTERVAL_S="0.5",
        LEDGERBOX_RELAY_POLL_INTERVAL_S="0.2",
        LEDGERBOX_RELAY_RETENTION_S="0",  # the leader deletes published rows: DELETE is used
        LEDGERBOX_RELAY_CLEANUP_INTERVAL_S="0.5",
    )
    code, out = await asyncio.to_thread(s.run, ["relay", "check"], relay_env)
    assert code == 0 and out.startswith("relay ok: database ok"), out
    consumer_env = s.clean_env(
        KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
        SEC_GROUP=group,
        SEC_TOPIC=topic,
        SEC_DLQ=dlq,
        SEC_DATABASE_URL=roles.urls["consumer"],
    )
    app = ["--app", "tests.security._support:consumer_from_env"]
    code, out = await asyncio.to_thread(s.run, ["consumer", "check", *app], consumer_env)
    lines = out.strip().splitlines()
    assert (code, lines[0]) == (0, "ok"), out
    # Then the group's lag, readable under the consumer's role (nothing consumed yet).
    assert lines[-1] == f"lag of group {group}: 0 records", out
    relay_log, consumer_log = tmp_path / "relay.log", tmp_path / "consumer.log"
    relay = s.start(["relay", "run"], relay_env, relay_log)
    consumer = s.start(["consumer", "run", *app], consumer_env, consumer_log)
    try:
        admin = database_url
        await _until(
            lambda: (
                _count(admin, "SELECT count(*) FROM sec_orders") == 2
                and _count(admin, "SELECT count(*) FROM inbox") == 3
            ),
            "orders applied and the rejected one dead-lettered",
        )
        # Published rows deleted by the relay's role (retention 0).
        await _until(lambda: _count(admin, "SELECT count(*) FROM outbox") == 0, "cleanup")
        records = await s.read_topic(
            s.KafkaSettings(bootstrap_servers=kafka_bootstrap), dlq, want=1
        )
        assert [dict(r.headers)["ledgerbox_error_type"] for r in records] == [
            b"tests.security._support.OrderRejected"
        ]
    finally:
        codes = (s.stop(relay), s.stop(consumer))
    logs = relay_log.read_text() + consumer_log.read_text()
    assert codes == (0, 0), logs
    assert "Traceback" not in logs and "permission denied" not in logs, logs


@pytest.mark.parametrize(
    ("role", "statement"),
    [
        ("app", "UPDATE outbox SET status = 1"),
        ("app", "DELETE FROM outbox"),
        ("app", "SELECT count(*) FROM inbox"),
        ("app", "UPDATE outbox_relay_lease SET owner = 'me'"),
        ("relay", "DELETE FROM outbox_relay_lease"),
        ("relay", "SELECT count(*) FROM inbox"),
        ("relay", "TRUNCATE outbox"),
        ("consumer", "SELECT count(*) FROM outbox"),
        ("consumer", "UPDATE outbox_relay_lease SET owner = 'me'"),
    ],
)
def test_each_role_is_refused_what_it_does_not_need(
    roles: Roles, role: str, statement: str
) -> None:
    with pytest.raises(sa.exc.ProgrammingError) as caught:
        execute(roles.urls[role], statement)
    assert isinstance(caught.value.orig, psycopg.errors.InsufficientPrivilege)


def test_the_app_role_needs_select_for_stage_once(roles: Roles, database_url: str) -> None:
    """Why the doc grants SELECT to the app role: ``stage_once``'s INSERT returns the row's id
    (and it reads a duplicate back). ``stage`` itself needs INSERT only: the flush writes the
    row without RETURNING."""
    app = roles.names["app"]
    execute(database_url, f"REVOKE SELECT ON outbox FROM {app}")  # noqa: S608 (a generated name)
    writer = OutboxWriter(TopicRouter(default="t"), source="/roles-test")
    engine = sa.create_engine(roles.urls["app"], poolclass=sa.pool.NullPool)
    try:
        with Session(engine) as session, session.begin():
            writer.stage(session, _order_event(writer, "NoSelectGrant", "ns-1"))
        with (
            pytest.raises(sa.exc.ProgrammingError) as caught,
            Session(engine) as session,
            session.begin(),
        ):
            writer.stage_once(session, _order_event(writer, "NoSelectGrant", "ns-2"))
        assert isinstance(caught.value.orig, psycopg.errors.InsufficientPrivilege)
    finally:
        engine.dispose()
    assert (
        _count(database_url, "SELECT count(*) FROM outbox WHERE event_type = 'NoSelectGrant'") == 1
    )
    execute(database_url, "DELETE FROM outbox WHERE event_type = 'NoSelectGrant'")


def test_the_relay_role_cannot_insert_events(roles: Roles) -> None:
    with pytest.raises(sa.exc.ProgrammingError) as caught:
        _stage(roles.urls["relay"], "t", [("OrderPlaced", "x")])
    assert isinstance(caught.value.orig, psycopg.errors.InsufficientPrivilege)


async def test_a_missing_grant_is_named_by_check(
    roles: Roles, database_url: str, kafka_bootstrap: str
) -> None:
    relay, consumer = roles.names["relay"], roles.names["consumer"]
    execute(database_url, f"REVOKE UPDATE ON outbox FROM {relay}")
    env = s.clean_env(DATABASE_URL=roles.urls["relay"], KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap)
    code, out = await asyncio.to_thread(s.run, ["relay", "check"], env)
    assert code == 2, out
    assert s.lines(out) == [
        f'relay down: role "{relay}" lacks UPDATE on outbox: GRANT UPDATE ON outbox TO "{relay}"'
    ]
    execute(database_url, f"REVOKE INSERT ON inbox FROM {consumer}")
    args = ["--database-url", roles.urls["consumer"], "--kafka-bootstrap-servers", kafka_bootstrap]
    code, out = await asyncio.to_thread(s.run, ["consumer", "check", *args], s.clean_env())
    assert code == 2, out
    (line,) = s.lines(out)
    assert line.startswith(f'down: role "{consumer}" lacks INSERT on inbox table "inbox"'), line
    assert line.endswith(f'GRANT INSERT ON inbox TO "{consumer}"'), line
    assert roles.passwords["consumer"] not in out


async def test_a_wrong_database_password_makes_relay_run_exit_2_in_one_line(
    roles: Roles, kafka_bootstrap: str
) -> None:
    """Before: libpq reports a refused password without an SQLSTATE, so the relay's check
    called it "unreachable" and `relay run` waited forever. Now (faults.login_refused reads
    libpq's used_password) it exits 2 with one line, without the password, and without
    asking Kafka."""
    wrong = sa.make_url(roles.urls["relay"]).set(password="not-the-relay-password")
    env = s.clean_env(
        DATABASE_URL=wrong.render_as_string(hide_password=False),
        KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
    )
    code, out = await asyncio.to_thread(s.run, ["relay", "run"], env, 60)
    assert code == 2, out
    (line,) = s.lines(out)
    relay = roles.names["relay"]
    assert line.startswith(
        f"ledgerbox relay: the database server at {wrong.host}:{wrong.port} refused the login "
        f"of user {relay!r} to database {wrong.database!r} (connect failed: "
    ), line
    assert line.endswith("fix the user, the password or the database name of the database URL")
    assert f'password authentication failed for user "{roles.names["relay"]}"' in line
    assert "not-the-relay-password" not in out and "Traceback" not in out


def test_the_operator_role_replays_and_discards_a_dead_event(
    roles: Roles, database_url: str
) -> None:
    """The operator role of the doc runs the operator commands: status, list, a dry run, a
    replay and a discard, each audited; and it cannot write events."""
    _stage(roles.urls["app"], "ops-t", [("OrderPlaced", "op-1"), ("OrderPaid", "op-1")])
    # The first event of the key dead-lettered, the second held behind it.
    execute(
        database_url,
        "UPDATE outbox SET status = 2, last_error = 'planted' WHERE event_type = 'OrderPlaced'",
        "UPDATE outbox SET status = 3 WHERE event_type = 'OrderPaid'",
    )
    dead = _count(database_url, "SELECT id FROM outbox WHERE event_type = 'OrderPlaced'")
    env = s.clean_env(DATABASE_URL=roles.urls["operator"])
    for command in (
        ["relay", "status"],
        ["relay", "dead", "list"],
        ["relay", "dead", "replay", str(dead), "--dry-run"],
        ["relay", "dead", "replay", str(dead)],
    ):
        code, out = s.run(command, env)
        assert code == 0, (command, out)
    assert _count(database_url, "SELECT count(*) FROM outbox WHERE status IN (2, 3)") == 0
    execute(database_url, f"UPDATE outbox SET status = 2 WHERE id = {dead}")  # noqa: S608 (an int)
    code, out = s.run(["relay", "dead", "discard", str(dead)], env)
    assert code == 0, out
    assert _count(database_url, f"SELECT status FROM outbox WHERE id = {dead}") == 4  # noqa: S608
    assert _count(database_url, "SELECT count(*) FROM ledgerbox_ops_audit") == 3
    with pytest.raises(sa.exc.ProgrammingError) as caught:
        _stage(roles.urls["operator"], "t", [("OrderPlaced", "x")])
    assert isinstance(caught.value.orig, psycopg.errors.InsufficientPrivilege)
