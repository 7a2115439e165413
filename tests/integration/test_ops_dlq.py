"""``ledgerbox consumer dlq ...`` and :mod:`ledgerbox.admin`'s dead-letter side on real
PostgreSQL and Kafka: two consumer groups share one topic and its dead-letter topic; group A
dead-letters events that group B applies. A replay reaches group A only and is applied
exactly once, in the records' original order; a second replay is a duplicate for A; other
groups acknowledge replays without running a handler; discard hides a record and refuses its
replay; dry runs change nothing but are audited; bad input is one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from aiokafka.structs import ConsumerRecord
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncSession

from ledgerbox import admin
from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer, InboxStatus, Outcome
from ledgerbox.outbox import EventEnvelope
from tests import _relay_support as rs
from tests._inbox_support import order_event, produce

REPO = Path(__file__).resolve().parents[2]

metadata = sa.MetaData()
applied = sa.Table(
    "ops_dlq_applied",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("consumer_group", sa.Text, nullable=False),
    sa.Column("order_id", sa.Text, nullable=False),
)


class PoisonError(Exception):
    """What group A's handler raises while its bug is not fixed."""


@pytest.fixture(scope="module", autouse=True)
def _tables(engine: Engine) -> None:
    metadata.create_all(engine)


def _consumer(
    database_url: str, bootstrap: str, topic: str, dlq: str, group: str, broken: set[str]
) -> InboxConsumer:
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=database_url,
            kafka_bootstrap_servers=bootstrap,
            dead_letter_topic=dlq,
            dead_letter_on=(PoisonError,),
        )
    )

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        order = event.payload["order_id"]
        if order in broken:
            raise PoisonError(f"group {ctx.group_id} cannot pay order {order}")
        await ctx.session.execute(
            sa.insert(applied).values(consumer_group=ctx.group_id, order_id=order)
        )

    return consumer


def _applied(engine: Engine, group: str) -> list[str]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(applied.c.order_id)
            .where(applied.c.consumer_group == group)
            .order_by(applied.c.id)
        ).all()
    return [r[0] for r in rows]


def _inbox_status(engine: Engine, group: str, event_id: uuid.UUID) -> int | None:
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT status FROM inbox WHERE consumer_group = :g AND event_id = :e"),
            {"g": group, "e": event_id},
        ).scalar_one_or_none()


async def _read_all(bootstrap: str, topic: str, count: int) -> list[ConsumerRecord[bytes, bytes]]:
    return await rs.consume(bootstrap, topic, until=lambda got: len(got) >= count)


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ledgerbox", "consumer", *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_dlq_replay_reaches_only_its_group_once_in_order_and_discard_is_final(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any
) -> None:
    topic = await new_topic.acreate("ops-dlq", partitions=1)
    dlq = await new_topic.acreate("ops-dlq-dlq", partitions=1)
    group_a, group_b = (f"ops-{name}-{uuid.uuid4().hex[:6]}" for name in ("a", "b"))
    broken_a = {"E1", "E2", "E4"}
    a = _consumer(database_url, kafka_bootstrap, topic, dlq, group_a, broken_a)
    b = _consumer(database_url, kafka_bootstrap, topic, dlq, group_b, set())
    events = [order_event(topic, order) for order in ("E1", "E2", "E3", "E4")]
    await produce(kafka_bootstrap, topic, events)
    kafka = admin.KafkaSettings(bootstrap_servers=kafka_bootstrap)
    db = admin.Database(url=database_url)
    try:
        source = await _read_all(kafka_bootstrap, topic, 4)
        assert await a.process_batch(source) == [
            Outcome.DEAD_LETTERED,
            Outcome.DEAD_LETTERED,
            Outcome.APPLIED,
            Outcome.DEAD_LETTERED,
        ]
        assert await b.process_batch(source) == [Outcome.APPLIED] * 4
        assert _applied(engine, group_a) == ["E3"]
        assert _applied(engine, group_b) == ["E1", "E2", "E3", "E4"]

        # -- list, with each filter ------------------------------------------------------
        listed = await admin.list_dlq_records(kafka, db, admin.DlqFilter(dlq_topic=dlq))
        assert [r.event_id for r in listed] == [str(events[i].event_id) for i in (0, 1, 3)]
        assert {r.group for r in listed} == {group_a}, "each record names its group"
        assert [r.source_offset for r in listed] == [0, 1, 3]
        assert all(r.source_topic == topic and r.state == "dead" for r in listed)
        assert all(r.error_type and r.error_type.endswith("PoisonError") for r in listed)
        refs = [r.ref for r in listed]
        assert refs == [f"{dlq}:0:{i}" for i in range(3)]

        async def listed_with_async(**kw: Any) -> list[admin.DlqRecord]:
            return await admin.list_dlq_records(kafka, db, admin.DlqFilter(dlq_topic=dlq, **kw))

        assert [r.ref for r in await listed_with_async(group=group_b)] == []
        assert [r.ref for r in await listed_with_async(group=group_a)] == refs
        e2_key = listed[1].key
        assert e2_key is not None
        assert [r.ref for r in await listed_with_async(key=e2_key)] == [refs[1]]
        assert [r.ref for r in await listed_with_async(event_type="OrderPlaced")] == refs
        assert [r.ref for r in await listed_with_async(event_type="Other")] == []
        assert [r.ref for r in await listed_with_async(error="cannot pay order e4")] == [refs[2]]
        assert [r.ref for r in await listed_with_async(older_than_s=3600)] == []
        assert [r.ref for r in await listed_with_async(limit=2)] == refs[:2]
        shown = await admin.show_dlq_record(kafka, db, refs[0])
        assert shown.value is not None and json.loads(shown.value)["order_id"] == "E1"
        assert ("ledgerbox_consumer_group", group_a) in shown.headers

        # -- dry run: nothing changes, the audit row is flagged ------------------------------
        dry = await admin.replay_dlq_records(kafka, db, refs[:2], actor="tester", dry_run=True)
        assert (dry.dry_run, dry.changed, dry.ids) == (True, 0, refs[:2])
        (entry,) = await admin.list_audit(db, limit=1)
        assert (entry.id, entry.actor, entry.action, entry.dry_run) == (
            dry.audit_id,
            "tester",
            "consumer.dlq.replay",
            True,
        )
        assert _inbox_status(engine, group_a, events[0].event_id) == InboxStatus.DEAD_LETTERED
        assert len(await _read_all(kafka_bootstrap, topic, 4)) == 4, "nothing republished"

        # -- replay E2 and E1 (given out of order): A runs them once, in order; B not --------
        broken_a.clear()  # the bug is fixed
        done = await admin.replay_dlq_records(kafka, db, [refs[1], refs[0]], actor="tester")
        assert (done.dry_run, done.changed, done.ids) == (False, 2, [refs[0], refs[1]])
        for event in events[:2]:
            status = _inbox_status(engine, group_a, event.event_id)
            assert status == InboxStatus.REPLAY_REQUESTED
        everything = await _read_all(kafka_bootstrap, topic, 6)
        replays = everything[4:]
        assert [r.offset for r in replays] == [4, 5]
        assert [dict(r.headers)["ce_id"] for r in replays] == [
            str(events[0].event_id).encode(),
            str(events[1].event_id).encode(),
        ], "original event ids, in the original order"
        for r in replays:
            headers = dict(r.headers)
            assert headers["ledgerbox_replay_group"] == group_a.encode()
            assert headers["ledgerbox_replay_id"] == str(done.audit_id).encode()
            assert "ledgerbox_error_type" not in headers
        assert await b.process_batch(replays) == [Outcome.IGNORED] * 2, "B does not run them"
        assert await a.process_batch(replays) == [Outcome.APPLIED] * 2
        assert _applied(engine, group_a) == ["E3", "E1", "E2"], "applied once, in order"
        assert _applied(engine, group_b) == ["E1", "E2", "E3", "E4"], "B applied each once"
        after = await admin.list_dlq_records(kafka, db, admin.DlqFilter(dlq_topic=dlq))
        assert [r.ref for r in after] == [refs[2]], "replayed records are no longer listed"

        # -- a second replay of E1 is a duplicate for A -----------------------------------
        again = await admin.replay_dlq_records(kafka, db, [refs[0]], actor="tester")
        assert again.changed == 1
        (copy,) = (await _read_all(kafka_bootstrap, topic, 7))[6:]
        assert await a.process_record(copy) == Outcome.DUPLICATE
        assert await b.process_record(copy) == Outcome.IGNORED
        assert _applied(engine, group_a) == ["E3", "E1", "E2"]

        # -- discard E4: hidden from lists, replay refused, A's row stays dead-lettered -----
        gone = await admin.discard_dlq_records(kafka, db, [refs[2]], actor="tester")
        assert (gone.changed, gone.ids) == (1, [refs[2]])
        assert await admin.list_dlq_records(kafka, db, admin.DlqFilter(dlq_topic=dlq)) == []
        every = await listed_with_async(include_done=True)
        assert [(r.ref, r.state) for r in every] == [
            (refs[0], "replayed"),
            (refs[1], "replayed"),
            (refs[2], "discarded"),
        ]
        with pytest.raises(admin.RefusedError, match="discarded"):
            await admin.replay_dlq_records(kafka, db, [refs[2]])
        assert _inbox_status(engine, group_a, events[3].event_id) == InboxStatus.DEAD_LETTERED
        assert len(await _read_all(kafka_bootstrap, topic, 7)) == 7, "nothing sent for E4"

        actions = [(e.action, e.dry_run, e.ids) for e in await admin.list_audit(db, limit=4)]
        assert actions == [
            ("consumer.dlq.discard", False, [refs[2]]),
            ("consumer.dlq.replay", False, [refs[0]]),
            ("consumer.dlq.replay", False, [refs[0], refs[1]]),
            ("consumer.dlq.replay", True, refs[:2]),
        ]

        # -- the CLI: JSON output, a dry run, bad input ---------------------------------------
        env = {"DATABASE_URL": database_url, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
        out = _cli("dlq", "list", "--dlq-topic", dlq, "--all", "--json", **env)
        assert out.returncode == 0, out.stderr
        assert [r["ref"] for r in json.loads(out.stdout)] == refs
        text = _cli("dlq", "list", "--dlq-topic", dlq, "--all", **env)
        assert text.returncode == 0 and refs[2] in text.stdout and "discarded" in text.stdout
        for args, message in [
            (("dlq", "discard", refs[0], "--dry-run"), f"group {group_a} applied it after a"),
            (("dlq", "replay", "not-a-ref"), "is not a dead-letter record reference"),
            (("dlq", "replay", f"{dlq}:0:999"), f"no record {dlq}:0:999"),
            (("dlq", "replay", refs[2]), "it was discarded"),
            (("dlq", "show", f"{dlq}:7:0"), "no record"),
            (("dlq", "list", "--dlq-topic", dlq, "--limit", "0"), "limit must be between"),
            (("dlq", "replay"), "give the record references"),
            (("lag",), "no consumer group"),
        ]:
            bad = _cli(*args, **env)
            assert bad.returncode == 2, (args, bad.stdout, bad.stderr)
            (line,) = bad.stderr.strip().splitlines()
            assert message in line and "Traceback" not in bad.stderr, (args, line)
    finally:
        await a.aclose()
        await b.aclose()


def _audit_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM ledgerbox_ops_audit")).scalar_one())


async def test_a_second_discard_and_a_missing_inbox_table_are_refused_without_an_audit_row(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any
) -> None:
    # Before: a second `dlq discard <ref>` exited 0 and wrote a second audit row (`relay dead
    # discard` refuses it, exit 2); `dlq replay --inbox-table nosuch --dry-run` said "would
    # replay 1" and audited it.
    dlq = await new_topic.acreate("ops-dlq-twice", partitions=1)
    headers = [
        ("ce_id", str(uuid.uuid4()).encode()),
        ("ce_type", b"OrderPlaced"),
        ("ledgerbox_error_type", b"Poison"),
        ("ledgerbox_error_message", b"no price"),
        ("ledgerbox_source_topic", b"orders"),
        ("ledgerbox_source_partition", b"0"),
        ("ledgerbox_source_offset", b"0"),
        ("ledgerbox_consumer_group", b"billing"),
    ]
    await produce(kafka_bootstrap, dlq, [(b"o-1", b"{}", headers), (b"o-2", b"{}", headers)])
    env = {"DATABASE_URL": database_url, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    first = _cli("dlq", "discard", f"{dlq}:0:0", **env)
    assert first.returncode == 0, first.stderr
    before = _audit_count(engine)
    for refs in ([f"{dlq}:0:0"], [f"{dlq}:0:1", f"{dlq}:0:0"]):
        again = _cli("dlq", "discard", *refs, **env)
        assert again.returncode == 2, again
        (line,) = again.stderr.strip().splitlines()
        assert line == (
            f"ledgerbox consumer dlq discard: cannot discard {dlq}:0:0: it was discarded "
            "already (a discard is final); nothing changed, nothing audited"
        ), line
    kafka = admin.KafkaSettings(bootstrap_servers=kafka_bootstrap)
    with pytest.raises(admin.RefusedError, match="discarded already"):
        await admin.discard_dlq_records(kafka, admin.Database(url=database_url), [f"{dlq}:0:0"])
    for dry in (["--dry-run"], []):
        for select in ([f"{dlq}:0:1"], ["--all-matching", "--dlq-topic", dlq, "--key", "o-2"]):
            replay = _cli("dlq", "replay", *select, "--inbox-table", "nosuch", *dry, **env)
            assert replay.returncode == 2, replay
            (line,) = replay.stderr.strip().splitlines()
            assert line.startswith(
                "ledgerbox consumer dlq replay: the inbox table nosuch does not exist in "
            ), line
            assert "give the consumer's table with --inbox-table and --schema" in line, line
    assert _audit_count(engine) == before
    listed = _cli("dlq", "list", "--dlq-topic", dlq, "--all", "--json", **env)
    assert [(r["ref"], r["state"]) for r in json.loads(listed.stdout)] == [
        (f"{dlq}:0:0", "discarded"),
        (f"{dlq}:0:1", "dead"),
    ]


async def test_a_discard_after_a_replay_cancels_it_or_is_refused_once_applied(
    database_url: str, engine: Engine, kafka_bootstrap: str, new_topic: Any
) -> None:
    """Newcomer review, 2026-12-04: `dlq replay` then `dlq discard` of the same record was
    accepted, the inbox row stayed REPLAY_REQUESTED, and the group ran the discarded event
    (a payment the operator gave up on was charged). Now the discard cancels a replay not
    applied yet (the row goes back to DEAD_LETTERED, the republished copy is acknowledged
    without running), and is refused - nothing changed, nothing audited - for a replay the
    group already applied."""
    topic = await new_topic.acreate("ops-dlq-cancel", partitions=1)
    dlq = await new_topic.acreate("ops-dlq-cancel-dlq", partitions=1)
    group = f"ops-cancel-{uuid.uuid4().hex[:6]}"
    broken = {"C1", "C2"}
    consumer = _consumer(database_url, kafka_bootstrap, topic, dlq, group, broken)
    events = [order_event(topic, order) for order in ("C1", "C2")]
    await produce(kafka_bootstrap, topic, events)
    kafka = admin.KafkaSettings(bootstrap_servers=kafka_bootstrap)
    db = admin.Database(url=database_url)
    source = await _read_all(kafka_bootstrap, topic, 2)
    assert await consumer.process_batch(source) == [Outcome.DEAD_LETTERED] * 2
    refs = [r.ref for r in await admin.list_dlq_records(kafka, db, admin.DlqFilter(dlq_topic=dlq))]
    broken.clear()  # the bug is fixed, but the operator gives C1 up after replaying it
    await admin.replay_dlq_records(kafka, db, refs, actor="alice")
    assert _inbox_status(engine, group, events[0].event_id) == InboxStatus.REPLAY_REQUESTED

    env = {"DATABASE_URL": database_url, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    out = _cli("dlq", "discard", refs[0], "--dry-run", "--actor", "cli", "--json", **env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["dry_run"], result["changed"], result["actor"]) == (True, 0, "cli")
    assert "operator action consumer.dlq.discard by cli" in out.stderr
    assert "dry_run=True" in out.stderr
    assert _inbox_status(engine, group, events[0].event_id) == InboxStatus.REPLAY_REQUESTED
    discarded = await admin.discard_dlq_records(kafka, db, [refs[0]], actor="bob")
    assert discarded.changed == 1
    assert _inbox_status(engine, group, events[0].event_id) == InboxStatus.DEAD_LETTERED
    copies = (await _read_all(kafka_bootstrap, topic, 4))[2:]
    assert await consumer.process_batch(copies) == [
        Outcome.ALREADY_DEAD_LETTERED,
        Outcome.APPLIED,
    ], "the discarded C1 does not run; C2's replay does"
    assert _applied(engine, group) == ["C2"]

    before = _audit_count(engine)
    for dry_run in (True, False):
        with pytest.raises(admin.RefusedError, match=f"group {group} applied it after a replay"):
            await admin.discard_dlq_records(kafka, db, [refs[1]], actor="bob", dry_run=dry_run)
    assert _audit_count(engine) == before, "nothing audited"
    assert _inbox_status(engine, group, events[1].event_id) == InboxStatus.DONE


async def test_a_source_topic_given_as_the_dlq_topic_is_named_as_such(
    database_url: str, kafka_bootstrap: str, new_topic: Any
) -> None:
    """A newcomer's review: ``dlq list --dlq-topic <the source topic>`` (".dlq" forgotten)
    listed every normal event as "dead", and a replay of one said it was "dead-lettered by
    an older ledgerbox". Now the list is refused in one line naming the likely mistake, and
    so is the replay."""
    topic = await new_topic.acreate("ops-dlq-source", partitions=1)
    await produce(kafka_bootstrap, topic, [order_event(topic, f"s{i}") for i in range(3)])
    env = {"DATABASE_URL": database_url, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    listed = _cli("dlq", "list", "--dlq-topic", topic, **env)
    assert listed.returncode == 2, listed.stdout + listed.stderr
    (line,) = listed.stderr.strip().splitlines()
    assert f"{topic} holds no dead-letter records" in line
    assert f"by default {topic}.dlq" in line and "Traceback" not in listed.stderr
    replay = _cli("dlq", "replay", f"{topic}:0:0", "--dry-run", **env)
    assert replay.returncode == 2, replay.stdout + replay.stderr
    assert "it is not a dead-letter record" in replay.stderr
