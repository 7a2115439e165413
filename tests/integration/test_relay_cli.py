"""The relay CLI (``python -m ledgerbox.relay``): check, status, and a SIGTERM'd run exiting 0."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psycopg
import pytest
from sqlalchemy import Engine, text

from ledgerbox._core.names import SCHEMA_REVISIONS
from tests import _relay_support as rs

HEAD = SCHEMA_REVISIONS[-1]  # the head revision


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ledgerbox.relay", *args],
        cwd=rs.REPO_ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_check_exit_code_follows_health(database_url: str, kafka_bootstrap: str) -> None:
    ok = _cli("check", DATABASE_URL=database_url, KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip() == f"relay ok: database ok (schema {HEAD}), kafka ok (1 broker)"
    # New relays run against revision 0003 (deployed before `ledgerbox migrate`: the wake
    # gate's trigger of 0004 is optional for them), not against 0002.
    for at, code in (("0003", 0), ("0002", 2)):
        with psycopg.connect(database_url.replace("+psycopg", ""), autocommit=True) as conn:
            conn.execute("UPDATE ledgerbox_alembic_version SET version_num = %s", (at,))
        try:
            older = _cli(
                "check", DATABASE_URL=database_url, KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap
            )
        finally:
            with psycopg.connect(database_url.replace("+psycopg", ""), autocommit=True) as conn:
                conn.execute("UPDATE ledgerbox_alembic_version SET version_num = %s", (HEAD,))
        assert older.returncode == code, older.stdout + older.stderr
    assert "needs 0003 or later: run `ledgerbox migrate`" in older.stdout
    bad = _cli("check", "--kafka-bootstrap-servers", "127.0.0.1:1", DATABASE_URL=database_url)
    assert bad.returncode == 2
    (line,) = bad.stdout.strip().splitlines()
    assert line.startswith("relay down: Kafka is unreachable at 127.0.0.1:1"), line
    assert "--kafka-bootstrap-servers" in line and "Traceback" not in bad.stderr


def test_status_and_run_until_sigterm(
    engine: Engine, database_url: str, kafka_bootstrap: str
) -> None:
    rs.reset_relay_tables(engine)
    writer = rs.writer_for("cli-status")
    rs.stage(engine, writer, [rs.event(writer, "s1", 1), rs.event(writer, "s2", 1)])
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 2 WHERE partition_key = 's2'"))
    out = _cli("status", DATABASE_URL=database_url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"pending: {rs.pending_count(engine)}"
    assert lines[2] == "dead-lettered: 1"
    assert lines[3] == "shards: no lease rows yet (no relay has started)", lines
    with engine.connect() as conn:
        dead_id, dead_event = conn.execute(
            text("SELECT id, event_id FROM outbox WHERE partition_key = 's2'")
        ).one()
    held = [line for line in lines if line.startswith("held key ")]
    assert held == [
        f"held key s2: dead event {dead_id} ({dead_event}), 0 held behind it, since "
        + held[0].rsplit("since ", 1)[1]
    ], lines
    assert f"`ledgerbox relay dead replay|discard {dead_id}`" in held[0]

    # This run's own broker (a hard-coded 127.0.0.1:9092 reached whatever listened there).
    proc = rs.relay_process(database_url, kafka_bootstrap, "--relay-id", "cli-run")
    try:
        deadline = time.monotonic() + 30
        while "cli-run shards: 0-63 (64)" not in _cli("status", DATABASE_URL=database_url).stdout:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        while rs.pending_count(engine) != 0:  # published while it runs, not only by chance
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        assert rs.stop_process(proc) == 0, "SIGTERM: clean exit"
    after = _cli("status", DATABASE_URL=database_url).stdout
    assert "(free) shards: 0-63 (64)" in after, "leases released at shutdown"
    assert rs.pending_count(engine) == 0


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_run_publishes_and_stops_cleanly_on_either_event_loop(
    engine: Engine, database_url: str, kafka_bootstrap: str, event_loop: str
) -> None:
    """``--event-loop``: the same relay on asyncio's loop and on uvloop (the default when
    installed, as in this test environment); the start-up line names the loop."""
    rs.reset_relay_tables(engine)
    writer = rs.writer_for(f"cli-loop-{event_loop}")
    rs.stage(engine, writer, [rs.event(writer, f"loop-{event_loop}", n) for n in (1, 2, 3)])
    proc = rs.relay_process(database_url, kafka_bootstrap, "--event-loop", event_loop)
    try:
        deadline = time.monotonic() + 30
        while rs.pending_count(engine) != 0:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
    finally:
        code = rs.stop_process(proc)
    log = proc.stderr.read().decode() if proc.stderr is not None else ""
    assert code == 0, log
    assert f"event loop {event_loop}" in log, log


def test_events_in_shards_no_relay_claims_are_reported_by_status_check_and_admin(
    engine: Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """Writers with ``OutboxTable(shard_count=128)``, relays with the default 64: the events
    of shards 64-127 are never published. Before, ``relay status`` said ``pending: 0`` for
    them and ``relay check`` said ``relay ok`` (a newcomer's review); now both name the count
    and the fix, and ``check`` exits 2."""
    import asyncio

    from ledgerbox import admin

    rs.reset_relay_tables(engine)
    keys = [f"k{i}" for i in range(40)]
    stray = rs.stage_stray(engine, len(keys))
    assert 0 < stray < len(keys)

    out = _cli("status", DATABASE_URL=database_url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == f"pending: {len(keys) - stray}"
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("stray: ")]
    assert line == (
        f"stray: {stray} events wait in shards outside 0-63, which no relay with shard_count"
        " 64 publishes: the writers' OutboxTable(shard_count=...) is larger; give every relay"
        " the writers' value (--shard-count, LEDGERBOX_RELAY_SHARD_COUNT) and restart them"
    )
    check = _cli("check", DATABASE_URL=database_url, KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap)
    assert check.returncode == 2, check.stdout + check.stderr
    assert f"relay down: {stray} events wait in shards outside 0-63" in check.stdout
    status = asyncio.run(admin.relay_status(admin.Database(url=database_url)))
    assert status.stray == stray and status.pending == len(keys) - stray
    # With the writers' value: nothing stray, all pending.
    wide = _cli("status", "--shard-count", "128", DATABASE_URL=database_url)
    assert wide.stdout.splitlines()[0] == f"pending: {len(keys)}", wide.stdout
    assert "stray" not in wide.stdout
    # Published by relays with the writers' value, those rows are not stray for a reader
    # with a smaller shard_count (their cursors passed them; a review: "status = 0" alone
    # counted them, since publishing writes nothing to a row).
    from ledgerbox.relay import Relay
    from ledgerbox.relay.testing import InMemoryPublisher

    async def publish_all() -> None:
        config = rs.config(database_url, "unused:9092", shard_count=128, lanes=1)
        relay = Relay(config, publisher=InMemoryPublisher())
        try:
            await relay.run_once()
            await relay.run_once()
        finally:
            await relay.aclose()

    asyncio.run(publish_all())
    status = asyncio.run(admin.relay_status(admin.Database(url=database_url)))
    assert (status.stray, status.pending) == (0, 0)
