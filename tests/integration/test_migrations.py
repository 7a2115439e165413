"""Migrations vs models: after ``upgrade head`` Alembic's autogenerate finds no difference."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.engine import Engine

from ledgerbox import migrations
from ledgerbox._core.errors import ConfigurationError
from ledgerbox._core.identifiers import (
    INBOX_DERIVED_NAMES,
    MAX_IDENTIFIER_CHARS,
    OUTBOX_DERIVED_NAMES,
    RESERVED_KEYWORDS,
)
from ledgerbox.outbox._table import MAX_CHANNEL_CHARS


def _diff(engine: Engine, names: migrations.Names) -> list[object]:
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn,
            opts={
                "compare_type": True,
                "compare_server_default": True,
                "include_schemas": names.schema is not None,
                "include_name": lambda name, type_, parent: (
                    type_ != "schema" or name == names.schema
                ),
                "version_table": migrations.VERSION_TABLE,
                "version_table_schema": names.schema,
            },
        )
        return list(compare_metadata(context, migrations.target_metadata(names)))


def _tables(url: str, schema: str) -> int:
    """How many tables ``schema`` of the database at ``url`` holds."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    sa.text("SELECT count(*) FROM pg_tables WHERE schemaname = :s"), {"s": schema}
                ).scalar_one()
            )
    finally:
        engine.dispose()


def test_head_matches_the_models(engine: Engine) -> None:
    # The module database was created from the template migrated to head.
    assert _diff(engine, migrations.Names()) == []


def test_custom_names_downgrade_and_upgrade_again(engine: Engine, database_url: str) -> None:
    names = migrations.Names(schema="svc", outbox_table="svc_outbox", inbox_table="svc_inbox")
    config = migrations.alembic_config(database_url, names)
    command.upgrade(config, "head")
    assert _diff(engine, names) == []
    command.downgrade(config, "base")
    with engine.connect() as conn:
        tables = set(sa.inspect(conn).get_table_names(schema="svc"))
    assert tables <= {migrations.VERSION_TABLE}
    command.upgrade(config, "head")
    assert _diff(engine, names) == []


def test_revision_4_gates_the_trigger_and_its_downgrade_notifies_always(
    engine: Engine, database_url: str
) -> None:
    names = migrations.Names(schema="gated", outbox_table="g_outbox", inbox_table="g_inbox")
    config = migrations.alembic_config(database_url, names)

    def body() -> str:
        with engine.connect() as conn:
            return str(
                conn.execute(
                    sa.text("SELECT prosrc FROM pg_proc WHERE proname = 'g_outbox_notify'")
                ).scalar_one()
            )

    command.upgrade(config, "0003")
    assert "pg_try_advisory_xact_lock_shared" not in body()  # revision 1's trigger, frozen
    command.upgrade(config, "head")
    assert "pg_try_advisory_xact_lock_shared" in body()
    command.downgrade(config, "0003")
    assert "pg_try_advisory_xact_lock_shared" not in body()
    assert "pg_notify" in body()
    command.downgrade(config, "base")


async def test_a_v1_database_upgraded_online_publishes_each_v1_pending_event_once_in_order(
    empty_database_url: str,
) -> None:
    """Revision 1 with events published (status 1), pending (status 0) and a dead-lettered
    one with a pending event of its key behind it; upgraded to head (the v1 relays
    stopped); the new relay publishes every v1-pending event once, in id order per key,
    never a v1-published one, holds the one behind the dead row; new events follow."""
    import json

    from ledgerbox.relay import Relay
    from ledgerbox.relay.testing import InMemoryPublisher
    from tests import _relay_support as rs

    url = empty_database_url
    migrations.upgrade_database(url, revision="0001")
    engine = sa.create_engine(url)
    try:
        writer = rs.writer_for("v1-up")

        def stage_v1(*events: Any) -> None:
            # A Core insert names only the columns it sets: what a v1 producer wrote.
            with engine.begin() as conn:
                writer.stage_many(conn, events)

        for seq in range(6):
            stage_v1(*(rs.event(writer, k, seq) for k in ("a", "b")))
        stage_v1(rs.event(writer, "dead", 0), rs.event(writer, "dead", 1))
        with engine.begin() as conn:  # what the v1 relay had done
            conn.execute(
                sa.text(
                    "UPDATE outbox SET status = 1, published_at = now()"
                    " WHERE (payload->>'seq')::int < 3 AND partition_key IN ('a', 'b')"
                )
            )
            conn.execute(
                sa.text(
                    "UPDATE outbox SET status = 2, last_error = 'too large'"
                    " WHERE partition_key = 'dead' AND (payload->>'seq')::int = 0"
                )
            )
        migrations.upgrade_database(url)
        assert _diff(engine, migrations.Names()) == []
        rs.stage(engine, writer, [rs.event(writer, k, 6) for k in ("a", "b")])
        publisher = InMemoryPublisher()
        relay = Relay(rs.config(url, "unused:9092"), publisher=publisher)
        try:
            while await relay.run_once():
                pass
        finally:
            await relay.aclose()
        seen: dict[bytes, list[int]] = {}
        for record in publisher.records:
            seen.setdefault(record.key, []).append(json.loads(record.value)["seq"])
        assert seen == {b"a": [3, 4, 5, 6], b"b": [3, 4, 5, 6]}, seen
        with engine.connect() as conn:
            dead = conn.execute(
                sa.text("SELECT status FROM outbox WHERE partition_key = 'dead' ORDER BY id")
            ).scalars()
            assert list(dead) == [2, 3], "dead stays dead, the one behind it is held"
        assert rs.pending_count(engine) == 0

        # Downgrade to revision 1: the rows v2 published become status 1, the held row
        # pending again (v1's claim skips it behind the dead row).
        from alembic import command

        command.downgrade(migrations.alembic_config(url), "0001")
        with engine.connect() as conn:
            statuses = conn.execute(
                sa.text("SELECT partition_key, status, count(*) FROM outbox GROUP BY 1, 2")
            ).all()
        assert {(k, int(s), int(n)) for k, s, n in statuses} == {
            ("a", 1, 7),
            ("b", 1, 7),
            ("dead", 2, 1),
            ("dead", 0, 1),
        }
    finally:
        engine.dispose()


def test_the_reserved_key_words_are_the_servers(engine: Engine) -> None:
    # Names are embedded unquoted (trigger DDL, the relay's and the writer's SQL): every key
    # word this server reserves for table and schema names must be refused by sql_identifier.
    with engine.connect() as conn:
        reserved = set(
            conn.execute(
                sa.text("SELECT word FROM pg_get_keywords() WHERE catcode IN ('R', 'T')")
            ).scalars()
        )
    assert reserved - RESERVED_KEYWORDS == set()


def test_a_reserved_word_as_a_table_name_is_refused_before_any_sql(
    empty_database_url: str,
) -> None:
    # Before: "order" passed validation and the migration failed half-way with PostgreSQL's
    # syntax error at "CREATE TRIGGER order_notify AFTER INSERT ON order".
    with pytest.raises(ConfigurationError, match="'order' is a reserved SQL key word"):
        migrations.upgrade_database(empty_database_url, migrations.Names(outbox_table="order"))
    assert _tables(empty_database_url, "public") == 0


def test_the_longest_notify_channel_is_the_servers(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_notify(:c, '')"), {"c": "c" * MAX_CHANNEL_CHARS})
        with pytest.raises(sa.exc.DBAPIError, match="channel name too long"):
            conn.execute(sa.text("SELECT pg_notify(:c, '')"), {"c": "c" * (MAX_CHANNEL_CHARS + 1)})


def test_names_making_a_too_long_notify_channel_are_refused_before_any_sql(
    empty_database_url: str,
) -> None:
    # Before: the migration passed and every producer's INSERT then failed in the NOTIFY
    # trigger: pg_notify('<table>_<schema>_ledgerbox') "channel name too long".
    names = migrations.Names(schema="s" * 30, outbox_table="o" * 30)
    with pytest.raises(ConfigurationError, match="notify channel"):
        migrations.upgrade_database(empty_database_url, names)
    assert _tables(empty_database_url, "s" * 30) == 0


# Names the tables, constraints, indexes, triggers and functions of one database hold.
_CATALOG_NAMES = """
SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace
UNION SELECT conname FROM pg_constraint WHERE connamespace = 'public'::regnamespace
UNION SELECT tgname FROM pg_trigger WHERE NOT tgisinternal
UNION SELECT proname FROM pg_proc WHERE pronamespace = 'public'::regnamespace
"""


def test_the_longest_table_names_migrate_with_every_derived_name_whole(
    empty_database_url: str,
) -> None:
    # Before: a 45-char outbox name (47-char inbox name) passed every setting check and the
    # migration failed with SQLAlchemy's IdentifierError on uq_<name>_idempotency_key
    # (ix_<name>_first_seen_at); PostgreSQL itself truncates the names it makes up (<t>_pkey).
    outbox, inbox = "o" * 44, "i" * 46
    names = migrations.Names(outbox_table=outbox, inbox_table=inbox)
    migrations.upgrade_database(empty_database_url, names)
    engine = sa.create_engine(empty_database_url)
    try:
        with engine.connect() as conn:
            stored = set(conn.execute(sa.text(_CATALOG_NAMES)).scalars())
        assert _diff(engine, names) == []
    finally:
        engine.dispose()
    for base, templates in ((outbox, OUTBOX_DERIVED_NAMES), (inbox, INBOX_DERIVED_NAMES)):
        derived = {name for name in stored if base in name}
        known = {"{}", *templates}
        # Every name the migration made from the base is a known template, whole (a
        # truncated or a new, unlisted one fails here) ...
        assert {name for name in derived if name not in {t.format(base) for t in known}} == set()
        # ... and the longest of them is the longest PostgreSQL allows.
        assert max(len(name) for name in derived) <= MAX_IDENTIFIER_CHARS
    assert max(len(t.format(outbox)) for t in OUTBOX_DERIVED_NAMES) == MAX_IDENTIFIER_CHARS
    assert max(len(t.format(inbox)) for t in INBOX_DERIVED_NAMES) == MAX_IDENTIFIER_CHARS


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (migrations.Names(outbox_table="o" * 45), "is 45 chars: .* use at most 44 chars"),
        (migrations.Names(inbox_table="i" * 47), "is 47 chars: .* use at most 46 chars"),
    ],
)
def test_a_table_name_too_long_for_its_derived_names_is_refused_before_any_sql(
    empty_database_url: str, names: migrations.Names, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        migrations.upgrade_database(empty_database_url, names)
    assert _tables(empty_database_url, "public") == 0
