"""``ledgerbox relay dead ...`` and :mod:`ledgerbox.admin`'s relay side on real PostgreSQL and
Kafka: events Kafka refused for good are listed (each filter), shown, held keys named; a dry
run changes nothing but is audited; a replay sends the dead event and the events its key
held, in id order, with their original event ids, so a consumer that had applied the event
sees a DUPLICATE; a discard gives one up and lets the held ones go; bad input is one line
and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncSession

from ledgerbox import DatabaseError, admin
from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer, Outcome
from ledgerbox.outbox import EventEnvelope
from ledgerbox.relay import KafkaPublisher, Relay
from tests import _relay_support as rs
from tests._inbox_support import produce

REPO = Path(__file__).resolve().parents[2]

metadata = sa.MetaData()
seen = sa.Table(
    "ops_relay_seen",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("key", sa.Text, nullable=False),
    sa.Column("seq", sa.Integer, nullable=False),
)


@pytest.fixture(scope="module", autouse=True)
def _tables(engine: Engine) -> None:
    metadata.create_all(engine)


def _statuses(engine: Engine, topic: str, key: str) -> list[int]:
    with engine.connect() as conn:
        return [
            int(s)
            for s in conn.execute(
                text(
                    "SELECT status FROM outbox WHERE topic = :t AND partition_key = :k ORDER BY id"
                ),
                {"t": topic, "k": key},
            ).scalars()
        ]


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ledgerbox", "relay", "dead", *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def _drain(relay: Relay) -> None:
    while await relay.run_once():
        pass


async def test_relay_dead_list_replay_discard_keep_order_and_event_ids(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("ops-dead", partitions=1)
    writer = rs.writer_for(topic)
    k1 = rs.event(writer, "K", 1, payload={"key": "K", "seq": 1, "bad": True})
    rs.stage(engine, writer, [k1])
    rs.stage(engine, writer, [rs.event(writer, "K", 2), rs.event(writer, "other", 1)])
    rs.stage(engine, writer, [rs.event(writer, "K", 3)])
    rs.stage(
        engine, writer, [rs.event(writer, "M", 1, payload={"key": "M", "seq": 1, "bad": True})]
    )
    rs.stage(engine, writer, [rs.event(writer, "M", 2)])
    publisher = rs.RefusingKafka(KafkaPublisher(kafka_bootstrap, compression="none"))
    relay = Relay(rs.config(database_url, kafka_bootstrap, lanes=1), publisher=publisher)
    db = admin.Database(url=database_url)
    group = f"ops-dead-{uuid.uuid4().hex[:6]}"
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=database_url,
            kafka_bootstrap_servers=kafka_bootstrap,
        )
    )

    @consumer.handler("Tested")
    async def record(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        await ctx.session.execute(
            sa.insert(seen).values(key=event.payload["key"], seq=event.payload["seq"])
        )

    try:
        await _drain(relay)
        assert _statuses(engine, topic, "K") == [2, 3, 3], "dead, then held behind it"
        assert _statuses(engine, topic, "M") == [2, 3]
        with engine.connect() as conn:
            k1_id, m1_id = conn.execute(
                text("SELECT id FROM outbox WHERE topic = :t AND status = 2 ORDER BY id"),
                {"t": topic},
            ).scalars()

        # -- list with each filter, show, held keys ------------------------------------------
        async def ids(**kw: Any) -> list[int]:
            return [e.id for e in await admin.list_dead_events(db, admin.DeadFilter(**kw))]

        assert await ids(topic=topic) == [k1_id, m1_id]
        assert await ids(topic=topic, key="K") == [k1_id]
        assert await ids(topic=topic, event_type="Tested") == [k1_id, m1_id]
        assert await ids(topic=topic, event_type="Other") == []
        assert await ids(topic=topic, error="messagesizetoolarge") == [k1_id, m1_id]
        assert await ids(topic=topic, error="no such error") == []
        assert await ids(topic=topic, older_than_s=3600) == []
        assert await ids(topic=topic, older_than_s=0) == [k1_id, m1_id]
        assert await ids(topic=topic, limit=1) == [k1_id]
        (listed,) = await admin.list_dead_events(db, admin.DeadFilter(topic=topic, key="K"))
        assert (listed.event_id, listed.held_behind, listed.payload) == (str(k1.event_id), 2, None)
        shown = await admin.show_dead_event(db, k1_id)
        assert shown.payload is not None and json.loads(shown.payload)["bad"] is True
        keys = {h.key: h for h in await admin.held_keys(db)}
        assert (keys["K"].dead_id, keys["K"].held, keys["K"].dead_event_id) == (
            k1_id,
            2,
            str(k1.event_id),
        )
        assert (keys["M"].dead_id, keys["M"].held) == (m1_id, 1)
        status = await admin.relay_status(db)
        assert (status.dead_lettered, status.held, status.pending) == (2, 3, 0)
        assert [(h.key, h.dead_id, h.held) for h in status.held_keys] == [
            ("K", k1_id, 2),
            ("M", m1_id, 1),
        ]
        assert len(status.owners) == 65 and status.owners[0].shard == -1
        assert json.loads(json.dumps(status.to_json()))["held_keys"][0]["key"] == "K"

        # -- K1 did reach the group before (an ack lost): the group applied it ---------------
        await produce(kafka_bootstrap, topic, [k1])
        (first,) = [
            r
            for r in await rs.consume(kafka_bootstrap, topic, until=lambda got: len(got) >= 2)
            if dict(r.headers)["ce_id"] == str(k1.event_id).encode()
        ]
        assert await consumer.process_record(first) == Outcome.APPLIED

        # -- dry run: nothing changes, a flagged audit row -----------------------------------
        dry = await admin.replay_dead_events(db, [k1_id], actor="tester", dry_run=True)
        assert (dry.dry_run, dry.changed, dry.ids) == (True, 0, [str(k1_id)])
        (entry,) = await admin.list_audit(db, limit=1)
        assert (entry.id, entry.action, entry.actor, entry.dry_run, entry.ids) == (
            dry.audit_id,
            "relay.dead.replay",
            "tester",
            True,
            [str(k1_id)],
        )
        assert _statuses(engine, topic, "K") == [2, 3, 3]

        # -- replay: K1 then the held K2, K3, in id order, with their event ids --------------
        publisher.refuse = False  # the cause is fixed
        done = await admin.replay_dead_events(db, [k1_id], actor="tester")
        assert (done.changed, done.ids, done.dry_run) == (3, [str(k1_id)], False)
        assert _statuses(engine, topic, "K") == [0, 0, 0]
        await _drain(relay)
        records = await rs.consume(kafka_bootstrap, topic, until=lambda got: len(got) >= 5)
        ks = [r for r in records if r.key == b"K"]
        assert [json.loads(r.value)["seq"] for r in ks] == [1, 1, 2, 3], "the copy, then order"
        assert dict(ks[1].headers)["ce_id"] == str(k1.event_id).encode(), "the same event id"
        assert _statuses(engine, topic, "M") == [2, 3], "another key's dead event stays"
        outcomes = [await consumer.process_record(r) for r in ks[1:]]
        assert outcomes == [Outcome.DUPLICATE, Outcome.APPLIED, Outcome.APPLIED]
        with engine.connect() as conn:
            applied = conn.execute(
                text("SELECT seq FROM ops_relay_seen WHERE key = 'K' ORDER BY id")
            ).scalars()
            assert list(applied) == [1, 2, 3], "K1 applied once"

        # -- discard M1: never sent; M2 goes on ----------------------------------------------
        env = {"DATABASE_URL": database_url}
        out = _cli("discard", str(m1_id), "--actor", "cli", "--json", **env)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert (result["action"], result["ids"], result["changed"], result["actor"]) == (
            "relay.dead.discard",
            [str(m1_id)],
            2,
            "cli",
        )
        assert _statuses(engine, topic, "M") == [4, 0]
        (logged,) = [line for line in out.stderr.splitlines() if "operator action" in line]
        assert (
            f"INFO ledgerbox.admin operator action relay.dead.discard by cli: ids=['{m1_id}']"
            in logged
        )
        assert f"audit_id={result['audit_id']}" in logged and "dry_run=False" in logged
        await _drain(relay)
        records = await rs.consume(kafka_bootstrap, topic, until=lambda got: len(got) >= 6)
        assert [json.loads(r.value)["seq"] for r in records if r.key == b"M"] == [2]
        assert await admin.list_dead_events(db, admin.DeadFilter(topic=topic)) == []

        # -- the CLI: list JSON, dry run text, one-line errors with exit 2 ------------------
        rs.stage(
            engine, writer, [rs.event(writer, "Z", 1, payload={"key": "Z", "seq": 1, "bad": True})]
        )
        publisher.refuse = True
        await _drain(relay)
        out = _cli("list", "--topic", topic, "--json", **env)
        assert out.returncode == 0, out.stderr
        (z,) = json.loads(out.stdout)
        assert (z["key"], z["event_type"], z["held_behind"]) == ("Z", "Tested", 0)
        text_out = _cli("list", "--topic", topic, **env)
        assert text_out.returncode == 0 and str(z["id"]) in text_out.stdout
        dry_out = _cli("replay", "--all-matching", "--key", "Z", "--dry-run", **env)
        assert dry_out.returncode == 0, dry_out.stderr
        assert dry_out.stdout.startswith(f"dry run: would replay 1 dead-lettered event: {z['id']}")
        assert _statuses(engine, topic, "Z") == [2]
        for args, message in [
            (("replay", "999999999"), "outbox row 999999999 is not dead-lettered"),
            (("replay", str(k1_id)), f"outbox row {k1_id} is not dead-lettered"),
            (("replay", "twelve"), "'twelve' is not an outbox row id"),
            (("replay",), "give the outbox row ids"),
            (("replay", str(z["id"]), "--key", "Z"), "not both"),
            (("list", "--older-than-s", "-1"), "older_than_s must be >= 0"),
            (("list", "--limit", "0"), "limit must be between 1 and 10000"),
            (("show", "1", "2"), "exactly one"),
        ]:
            bad = _cli(*args, **env)
            assert bad.returncode == 2, (args, bad.stdout, bad.stderr)
            (line,) = bad.stderr.strip().splitlines()
            assert message in line and "Traceback" not in bad.stderr, (args, line)
        actions = [(e.action, e.dry_run) for e in await admin.list_audit(db, limit=4)]
        assert actions == [
            ("relay.dead.replay", True),
            ("relay.dead.discard", False),
            ("relay.dead.replay", False),
            ("relay.dead.replay", True),
        ], "each action audited once; refused input writes none"
    finally:
        await relay.aclose()
        await consumer.aclose()


def _rows(engine: Engine) -> list[tuple[int, int, str]]:
    with engine.connect() as conn:
        return [
            (int(i), int(s), str(t))
            for i, s, t in conn.execute(
                text("SELECT id, status, txid::text FROM outbox ORDER BY id")
            )
        ]


async def test_replay_and_discard_change_nothing_where_the_audit_table_is_missing(
    empty_database_url: str,
) -> None:
    """A database at revision 0002 (the operator tables of 0003 missing) with a dead row and
    a row held behind it: replay, discard and a dry run are refused with one line naming
    `ledgerbox migrate` and exit 2, and no row is touched (before: the rows were replayed,
    then the audit insert failed: done, unaudited and reported as failed)."""
    from ledgerbox import migrations

    url = empty_database_url
    migrations.upgrade_database(url, revision="0002")
    engine = sa.create_engine(url)
    try:
        writer = rs.writer_for("ops-unmigrated")
        rs.stage(engine, writer, [rs.event(writer, "K", 1), rs.event(writer, "K", 2)])
        with engine.begin() as conn:  # what a relay does when Kafka refuses the first for good
            conn.execute(text("UPDATE outbox SET status = 2, last_error = 'refused' WHERE id = 1"))
            conn.execute(text("UPDATE outbox SET status = 3 WHERE id = 2"))
        before = _rows(engine)
        assert [s for _i, s, _t in before] == [2, 3]
        db = admin.Database(url=url)
        calls: list[Callable[[], Awaitable[admin.ActionResult]]] = [
            lambda: admin.replay_dead_events(db, [1], actor="t"),
            lambda: admin.discard_dead_events(db, [1], actor="t"),
            lambda: admin.replay_dead_events(db, filter=admin.DeadFilter(key="K"), actor="t"),
        ]
        for call in calls:
            with pytest.raises(DatabaseError) as refused:
                await call()
            assert _rows(engine) == before, "a refused action changed rows"
            assert "run `ledgerbox migrate`" in str(refused.value)
        for args in (("replay", "1"), ("discard", "1"), ("replay", "1", "--dry-run")):
            out = _cli(*args, DATABASE_URL=url, LEDGERBOX_RELAY_DATABASE_URL=url)
            assert out.returncode == 2, (args, out.stdout, out.stderr)
            (line,) = out.stderr.strip().splitlines()
            assert "ledgerbox_ops_audit does not exist" in line and "ledgerbox migrate" in line
            assert _rows(engine) == before, args
    finally:
        engine.dispose()
