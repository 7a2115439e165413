"""G3 (per-key order): two ways a key's events reached Kafka out of commit order.

A refused record batch. The relay packs a send's records into one record batch per
partition, and a batch that fills up is followed by another: the events of one key can
travel in two record batches. Kafka accepts or refuses each record batch on its own. Before
2026-12-04 a later batch of a partition went out although an earlier one had been refused:
its records (later events of the same key) were confirmed and passed by the cursor while the
refused event was dead-lettered (``hold`` promised to keep them) or re-sent with a new
timestamp (C19) - Kafka order for the key became [2, 3, 1].

The id taken before the lock. The relay publishes a claim's rows in id order; the writer
inserted a flush's outbox rows BEFORE the unit of work's UPDATE of the aggregate, so a
writer took its id, then waited for the row lock of a second writer that committed first:
commit order [T2, T1], Kafka order [T1, T2] when one claim saw both.

Both found by an adversarial review (2026-12-02). Real PostgreSQL and Apache Kafka.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import threading
import time
import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from sqlalchemy import Engine, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from ledgerbox import admin
from ledgerbox.outbox import EventEnvelope, OutboxWriter, TopicRouter
from ledgerbox.relay import Relay
from tests import _relay_support as rs

pytestmark = pytest.mark.timeout(240)


class _Base(DeclarativeBase):
    pass


class _Account(_Base):
    """An aggregate row that writers lock by updating it."""

    __tablename__ = "g3_account"
    id: Mapped[str] = mapped_column(primary_key=True)
    balance: Mapped[int]


@pytest.fixture(scope="module", autouse=True)
def _tables(engine: Engine) -> None:
    _Base.metadata.create_all(engine)


#: The topic's ``max.message.bytes`` in the size test: one record batch of the relay holds
#: up to 256 KiB (``max_batch_bytes``), so a 300 KB event and a 100 KB one travel in two.
LIMIT = 150_000


def _blob(n_bytes: int) -> str:
    """``n_bytes`` of base64 text of random bytes: lz4 cannot shrink it."""
    return base64.b64encode(os.urandom(n_bytes * 3 // 4)).decode()


def _event(
    writer: OutboxWriter, key: str, seq: int, blob_bytes: int = 0, label: str = "", **kw: object
) -> EventEnvelope:
    payload: dict[str, object] = {"seq": seq, "label": label}
    if blob_bytes:
        payload["blob"] = _blob(blob_bytes)
    return writer.event(
        event_type="Sized",
        aggregate_type="thing",
        aggregate_id=key,
        aggregate_version=seq,
        payload=payload,
        idempotency_key=f"{key}:{seq}:{uuid.uuid4().hex}",
        **kw,  # type: ignore[arg-type]
    )


def _stage_one_tx(engine: Engine, writer: OutboxWriter, events: list[EventEnvelope]) -> list[int]:
    with Session(engine) as session, session.begin():
        writer.stage_many(session, events)
    with engine.connect() as conn:
        return [
            int(i)
            for i in conn.execute(
                text("SELECT id FROM outbox WHERE event_id = ANY(:ids) ORDER BY id"),
                {"ids": [e.event_id for e in events]},
            ).scalars()
        ]


def _statuses(engine: Engine, ids: list[int]) -> list[int]:
    with engine.connect() as conn:
        by_id = dict(
            conn.execute(
                text("SELECT id, status FROM outbox WHERE id = ANY(:ids)"), {"ids": ids}
            ).all()
        )
    return [int(by_id[i]) for i in ids]


async def _drain(relay: Relay, rounds: int = 10) -> None:
    for _ in range(rounds):
        if not await relay.run_once():
            return


async def _relay_until_idle(
    database_url: str, kafka_bootstrap: str, topic: str, count: int
) -> list:  # type: ignore[type-arg]
    """Run a relay until it finds nothing more, then read ``count`` records of ``topic``."""
    relay = Relay(rs.config(database_url, kafka_bootstrap))
    try:
        await _drain(relay)
    finally:
        await relay.aclose()
    return await rs.consume(kafka_bootstrap, topic, until=lambda got: len(got) >= count)


async def _set_topic_config(bootstrap: str, topic: str, configs: dict[str, str]) -> None:
    client = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await client.start()
    try:
        await client.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs)])
    finally:
        await client.close()


def _seqs(records: list) -> list[int]:  # type: ignore[type-arg]
    return [json.loads(r.value)["seq"] for r in records]


async def test_g3_a_refused_record_batch_holds_the_keys_events_of_a_later_batch(
    engine: Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """One transaction, three events of one key: E1 (300 KB) over the topic's
    ``max.message.bytes``, E2 (100 KB) and E3 (small) in the next record batch. E1 is
    dead-lettered; with ``hold`` E2 and E3 are held, not published; after the limit is
    raised and E1 replayed, the key's records on Kafka are exactly [1, 2, 3]."""
    rs.reset_relay_tables(engine)
    topic = f"g3-split-{uuid.uuid4().hex[:8]}"
    await rs.create_topic(kafka_bootstrap, topic, {"max.message.bytes": str(LIMIT)})
    writer = OutboxWriter(TopicRouter(default=topic), source="/g3", max_payload_bytes=1 << 20)
    ids = _stage_one_tx(
        engine,
        writer,
        [_event(writer, "k", 1, 300_000), _event(writer, "k", 2, 100_000), _event(writer, "k", 3)],
    )
    relay = Relay(rs.config(database_url, kafka_bootstrap))
    try:
        await _drain(relay)
        assert _statuses(engine, ids) == [2, 3, 3], "E1 dead, E2 and E3 held behind it"

        await _set_topic_config(kafka_bootstrap, topic, {"max.message.bytes": str(2 << 20)})
        db = admin.Database(url=database_url)
        done = await admin.replay_dead_events(db, [ids[0]], actor="g3-test")
        assert done.changed == 3
        await _drain(relay)
    finally:
        await relay.aclose()
    records = await rs.consume(kafka_bootstrap, topic, until=lambda got: len(got) >= 3)
    assert _seqs(records) == [1, 2, 3], "nothing of the key went out before its refused event"


async def test_g3_c19_a_restamped_event_keeps_its_place_before_a_later_record_batch(
    engine: Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """C19 in a split send: E1 dated 2 h ahead (the broker refuses its timestamp), E2 (300 KB,
    a record batch of its own) and E3. E1 is re-sent with the send time; E2 and E3 must
    not be confirmed before it: the key's records on Kafka are [1, 2, 3]."""
    rs.reset_relay_tables(engine)
    topic = f"g3-c19-{uuid.uuid4().hex[:8]}"
    await rs.create_topic(kafka_bootstrap, topic, {"message.timestamp.after.max.ms": "60000"})
    writer = OutboxWriter(
        TopicRouter(default=topic), source="/g3", max_future_s=None, max_payload_bytes=1 << 20
    )
    future = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)
    ids = _stage_one_tx(
        engine,
        writer,
        [
            _event(writer, "k", 1, occurred_at=future),
            _event(writer, "k", 2, 300_000),
            _event(writer, "k", 3),
        ],
    )
    records = await _relay_until_idle(database_url, kafka_bootstrap, topic, 3)
    assert _seqs(records) == [1, 2, 3]
    assert _statuses(engine, ids) == [0, 0, 0], "nothing dead-lettered, nothing held"


def _wait_for_lock_wait(engine: Engine, within_s: float = 30.0) -> None:
    """Until a backend of this database waits for a row lock."""
    deadline = time.monotonic() + within_s
    with engine.connect() as conn:
        while True:
            waiting = conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND datname = current_database()"
                )
            ).scalar_one()
            if waiting:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("no backend waits for a lock")
            time.sleep(0.02)
            conn.rollback()


async def test_g3_writers_serialized_on_the_aggregate_row_are_published_in_commit_order(
    engine: Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """T2 updates account A (row lock) and keeps its transaction open. T1 changes A through
    the ORM and stages event "t1" in the same flush; its UPDATE waits for T2's lock. T2 then
    stages "t2" and commits; T1 goes on and commits. Commit order [T2, T1]: the relay, one
    claim seeing both, publishes ["t2", "t1"]. Before 2026-12-04 the flush inserted T1's
    outbox row (its id) before its UPDATE blocked: ["t1", "t2"]."""
    rs.reset_relay_tables(engine)
    topic = f"g3-lock-{uuid.uuid4().hex[:8]}"
    await rs.create_topic(kafka_bootstrap, topic, {})
    writer = OutboxWriter(TopicRouter(default=topic), source="/g3")
    key = f"acct-{uuid.uuid4().hex[:8]}"
    with Session(engine) as session, session.begin():
        session.add(_Account(id=key, balance=0))

    def deposit(session: Session, label: str) -> None:
        account = session.get(_Account, key)
        assert account is not None
        account.balance = _Account.balance + 10  # type: ignore[assignment]
        writer.stage(session, _event(writer, key, 1 if label == "t1" else 2, label=label))

    t2 = Session(engine)
    t2.begin()
    account = t2.get(_Account, key)
    assert account is not None
    account.balance = _Account.balance + 1  # type: ignore[assignment]
    t2.flush()  # T2 holds A's row lock

    failures: list[BaseException] = []

    def t1_work() -> None:
        try:
            with Session(engine) as t1, t1.begin():
                deposit(t1, "t1")  # its commit's flush waits for T2's lock
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)

    thread = threading.Thread(target=t1_work)
    thread.start()
    try:
        _wait_for_lock_wait(engine)
        deposit(t2, "t2")
        t2.commit()
    finally:
        t2.close()
        thread.join(60)
    assert not failures, failures
    records = await _relay_until_idle(database_url, kafka_bootstrap, topic, 2)
    assert [json.loads(r.value)["label"] for r in records] == ["t2", "t1"]
