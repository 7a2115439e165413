"""Inputs the operator API refuses before it opens a connection (no services): a URL that
is not PostgreSQL's (before: a SQLAlchemy ``ArgumentError`` traceback from replay/discard
and every ``consumer dlq`` command), an infinite age (before: a database overflow error or
an empty list), a row id beyond ``bigint`` (before: a database out-of-range error)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from ledgerbox import ConfigurationError, admin

# Nothing listens on port 1: a test that reached the database would fail with DatabaseError.
NOWHERE = "postgresql+psycopg://u:secret@127.0.0.1:1/none"


@pytest.mark.parametrize("url", ["garbage", "mysql://x@y/z", "sqlite:///x.db", "", "://"])
def test_a_database_url_that_is_not_postgresql_is_a_configuration_error(url: str) -> None:
    with pytest.raises(ConfigurationError, match="not a PostgreSQL URL") as info:
        admin.Database(url=url)
    assert info.value.setting == "database_url"
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "url", [NOWHERE, "postgresql://u@h/db", "postgres://u@h:5432/db", "postgresql+psycopg://h/db"]
)
def test_postgresql_urls_are_accepted(url: str) -> None:
    assert admin.Database(url=url).url == url


@pytest.mark.parametrize("age", [math.inf, -math.inf, math.nan, -1.0])
def test_an_age_must_be_finite_and_not_negative(age: float) -> None:
    with pytest.raises(admin.InvalidFilterError, match="older_than_s must be >= 0") as dead:
        admin.DeadFilter(older_than_s=age)
    assert dead.value.setting == "older_than_s"
    with pytest.raises(admin.InvalidFilterError, match="older_than_s must be >= 0"):
        admin.DlqFilter(dlq_topic="t.dlq", older_than_s=age)


@pytest.mark.parametrize("row_id", [2**63, 10**20, 0, -1])
async def test_a_row_id_no_bigint_can_hold_is_not_found_without_a_database_call(
    row_id: int,
) -> None:
    db = admin.Database(url=NOWHERE)
    with pytest.raises(admin.NotFoundError, match=f"outbox row {row_id} is not dead-lettered"):
        await admin.show_dead_event(db, row_id)
    for act in (admin.replay_dead_events, admin.discard_dead_events):
        with pytest.raises(admin.NotFoundError, match=f"outbox row {row_id} "):
            await act(db, [5, row_id], actor="t")


@pytest.mark.parametrize("args", [("lag", "--group", "g"), ("lag", "--group", "g", "--json")])
def test_kafka_unreachable_is_one_line_on_stderr(args: tuple[str, ...]) -> None:
    # Before: aiokafka's own ERROR line ("Unable connect to ...") came first, through
    # Python's last-resort handler: two lines.
    out = _ledgerbox("consumer", *args)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("ledgerbox consumer ") and "Kafka is unreachable at" in line
    assert line.endswith("start it, or fix --kafka-bootstrap-servers / KAFKA_BOOTSTRAP_SERVERS")


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (
            ("consumer", "dlq", "list", "--dlq-topic", "o.dlq", "--inbox-table", "i" * 47),
            "--inbox-table or LEDGERBOX_CONSUMER_INBOX_TABLE",
        ),
        (
            ("relay", "dead", "list", "--outbox-table", "order"),
            "--outbox-table or LEDGERBOX_RELAY_OUTBOX_TABLE",
        ),
        (("relay", "dead", "list", "--schema", "Bad"), "--schema or LEDGERBOX_RELAY_SCHEMA"),
    ],
)
def test_an_operator_command_refuses_a_bad_name_naming_the_flag(
    args: tuple[str, ...], flag: str
) -> None:
    # Before: one line, but no flag named ('ledgerbox consumer dlq list: inbox table name ...
    # use at most 46 chars'): admin.Database set no setting on its ConfigurationError.
    out = _ledgerbox(*args, "--database-url", NOWHERE)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.endswith(f"; set {flag}"), line


def _ledgerbox(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m ledgerbox ARGS`` without the caller's Kafka/ledgerbox variables, Kafka at a
    port nothing listens on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "LEDGERBOX_"))}
    return subprocess.run(
        [sys.executable, "-m", "ledgerbox", *args],
        env={**env, "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("field", ["key", "event_type", "topic", "error"])
def test_an_empty_text_filter_of_dead_events_is_refused(field: str) -> None:
    # Before: error="" matched every dead event (a substring of every error), key="" none.
    with pytest.raises(admin.InvalidFilterError, match=f"the {field} filter is empty") as info:
        admin.DeadFilter(**{field: ""})
    assert info.value.setting == field
    admin.DeadFilter(**{field: " "})  # a value, however odd, is the operator's choice


@pytest.mark.parametrize("field", ["group", "key", "event_type", "error"])
def test_an_empty_text_filter_of_dlq_records_is_refused(field: str) -> None:
    with pytest.raises(admin.InvalidFilterError, match=f"the {field} filter is empty") as info:
        admin.DlqFilter(dlq_topic="orders.dlq", **{field: ""})
    assert info.value.setting == field
