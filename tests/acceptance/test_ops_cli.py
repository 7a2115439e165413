"""The operator commands as a newcomer runs them, in subprocesses, on real PostgreSQL and
Kafka: every expected failure is ONE line on stderr with the cause AND the fix, exit 2
(docs/operations.md). The findings of a review of the operator CLI, one test (or two) each:

1. database unreachable / the operator tables of revision 0003 missing: the line says what to
   do (start the server at host:port; run ``ledgerbox migrate``);
2. ``relay status``: the command's prefix, exit 2, and ``--json``;
3. a database URL that can never work: ``relay run`` and ``consumer run`` exit 2 at once
   (a server that is merely down is still waited for);
4. ``--all-matching`` without a filter is refused; an action that matched nothing writes no
   audit row;
5. filters and actor come from the command line only, never from ``LEDGERBOX_*`` variables;
6. ``consumer lag`` of a group that committed nothing anywhere: one line, exit 2.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine

from tests._services import TopicFactory

REPO = Path(__file__).resolve().parents[2]
#: Nothing listens on port 1: the connection is refused at once.
DOWN_URL = "postgresql+psycopg://ops:hunter2@127.0.0.1:1/orders"


def _cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, module: str = "ledgerbox"
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEDGERBOX_")}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def _stage_dead(engine: Engine, topic: str, keys: list[str], error: str = "TooLarge") -> None:
    """Dead-lettered outbox rows (``status = 2``), one per key, as the relay leaves them."""
    with engine.begin() as conn:
        for key in keys:
            conn.execute(
                sa.text(
                    "INSERT INTO outbox (event_id, idempotency_key, topic, partition_key, shard,"
                    " event_type, source, aggregate_type, aggregate_id, payload, occurred_at,"
                    " status, attempts, last_error) VALUES (:id, :ik, :topic, :key, 0,"
                    " 'Tested', '/ops-cli', 'A', :key, '{}', now(), 2, 1, :error)"
                ),
                {
                    "id": uuid.uuid4(),
                    "ik": uuid.uuid4().hex,
                    "topic": topic,
                    "key": key,
                    "error": error,
                },
            )


def _audit_rows(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM ledgerbox_ops_audit")).scalar_one())


@pytest.fixture
def dead(engine: Engine) -> str:
    """A fresh topic name and the outbox holding only its three dead rows (keys a, b, c)."""
    topic = f"ops-cli-{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox"))
    _stage_dead(engine, topic, ["a", "b", "c"])
    return topic


# -- 1 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "command"),
    [
        (["relay", "dead", "list"], "relay dead list"),
        (["relay", "dead", "show", "1"], "relay dead show"),
        (["relay", "status"], "relay status"),
        (["relay", "rebase", "--dry-run"], "relay rebase"),
        (["consumer", "dlq", "list", "--dlq-topic", "orders.dlq"], "consumer dlq list"),
    ],
    ids=["dead-list", "dead-show", "status", "rebase", "dlq-list"],
)
def test_an_unreachable_database_is_one_line_that_says_to_start_it_at_host_port(
    args: list[str], command: str, kafka_bootstrap: str
) -> None:
    result = _cli(
        *args, "--database-url", DOWN_URL, env={"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    )
    assert result.returncode == 2, result
    line = _one_line(result)
    assert line.startswith(f"ledgerbox {command}: the database at 127.0.0.1:1/orders is "), line
    assert "start the server at 127.0.0.1:1, or fix the host/port of --database-url" in line
    assert "hunter2" not in result.stderr + result.stdout


def test_the_operator_tables_missing_says_run_ledgerbox_migrate(
    empty_database_url: str, kafka_bootstrap: str
) -> None:
    migrated = _cli("migrate", "--database-url", empty_database_url, "--revision", "0002")
    assert migrated.returncode == 0, migrated.stderr
    env = {"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    db = ["--database-url", empty_database_url]
    listed = _cli("consumer", "dlq", "list", "--dlq-topic", "orders.dlq", *db, env=env)
    assert listed.returncode == 2, listed
    line = _one_line(listed)
    assert line.startswith("ledgerbox consumer dlq list: "), line
    assert "ledgerbox_dlq_action" in line and "run `ledgerbox migrate`" in line, line
    replayed = _cli("relay", "dead", "replay", "--all-matching", "--key", "k", *db)
    assert replayed.returncode == 2, replayed
    assert "run `ledgerbox migrate`" in _one_line(replayed)
    wrong_schema = _cli("relay", "status", *db, "--schema", "nosuch")
    assert wrong_schema.returncode == 2, wrong_schema
    assert "run `ledgerbox migrate` (or check --schema" in _one_line(wrong_schema)


# -- 2 ------------------------------------------------------------------------------------


def test_relay_status_json_is_the_admin_api_relay_status(
    database_url: str, engine: Engine, dead: str
) -> None:
    import asyncio

    from ledgerbox import admin

    result = _cli("relay", "status", "--json", "--database-url", database_url)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    expected = asyncio.run(admin.relay_status(admin.Database(url=database_url))).to_json()
    assert got == expected
    assert got["dead_lettered"] == 3
    assert [k["key"] for k in got["held_keys"]] == ["a", "b", "c"]
    text = _cli("relay", "status", "--database-url", database_url)
    assert text.returncode == 0 and "dead-lettered: 3" in text.stdout


# -- 3 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["nonsense", "postgresql+psycopg://ops:hunter2@127.0.0.1:99999/orders"],
    ids=["not-a-url", "port-out-of-range"],
)
def test_relay_run_with_a_url_that_can_never_work_exits_2_at_once(
    url: str, kafka_bootstrap: str
) -> None:
    started = time.monotonic()
    result = _cli(
        "relay",
        "run",
        "--database-url",
        url,
        "--kafka-bootstrap-servers",
        kafka_bootstrap,
        timeout=60,
    )
    assert result.returncode == 2, result
    assert time.monotonic() - started < 30
    line = _one_line(result)
    assert line.startswith("ledgerbox relay: database_url "), line
    assert "set --database-url, LEDGERBOX_RELAY_DATABASE_URL or DATABASE_URL" in line
    assert "hunter2" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    "url",
    ["nonsense", "postgresql+psycopg://ops:hunter2@127.0.0.1:99999/orders"],
    ids=["not-a-url", "port-out-of-range"],
)
def test_consumer_run_with_a_url_that_can_never_work_exits_2_at_once(
    url: str, kafka_bootstrap: str
) -> None:
    env = {
        "INBOX_IT_DATABASE_URL": url,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "INBOX_IT_TOPIC": "ops-cli-never",
        "INBOX_IT_GROUP": "ops-cli-never",
    }
    app = "tests.integration.test_inbox_consumer:app_from_env"
    result = _cli("run", "--app", app, env=env, timeout=60, module="ledgerbox.inbox")
    assert result.returncode == 2, result
    line = _one_line(result)
    assert line.startswith("ledgerbox consumer run: database_url "), line
    assert "hunter2" not in result.stderr + result.stdout


def test_relay_run_still_waits_for_a_database_server_that_is_down(kafka_bootstrap: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ledgerbox", "relay", "run", "--database-url", DOWN_URL],
        cwd=REPO,
        env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(6)
        assert proc.poll() is None, "the relay must wait for the database (fail-safe)"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# -- 4 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("verb", ["replay", "discard"])
def test_all_matching_without_a_filter_is_refused(
    verb: str, database_url: str, engine: Engine, dead: str, kafka_bootstrap: str
) -> None:
    before = _audit_rows(engine)
    relay = _cli("relay", "dead", verb, "--all-matching", "--database-url", database_url)
    assert relay.returncode == 2, relay
    line = _one_line(relay)
    assert line.startswith(f"ledgerbox relay dead {verb}: --all-matching without a filter"), line
    assert "--key, --event-type, --topic, --older-than-s or --error" in line
    dlq = _cli(
        "consumer",
        "dlq",
        verb,
        "--all-matching",
        "--dlq-topic",
        "orders.dlq",
        "--database-url",
        database_url,
        env={"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap},
    )
    assert dlq.returncode == 2, dlq
    assert "--all-matching without a filter" in _one_line(dlq)
    assert _audit_rows(engine) == before
    # Every one, deliberately: a filter that selects all of them.
    every = _cli(
        "relay", "dead", verb, "--all-matching", "--older-than-s", "0", "--dry-run",
        "--database-url", database_url,
    )  # fmt: skip
    assert every.returncode == 0, every.stderr
    assert "3 dead-lettered events" in every.stdout


@pytest.mark.parametrize("verb", ["replay", "discard"])
def test_an_action_that_matches_nothing_writes_no_audit_row(
    verb: str,
    database_url: str,
    engine: Engine,
    dead: str,
    kafka_bootstrap: str,
    new_topic: TopicFactory,
) -> None:
    import asyncio

    dlq_topic = asyncio.run(new_topic.acreate("ops-cli-empty-dlq", partitions=1))
    before = _audit_rows(engine)
    for dry in ([], ["--dry-run"]):
        relay = _cli(
            "relay", "dead", verb, "--all-matching", "--key", "nosuch", *dry,
            "--database-url", database_url,
        )  # fmt: skip
        assert relay.returncode == 2, relay
        line = _one_line(relay)
        assert "no dead-lettered event matches the filters key='nosuch'" in line, line
        assert "nothing audited" in line
        dlq = _cli(
            "consumer", "dlq", verb, "--all-matching", "--dlq-topic", dlq_topic,
            "--key", "nosuch", *dry, "--database-url", database_url,
            env={"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap},
        )  # fmt: skip
        assert dlq.returncode == 2, dlq
        assert "no dead-letter record matches the filters" in _one_line(dlq)
    assert _audit_rows(engine) == before
    with engine.connect() as conn:
        statuses = conn.execute(
            sa.text("SELECT DISTINCT status FROM outbox WHERE topic = :t"), {"t": dead}
        ).scalars()
        assert set(statuses) == {2}


# -- 5 ------------------------------------------------------------------------------------


def test_filters_and_actor_are_read_from_the_command_line_only(
    database_url: str, engine: Engine, dead: str, kafka_bootstrap: str
) -> None:
    _stage_dead(engine, dead, ["z"], error="OtherError")
    left_in_the_shell = {
        "LEDGERBOX_RELAY_KEY": "a",
        "LEDGERBOX_RELAY_ACTOR": "mallory",
        "LEDGERBOX_RELAY_LIMIT": "1",
        "LEDGERBOX_RELAY_TOPIC": "elsewhere",
    }
    result = _cli(
        "relay", "dead", "discard", "--all-matching", "--error", "toolarge", "--dry-run",
        "--json", "--database-url", database_url, env=left_in_the_shell,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    done = json.loads(result.stdout)
    assert len(done["ids"]) == 3, done  # a, b, c: what --error selects, not key a alone
    assert done["actor"] != "mallory"
    with engine.connect() as conn:
        filters = conn.execute(
            sa.text("SELECT filters FROM ledgerbox_ops_audit WHERE id = :id"),
            {"id": done["audit_id"]},
        ).scalar_one()
    assert filters["key"] is None and filters["topic"] is None and filters["limit"] == 100
    # A filter without its flag is not taken from the variable either: refused as unfiltered.
    only_env = _cli(
        "relay", "dead", "replay", "--all-matching", "--database-url", database_url,
        env=left_in_the_shell,
    )  # fmt: skip
    assert only_env.returncode == 2
    assert "--all-matching without a filter" in _one_line(only_env)
    consumer = {
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "LEDGERBOX_CONSUMER_GROUP": "billing",
        "LEDGERBOX_CONSUMER_DLQ_TOPIC": "orders.dlq",
        "LEDGERBOX_CONSUMER_ACTOR": "mallory",
    }
    lag = _cli("consumer", "lag", env=consumer)
    assert lag.returncode == 2
    assert _one_line(lag) == "ledgerbox consumer lag: no consumer group: set --group"
    dlq = _cli("consumer", "dlq", "list", "--database-url", database_url, env=consumer)
    assert dlq.returncode == 2
    assert "no dead-letter topic: set --dlq-topic" in _one_line(dlq)


# -- 6 ------------------------------------------------------------------------------------


def test_consumer_lag_of_a_group_that_committed_nothing_is_one_line_and_exit_2(
    kafka_bootstrap: str,
) -> None:
    group = f"typo-{uuid.uuid4().hex[:8]}"
    env = {"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    for extra in ([], ["--json"]):
        result = _cli("consumer", "lag", "--group", group, *extra, env=env)
        assert result.returncode == 2, result
        line = _one_line(result)
        assert line.startswith(
            f"ledgerbox consumer lag: consumer group {group!r} has committed no offsets on any"
            " topic"
        ), line
        assert "check the name (the groups on" in line and "give its topics with --topic" in line
        assert result.stdout == ""


def test_consumer_check_of_a_group_that_committed_nothing_says_so_and_is_degraded(
    database_url: str, kafka_bootstrap: str
) -> None:
    # Before: "ok" then "lag of group nobody: 0 records", exit 0, while `consumer lag` of the
    # same group exits 2: a misspelt group looked healthy and caught up.
    group = f"typo-{uuid.uuid4().hex[:8]}"
    result = _cli(
        "consumer", "check", "--group", group, "--database-url", database_url,
        env={"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap},
    )  # fmt: skip
    assert result.returncode == 1, result
    lines = result.stdout.splitlines()
    assert lines[0] == "ok" and len(lines) == 2, result.stdout
    assert lines[1].startswith(
        f"lag of group {group}: unknown: consumer group {group!r} has committed no offsets on "
        "any topic"
    ), lines[1]
    assert (
        "check the name (the groups on" in lines[1] and "give its topics with --topic" in lines[1]
    )


# -- 7 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "command", "flag"),
    [
        (["relay", "dead", "replay", "--all-matching", "--error", "", "--dry-run"],
         "relay dead replay", "--error"),
        (["relay", "dead", "discard", "--all-matching", "--key", ""], "relay dead discard",
         "--key"),
        (["relay", "dead", "list", "--topic", ""], "relay dead list", "--topic"),
        (["consumer", "dlq", "discard", "--all-matching", "--dlq-topic", "orders.dlq",
          "--error", ""], "consumer dlq discard", "--error"),
        (["consumer", "dlq", "replay", "--all-matching", "--dlq-topic", "orders.dlq",
          "--group", "", "--dry-run"], "consumer dlq replay", "--group"),
        (["consumer", "dlq", "list", "--dlq-topic", "orders.dlq", "--event-type", ""],
         "consumer dlq list", "--event-type"),
        (["consumer", "lag", "--group", "billing", "--topic", ""], "consumer lag", "--topic"),
    ],
    ids=["dead-replay-error", "dead-discard-key", "dead-list-topic", "dlq-discard-error",
         "dlq-replay-group", "dlq-list-event-type", "lag-topic"],
)  # fmt: skip
def test_an_empty_filter_value_is_refused_and_audits_nothing(
    args: list[str],
    command: str,
    flag: str,
    database_url: str,
    engine: Engine,
    dead: str,
    kafka_bootstrap: str,
) -> None:
    # Before: --error "" (an unset "$ERR" in a script) passed the "--all-matching needs a
    # filter" guard and, as a substring of every error, selected every dead event (exit 0,
    # audited); --key "" / --group "" selected nothing.
    before = _audit_rows(engine)
    db = [] if command == "consumer lag" else ["--database-url", database_url]
    result = _cli(*args, *db, env={"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap})
    assert result.returncode == 2, result
    line = _one_line(result)
    assert line.startswith(f"ledgerbox {command}: the {flag[2:].replace('-', '_')} filter is "
                           "empty"), line  # fmt: skip
    assert f"leave {flag} out" in line, line
    assert _audit_rows(engine) == before
    with engine.connect() as conn:
        statuses = conn.execute(
            sa.text("SELECT DISTINCT status FROM outbox WHERE topic = :t"), {"t": dead}
        ).scalars()
        assert set(statuses) == {2}


@pytest.mark.parametrize("actor", ["", "   "], ids=["empty", "blank"])
@pytest.mark.parametrize(
    ("args", "command"),
    [
        (["relay", "dead", "replay", "1", "--dry-run"], "relay dead replay"),
        (["relay", "dead", "discard", "--all-matching", "--key", "k"], "relay dead discard"),
        (["consumer", "dlq", "replay", "orders.dlq:0:0", "--dry-run"], "consumer dlq replay"),
        (["consumer", "dlq", "discard", "orders.dlq:0:0"], "consumer dlq discard"),
    ],
    ids=["dead-replay", "dead-discard", "dlq-replay", "dlq-discard"],
)
def test_an_empty_or_blank_actor_is_refused_and_audits_nothing(
    args: list[str], command: str, actor: str, database_url: str, engine: Engine
) -> None:
    # Before: --actor "" recorded the OS user, --actor "   " wrote blanks into the audit
    # table. Refused before any database or Kafka call (this Kafka address is never reached).
    before = _audit_rows(engine)
    result = _cli(
        *args, "--actor", actor, "--database-url", database_url,
        env={"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"},
    )  # fmt: skip
    assert result.returncode == 2, result
    assert _one_line(result) == (
        f"ledgerbox {command}: the actor is empty ({actor!r}; an unset shell variable?): give a "
        "name, or leave --actor out (the OS user is recorded)"
    )
    assert _audit_rows(engine) == before


# -- 8 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "prefix", "flag"),
    [
        (["relay", "status"], "ledgerbox relay status: ", "--database-url"),
        (["relay", "dead", "list"], "ledgerbox relay dead list: ", "--database-url"),
        (["consumer", "dlq", "list", "--dlq-topic", "orders.dlq"], "ledgerbox consumer dlq list: ",
         "--database-url"),
        (["relay", "check"], "relay down: ", "the database URL"),
        (["consumer", "check"], "down: ", "database_url"),
    ],
    ids=["status", "dead-list", "dlq-list", "relay-check", "consumer-check"],
)  # fmt: skip
def test_a_database_that_does_not_exist_is_named_in_the_line(
    args: list[str], prefix: str, flag: str, database_url: str, kafka_bootstrap: str
) -> None:
    # Before: "... refused the login (... database "nosuch" does not exist): fix the user or
    # password": the database, the one thing wrong, was not in the fix.
    url = sa.make_url(database_url)
    server = f"{url.host}:{url.port}"
    env = {"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    missing = url.set(database="nosuch_ops_db").render_as_string(hide_password=False)
    result = _cli(*args, "--database-url", missing, env=env)
    assert result.returncode == 2, result
    line = (result.stdout + result.stderr).strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert line.startswith(f"{prefix}the database server at {server} refused the login of user "), (
        line
    )
    assert "to database 'nosuch_ops_db'" in line, line
    assert line.endswith(
        "or no database 'nosuch_ops_db' there: fix the user, the password or the database "
        f"name of {flag}"
    ), line
    # No database in the URL: libpq takes the user name, and the line says so.
    unnamed = f"postgresql+psycopg://nobody_ops:x@{server}"
    result = _cli(*args, "--database-url", unnamed, env=env)
    assert result.returncode == 2, result
    line = (result.stdout + result.stderr).strip()
    assert "refused the login of user 'nobody_ops' to database 'nobody_ops'" in line, line
    assert "(the URL names no database: libpq took the user name)" in line, line


# -- a password that is also a word of the message ---------------------------------------


@pytest.mark.parametrize("password", ["same-as-user", "wrong", "server"])
@pytest.mark.parametrize(
    ("args", "prefix"),
    [
        (["relay", "check"], "relay down: "),
        (["relay", "run"], "ledgerbox relay: "),
        (["relay", "status"], "ledgerbox relay status: "),
        (["consumer", "check"], "down: "),
    ],
    ids=["relay-check", "relay-run", "relay-status", "consumer-check"],
)
def test_the_password_is_never_masked_where_it_appears_as_another_word(
    args: list[str], prefix: str, password: str, database_server_url: str, kafka_bootstrap: str
) -> None:
    # Before: the lines were scrubbed by substring: a password equal to the user name printed
    # "the login of user '***'" (which said what the password was), "wrong" made "a *** or
    # missing password", "server" made "the database *** at ... connection to *** at".
    url = sa.make_url(database_server_url)
    secret = url.username if password == "same-as-user" else password
    bad = url.set(password=secret, database="nosuch_scrub_db")
    result = _cli(
        *args, "--database-url", bad.render_as_string(hide_password=False),
        env={"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap},
    )  # fmt: skip
    assert result.returncode == 2, result
    line = (result.stdout + result.stderr).strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert line.startswith(
        f"{prefix}the database server at {url.host}:{url.port} refused the login of user "
        f"{url.username!r} to database 'nosuch_scrub_db' (connect"
    ), line
    assert "connection to server at" in line and "a wrong or missing password" in line, line
    assert "***" not in line, line


# -- consumer purge: the operator commands' one line ---------------------------------------

_PURGE_APP = """
import os

from ledgerbox.inbox import ConsumerConfig, InboxConsumer

consumer = InboxConsumer(
    ConsumerConfig(
        group_id=os.environ["PURGE_GROUP"],
        topics=[os.environ["PURGE_TOPIC"]],
        database_url=os.environ["DATABASE_URL"],
        kafka_bootstrap_servers=os.environ["KAFKA_BOOTSTRAP_SERVERS"],
    )
)
"""


@pytest.fixture
def purge_app(tmp_path: Path, kafka_bootstrap: str, new_topic: TopicFactory) -> dict[str, str]:
    """The env of ``consumer purge --app purge_app:consumer``: a group that committed an
    offset (else purge has nothing to ask the database)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    (tmp_path / "purge_app.py").write_text(_PURGE_APP)
    topic, group = new_topic("purge", partitions=1), f"purge-{uuid.uuid4().hex[:8]}"

    async def commit() -> None:
        probe = AIOKafkaConsumer(
            bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False
        )
        await probe.start()
        try:
            probe.assign([TopicPartition(topic, 0)])
            await probe.commit({TopicPartition(topic, 0): 0})
        finally:
            await probe.stop()

    asyncio.run(commit())
    return {
        "PYTHONPATH": str(tmp_path),
        "PURGE_GROUP": group,
        "PURGE_TOPIC": topic,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
    }


def test_consumer_purge_says_what_to_do_about_the_database_and_kafka_in_one_line(
    purge_app: dict[str, str], database_server_url: str, empty_database_url: str
) -> None:
    # Before: "purge failed: OperationalError: ... does not exist", "UndefinedTable (SQLSTATE
    # 42P01): relation "inbox" does not exist", a raw OperationalError for a server that is
    # down, and aiokafka's "Unable connect to ..." line before ledgerbox's own.
    url = sa.make_url(database_server_url)
    server = f"{url.host}:{url.port}"
    prefix = "ledgerbox consumer purge: "

    def purge(database: str, **env: str) -> str:
        result = _cli(
            "consumer", "purge", "--app", "purge_app:consumer",
            env={**purge_app, "DATABASE_URL": database, **env},
        )  # fmt: skip
        assert result.returncode == 2, result
        assert result.stdout == ""
        line = _one_line(result)
        assert line.startswith(prefix), line
        return line.removeprefix(prefix)

    missing = url.set(database="nosuch_purge_db").render_as_string(hide_password=False)
    line = purge(missing)
    assert line.startswith(
        f"the database server at {server} refused the login of user {url.username!r} to "
        "database 'nosuch_purge_db' ("
    ), line
    assert line.endswith("fix the user, the password or the database name of database_url")
    assert "run `ledgerbox migrate`" in purge(empty_database_url)
    line = purge(DOWN_URL)
    assert line.startswith("the database at 127.0.0.1:1/orders is unreachable ("), line
    assert line.endswith("start the server at 127.0.0.1:1, or fix the host/port of database_url")
    line = purge(empty_database_url, KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")
    assert "Kafka is unreachable at 127.0.0.1:1" in line, line
