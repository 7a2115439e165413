"""The relay fails safe (issue 12, the relay's lines; CASES C16, C19): a relay that cannot
publish holds no shard; checks name what is wrong; a timestamp the broker refuses never
strands an event. Real PostgreSQL and Kafka, real relay processes where a process matters."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from ledgerbox.outbox import OutboxWriter, TopicRouter, shard_of, timestamp_ms
from ledgerbox.relay import Relay
from ledgerbox.relay import _metrics as relay_metrics
from ledgerbox.relay._pgstore import PgRelayStore
from ledgerbox.relay._store import Cursor, ShardRead
from tests import _relay_support as rs
from tests._services import TopicFactory

pytestmark = pytest.mark.timeout(240)


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    unset = ("DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS")
    base = {
        k: v for k, v in os.environ.items() if not k.startswith("LEDGERBOX_") and k not in unset
    }
    return subprocess.run(
        [sys.executable, "-m", "ledgerbox.relay", *args],
        cwd=rs.REPO_ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def _owners(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT owner, count(*) FROM outbox_relay_lease WHERE shard >= 0 AND "
                "owner IS NOT NULL AND expires_at > now() GROUP BY owner"
            )
        ).all()
    return {str(owner): int(n) for owner, n in rows}


def _keys_for_every_shard() -> list[str]:
    keys: dict[int, str] = {}
    i = 0
    while len(keys) < 64:
        keys.setdefault(shard_of(f"c16-{i}"), f"c16-{i}")
        i += 1
    return [keys[s] for s in range(64)]


# --------------------------------------------------------------------------- C16 / line 2


def test_failsafe_02_c16_a_relay_with_a_wrong_kafka_address_holds_no_shard(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    """Issue 12 line 2: a second relay whose Kafka address was wrong acquired half of the
    shards and held them (15 of 28 new events stuck). The misconfigured relay starts FIRST
    here, so that before the fix it took every shard."""
    rs.reset_relay_tables(engine)
    topic = new_topic("c16", partitions=3)
    writer = rs.writer_for(topic)
    keys = _keys_for_every_shard()
    bad = rs.relay_process(database_url, "127.0.0.1:1", "--relay-id", "c16-bad")
    good = None
    try:
        time.sleep(3.0)  # the bad relay alone, for more than one heartbeat
        assert _owners(engine).get("c16-bad", 0) == 0, "it cannot publish: it holds nothing"
        good = rs.relay_process(database_url, kafka_bootstrap, "--relay-id", "c16-good")
        sent = 0
        deadline = time.monotonic() + 20
        worst_bad = 0
        while time.monotonic() < deadline:  # events keep arriving for every shard
            rs.stage(engine, writer, [rs.event(writer, k, sent) for k in keys])
            sent += 1
            worst_bad = max(worst_bad, _owners(engine).get("c16-bad", 0))
            time.sleep(0.5)
        assert worst_bad == 0
        assert _owners(engine) == {"c16-good": 64}, "the healthy relay holds every shard"
        records = asyncio.run(
            rs.consume(kafka_bootstrap, topic, until=lambda got: len(got) >= 64 * sent, within_s=60)
        )
        by_key: dict[str, list[int]] = {}
        for record in records:
            body = json.loads(record.value)
            by_key.setdefault(body["key"], []).append(body["seq"])
        assert {k: sorted(set(v)) for k, v in by_key.items()} == {
            k: list(range(sent)) for k in keys
        }, "every event published"
        assert rs.pending_count(engine) == 0
    finally:
        if good is not None:
            assert rs.stop_process(good) == 0
        rs.stop_process(bad)
    err = bad.stderr.read().decode() if bad.stderr else ""
    down = [line for line in err.splitlines() if " down: kafka:" in line]
    assert len(down) == 1, err[-3000:]  # one line per change of state, not one per retry
    assert "Traceback" not in err
    check = _cli("check", DATABASE_URL=database_url, KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")
    assert check.returncode == 2
    assert check.stdout.startswith("relay down: Kafka is unreachable at 127.0.0.1:1"), check.stdout


# --------------------------------------------------------------------------- line 3


def test_failsafe_03_relay_check_on_an_unmigrated_database_fails_naming_the_fix(
    empty_database_url: str, kafka_bootstrap: str
) -> None:
    """Issue 12 line 3: ``relay check`` on a database that is not migrated said "relay ok:
    database ok, kafka ok" (exit 0) while ``relay run`` logged UndefinedTable every second."""
    env = {"DATABASE_URL": empty_database_url, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    check = _cli("check", **env)
    assert check.returncode == 2, check.stdout + check.stderr
    (line,) = check.stdout.strip().splitlines()
    assert line == (
        "relay down: tables outbox, outbox_relay_lease, outbox_relay_member, outbox_relay_tick "
        "do not exist in "
        "the search path: run `ledgerbox migrate` (or check --schema / --outbox-table)"
    )
    run = rs.relay_process(empty_database_url, kafka_bootstrap, "--relay-id", "unmigrated")
    try:
        time.sleep(5.0)  # ten heartbeats, each failing on the missing table
        assert run.poll() is None, "a missing table is not fatal: the relay waits for it"
    finally:
        assert rs.stop_process(run) == 0
    err = run.stderr.read().decode() if run.stderr else ""
    assert sum("does not exist" in line for line in err.splitlines()) <= 2, err[-3000:]
    assert "relay starts down: tables outbox" in err
    assert "Traceback" not in err


def test_failsafe_03_relay_check_names_a_schema_behind_a_revoked_grant_and_read_only(
    database_url: str, engine: Engine, kafka_bootstrap: str
) -> None:
    name = engine.url.database
    env = {"DATABASE_URL": database_url, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    role = f"relay_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'"))
        conn.execute(text(f"GRANT SELECT ON outbox, outbox_relay_lease TO {role}"))
        conn.execute(text(f"GRANT ALL ON outbox_relay_member TO {role}"))
    try:
        limited = sa.make_url(database_url).set(username=role, password="pw")
        check = _cli(
            "check",
            DATABASE_URL=limited.render_as_string(hide_password=False),
            KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
        )
        assert check.returncode == 2
        assert f'relay down: role "{role}" lacks UPDATE, DELETE on outbox' in check.stdout, (
            check.stdout
        )
        assert f'GRANT UPDATE, DELETE ON outbox TO "{role}"' in check.stdout, check.stdout
        assert "pw" not in check.stdout + check.stderr
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))
    with engine.begin() as conn:
        conn.execute(text(f"ALTER DATABASE {name} SET default_transaction_read_only = on"))
    try:
        check = _cli("check", **env)
        assert check.returncode == 2
        assert "the database session is read-only" in check.stdout, check.stdout
    finally:
        with engine.begin() as conn:
            conn.execute(text("SET default_transaction_read_only = off"))
            conn.execute(text(f"ALTER DATABASE {name} RESET default_transaction_read_only"))
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE outbox RENAME COLUMN last_error TO last_error_old"))
    try:
        check = _cli("check", **env)
        assert check.returncode == 2
        assert "columns outbox.last_error do not exist: the schema is behind" in check.stdout
    finally:
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE outbox RENAME COLUMN last_error_old TO last_error"))
    assert _cli("check", **env).returncode == 0


def test_failsafe_06_relay_run_without_a_database_url_names_every_way_to_set_it() -> None:
    """Issue 12 line 6: ``relay run`` with no env said "LEDGERBOX_RELAY_DATABASE_URL Field
    required" and never mentioned DATABASE_URL or the flag."""
    done = _cli("run")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "ledgerbox relay: no database URL; set --database-url, LEDGERBOX_RELAY_DATABASE_URL "
        "or DATABASE_URL"
    )


# --------------------------------------------------------------------------- C19 / line 12


def _counter(metric: object) -> float:
    return float(metric._value.get())  # type: ignore[attr-defined]


async def test_failsafe_12_c19_a_timestamp_the_broker_refuses_never_strands_the_key(
    engine: Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """Issue 12 line 12: an event whose time the broker refuses (more than
    ``message.timestamp.after.max.ms`` ahead, or before ``before.max.ms``) was accepted at
    write time, then dead-lettered, and with ``hold`` it blocked every later event of its
    key. Now it is published with the relay's send time as record timestamp (ce_time keeps
    the event time) and the key's next event follows it."""
    rs.reset_relay_tables(engine)
    topic = f"c19-{uuid.uuid4().hex[:8]}"
    await rs.create_topic(
        kafka_bootstrap,
        topic,
        {"message.timestamp.after.max.ms": "60000", "message.timestamp.before.max.ms": "86400000"},
    )
    writer = OutboxWriter(TopicRouter(default=topic), source="/c19", max_future_s=None)
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    times = {
        "future": now + dt.timedelta(hours=2),
        "next": now,
        "old": dt.datetime(1990, 5, 1, 12, 0, 0, 123000, tzinfo=dt.UTC),
    }
    with Session(engine) as session, session.begin():
        for seq, (label, occurred_at) in enumerate(times.items()):
            writer.stage(
                session,
                writer.event(
                    event_type="Timed", aggregate_type="clock", aggregate_id="k19",
                    payload={"label": label, "seq": seq}, idempotency_key=f"c19:{topic}:{seq}",
                    occurred_at=occurred_at,
                ),
            )  # fmt: skip
    before = _counter(relay_metrics.RESTAMPED)
    relay = Relay(rs.config(database_url, kafka_bootstrap))
    try:
        published = 0
        for _ in range(10):
            published += await relay.run_once()
            if published >= 3:
                break
    finally:
        await relay.aclose()
    records = await rs.consume(kafka_bootstrap, topic, until=lambda got: len(got) >= 3)
    assert [json.loads(r.value)["label"] for r in records] == ["future", "next", "old"]
    sent_ms = timestamp_ms(dt.datetime.now(dt.UTC))
    for record in records:
        label = json.loads(record.value)["label"]
        event_time = times[label]
        assert dt.datetime.fromisoformat(rs.header(record, "ce_time")) == event_time
        if label == "next":
            assert record.timestamp == timestamp_ms(event_time), "accepted as it is"
        else:
            assert abs(record.timestamp - sent_ms) < 120_000, "stamped with the send time"
    assert _counter(relay_metrics.RESTAMPED) - before == 2
    with engine.connect() as conn:
        statuses = conn.execute(
            text("SELECT status FROM outbox WHERE topic = :t"), {"t": topic}
        ).scalars()
        # Under the cursor a published row keeps status 0 (PENDING; docs/relay.md).
        assert set(statuses) == {0}, "nothing dead-lettered, nothing held"


# --------------------------------------------------------------------------- line 11


async def test_failsafe_11_the_relays_sql_timestamp_equals_the_write_paths(
    engine: Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """Issue 12 line 11: the relay computed record timestamps in SQL with a float multiply,
    1 ms early for exact milliseconds outside roughly 2004-2038 (and a different rounding
    before 1970). Checked on real PostgreSQL over 1970-2100, sub-ms times and pre-1970."""
    rs.reset_relay_tables(engine)
    writer = OutboxWriter(TopicRouter(default="c19-sql"), source="/c19", max_future_s=None)
    import random

    rng = random.Random(19)
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    moments = [
        epoch + dt.timedelta(milliseconds=rng.randrange(0, 4_102_444_800_000)) for _ in range(300)
    ]
    moments += [
        epoch + dt.timedelta(microseconds=rng.randrange(-(10**15), 10**15)) for _ in range(100)
    ]
    moments += [dt.datetime(1987, 5, 10, 10, 40, 21, 915000, tzinfo=dt.UTC), epoch]
    key = "ts-sql"
    with Session(engine) as session, session.begin():
        for i, moment in enumerate(moments):
            writer.stage(
                session,
                writer.event(
                    event_type="Timed", aggregate_type="clock", aggregate_id=key,
                    payload={"i": i}, idempotency_key=f"ts-sql:{uuid.uuid4()}",
                    occurred_at=moment,
                ),
            )  # fmt: skip
    store = PgRelayStore(rs.config(database_url, kafka_bootstrap))
    try:
        claim = await store.claim_batch([ShardRead(shard_of(key), Cursor(None))], 1000, hold=False)
    finally:
        await store.aclose()
    mine = [c for c in claim.events if c.partition_key == key]
    assert len(mine) == len(moments)
    for event in mine:
        moment = moments[json.loads(event.payload)["i"]]
        assert event.occurred_at_ms == timestamp_ms(moment), moment
