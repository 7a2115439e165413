"""`ledgerbox consumer check` reports ok / degraded / down through its output and exit code."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from ledgerbox._core.names import SCHEMA_REVISION_MIN, SCHEMA_REVISIONS

REPO = Path(__file__).resolve().parents[2]


HEAD = SCHEMA_REVISIONS[-1]  # the head revision


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check(*args: str) -> tuple[int, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LEDGERBOX_CONSUMER_", "LEDGERBOX_INBOX_"))
    }
    done = subprocess.run(
        [sys.executable, "-m", "ledgerbox.inbox", "check", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout.strip()


def state(result: tuple[int, str]) -> tuple[int, str]:
    """``(exit code, the state word)`` of one ``check`` run, which prints ONE line."""
    code, out = result
    assert len(out.splitlines()) == 1, out
    return code, out.split(":", 1)[0]


def test_check_ok_degraded_down(database_url: str, kafka_bootstrap: str, redis_url: str) -> None:
    base = ["--database-url", database_url, "--kafka-bootstrap-servers", kafka_bootstrap]
    assert check(*base, "--redis-url", redis_url) == (0, "ok")
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    assert state(check(*base, "--redis-url", dead_redis)) == (1, "degraded")
    dead_db = f"postgresql+psycopg://postgres:postgres@127.0.0.1:{free_port()}/app"
    down = check("--database-url", dead_db, "--kafka-bootstrap-servers", kafka_bootstrap)
    assert state(down) == (2, "down")
    assert "database at 127.0.0.1" in down[1] and "unreachable" in down[1]


def _sql(url: str, *statements: str) -> None:
    import sqlalchemy as sa

    eng = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with eng.connect() as conn:
            for statement in statements:
                conn.execute(sa.text(statement))
    finally:
        eng.dispose()


def test_failsafe_01_check_names_the_cause_and_the_fix(
    empty_database_url: str, kafka_bootstrap: str
) -> None:
    """Before: `check` printed `ok` for each of these (it only ran SELECT 1)."""
    import uuid

    from sqlalchemy import make_url

    from ledgerbox import migrations

    url = empty_database_url
    database = make_url(url).database
    kafka = ["--kafka-bootstrap-servers", kafka_bootstrap]
    assert check("--database-url", url, *kafka) == (
        2,
        f'down: inbox table "inbox" does not exist in database "{database}": run ledgerbox migrate',
    )
    migrations.upgrade_database(url)
    assert check("--database-url", url, *kafka) == (0, "ok")

    _sql(url, "ALTER TABLE inbox DROP COLUMN last_error")
    code, line = check("--database-url", url, *kafka)
    assert (code, line) == (
        2,
        f'down: inbox table "inbox" in database "{database}" lacks column(s) last_error: '
        "run ledgerbox migrate",
    )
    _sql(url, "ALTER TABLE inbox ADD COLUMN last_error text")

    _sql(url, "UPDATE ledgerbox_alembic_version SET version_num = '0000'")
    code, line = check("--database-url", url, *kafka)
    assert (
        code == 2 and f"at revision 0000, this version needs {SCHEMA_REVISION_MIN} or later" in line
    )
    # Revision 0004 changed only the outbox trigger: consumers run before the migration.
    _sql(url, f"UPDATE ledgerbox_alembic_version SET version_num = '{SCHEMA_REVISION_MIN}'")  # noqa: S608
    assert check("--database-url", url, *kafka) == (0, "ok")
    _sql(url, f"UPDATE ledgerbox_alembic_version SET version_num = '{HEAD}'")  # noqa: S608 (a constant)

    role = f"fs_chk_{uuid.uuid4().hex[:8]}"
    _sql(
        url,
        f"CREATE ROLE {role} LOGIN PASSWORD 'chk-secret'",
        f"GRANT SELECT, UPDATE ON inbox TO {role}",
    )
    try:
        as_role = make_url(url).set(username=role, password="chk-secret")
        code, line = check("--database-url", as_role.render_as_string(hide_password=False), *kafka)
        assert (code, line) == (
            2,
            f'down: role "{role}" lacks INSERT on inbox table "inbox" in database '
            f'"{database}": GRANT INSERT ON inbox TO "{role}"',
        )
    finally:
        _sql(url, f"REVOKE ALL ON inbox FROM {role}", f"DROP ROLE {role}")

    _sql(url, f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
    try:
        code, line = check("--database-url", url, *kafka)
        assert code == 2 and line.startswith(f'down: database "{database}" is read-only'), line
        assert len(line.splitlines()) == 1
    finally:
        _sql(
            url,
            "SET default_transaction_read_only = off",
            f'ALTER DATABASE "{database}" RESET default_transaction_read_only',
        )
    assert check("--database-url", url, *kafka) == (0, "ok")


def test_check_with_an_app_accepts_a_missing_topic_the_broker_will_create(
    database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """With --app the subscribed topics are checked too; the test broker creates topics on
    first use (auto.create.topics.enable=true), which the check reads from the broker."""
    app = tmp_path / "fs_check_app.py"
    app.write_text(
        "from ledgerbox.inbox import ConsumerConfig, InboxConsumer\n"
        "import os\n"
        "consumer = InboxConsumer(ConsumerConfig(group_id='g', topics=['fs-no-such-topic'],\n"
        "    database_url=os.environ['FS_URL'],\n"
        "    kafka_bootstrap_servers=os.environ['KAFKA_BOOTSTRAP_SERVERS']))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGERBOX_INBOX_")}
    env.update(FS_URL=database_url, KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap, REDIS_URL="")
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "ledgerbox.inbox", "check", "--app", "fs_check_app:consumer"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stdout.strip().splitlines()
    assert (done.returncode, lines[0]) == (0, "ok"), done.stderr
    # --group with --app is not silently dropped (a newcomer's review).
    noted = subprocess.run(
        [sys.executable, "-m", "ledgerbox.inbox", "check", "--app", "fs_check_app:consumer",
         "--group", "other"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert noted.stderr.strip().splitlines()[-1] == (
        "ledgerbox consumer check: --group/--topic are not used with --app: the app's group g"
        " and its topics are checked"
    ), noted.stderr
    # Then the group's lag (a topic not created yet has none to read; health unchanged).
    assert (
        lines[1:]
        == [
            "lag of group g: unavailable: topic 'fs-no-such-topic' does not exist on "
            f"{kafka_bootstrap} (PLAINTEXT): create it, or fix the topic name (--topic, or"
            " the app's ConsumerConfig.topics)"
        ]
        or lines[-1] == "lag of group g: 0 records"
    ), lines


def test_relay_and_consumer_name_an_unreachable_kafka_in_the_same_words(
    database_url: str,
) -> None:
    """Every command and daemon says "Kafka is unreachable" in ONE phrasing with the same fix
    (ledgerbox._core.errors.kafka_unreachable); the relay and the consumer used to print two."""
    dead = f"127.0.0.1:{free_port()}"
    code, consumer_line = check("--database-url", database_url, "--kafka-bootstrap-servers", dead)
    relay = subprocess.run(
        [sys.executable, "-m", "ledgerbox.relay", "check", "--database-url", database_url,
         "--kafka-bootstrap-servers", dead],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    expected = (
        f"Kafka is unreachable at {dead} (no bootstrap server accepts connections): start it, "
        "or fix --kafka-bootstrap-servers / KAFKA_BOOTSTRAP_SERVERS"
    )
    assert (code, consumer_line) == (2, f"down: {expected}")
    assert (relay.returncode, relay.stdout.strip()) == (2, f"relay down: {expected}")
