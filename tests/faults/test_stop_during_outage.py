"""SIGTERM during a Kafka outage: ``ledgerbox relay run`` and ``ledgerbox consumer run`` exit
within their documented bound (docs/operations.md, "Stopping during a Kafka outage"), cleanly
(exit 0, no traceback), and after Kafka is back a restarted daemon loses nothing: the relay
publishes every event in per-key order, the consumer applies every event once.

Real PostgreSQL and Kafka; the real CLIs in subprocesses, stopped as Kubernetes stops a pod
(SIGTERM, then SIGKILL after the grace period, 30 s by default). Before the bound neither
daemon exited within 90 s of SIGTERM with the broker down: the relay waited up to 65 s for
the confirmations of its batch in flight, then up to 35 s for the producer's flush; the
consumer, with an offset left to commit, waited until Kafka came back (aiokafka retries a
commit until it finds the group coordinator). With the bound: 8.2-8.3 s and 8.6 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncSession

from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer
from ledgerbox.inbox._config import STOP_TIMEOUT_S as CONSUMER_STOP_TIMEOUT_S
from ledgerbox.outbox import EventEnvelope
from ledgerbox.relay._config import STOP_TIMEOUT_S as RELAY_STOP_TIMEOUT_S
from tests import _relay_support as rs
from tests._inbox_support import committed, order_event, produce
from tests._services import TopicFactory
from tests.faults import test_inbox_failsafe as fs

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
APP = "tests.faults.test_stop_during_outage:app_from_env"

#: A fault-behaviour margin over the bound, not a benchmark: the machine is shared. Before
#: the bound neither daemon had exited 90 s after SIGTERM.
MARGIN_S = 10.0


def _services(script: str, command: str) -> None:
    subprocess.run(["bash", script, command], check=True, capture_output=True, timeout=180)


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ledgerbox", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _sigterm_and_time(proc: subprocess.Popen[bytes]) -> tuple[int, float]:
    """SIGTERM, then wait (SIGKILL after 90 s): ``(exit code, seconds until exit)``."""
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError("the daemon did not exit within 90 s of SIGTERM") from None
    return code, time.monotonic() - started


async def _until(check: object, what: str, within_s: float = 90) -> None:
    deadline = time.monotonic() + within_s
    while not await asyncio.to_thread(check):  # type: ignore[arg-type]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.3)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


async def _sigterm_in_outage(
    proc: subprocess.Popen[bytes],
    script: str,
    log: Path,
    during: Callable[[], Awaitable[None]],
) -> tuple[int, float, str]:
    """Stop Kafka, run ``during`` (the daemon must still run after it), SIGTERM the daemon
    and time its exit; Kafka is started again, also when a step fails. Returns
    ``(exit code, seconds from SIGTERM to exit, the daemon's log)``."""
    _services(script, "stop-kafka")
    try:
        await during()
        if proc.poll() is not None:
            raise AssertionError(await asyncio.to_thread(log.read_text))
        code, took_s = await asyncio.to_thread(_sigterm_and_time, proc)
    finally:
        _kill(proc)
        _services(script, "start-kafka")
    return code, took_s, await asyncio.to_thread(log.read_text)


# --------------------------------------------------------------------------- relay


def _relay_env(database_url: str, kafka: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGERBOX_")}
    # Default publishing settings (request_timeout_ms 30 s...); only the leases are short so
    # the restarted relay takes the shards over at once.
    env.update(
        DATABASE_URL=database_url,
        KAFKA_BOOTSTRAP_SERVERS=kafka,
        LEDGERBOX_RELAY_LEASE_TTL_S="3",
        LEDGERBOX_RELAY_HEARTBEAT_INTERVAL_S="0.5",
        LEDGERBOX_RELAY_POLL_INTERVAL_S="0.2",
    )
    return env


async def test_relay_stopped_while_kafka_is_down_exits_within_the_bound(
    engine: Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: TopicFactory,
    services_script: str,
    tmp_path: Path,
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("stop-relay", partitions=3)
    writer = rs.writer_for(topic)
    keys, seq = 6, [0] * 6

    def stage(per_key: int) -> None:
        events = []
        for _ in range(per_key):
            for k in range(keys):
                events.append(rs.event(writer, f"k{k}", seq[k]))
                seq[k] += 1
        rs.stage(engine, writer, events)

    env = _relay_env(database_url, kafka_bootstrap)
    log = tmp_path / "relay.log"
    stage(5)
    proc = _start(["relay", "run"], env, log)

    async def outage() -> None:
        # Events committed during the outage: the relay claims them and hands them to the
        # producer, which cannot deliver them (in flight when SIGTERM comes).
        stage(5)
        await asyncio.sleep(5)

    try:
        await _until(lambda: len(rs.published_ids(engine, topic)) == 30, "30 events published")
        code, took_s, text = await _sigterm_in_outage(proc, services_script, log, outage)
    finally:
        _kill(proc)
    print(f"relay: SIGTERM -> exit {code} in {took_s:.1f} s (bound {RELAY_STOP_TIMEOUT_S} s)")
    assert code == 0, text
    assert "Traceback" not in text, text
    assert took_s < RELAY_STOP_TIMEOUT_S + MARGIN_S, (took_s, text)
    assert re.search(r" INFO ledgerbox\.relay relay \S+ stopped$", text.splitlines()[-1]), text

    # Kafka is back: a restarted relay publishes everything, the unconfirmed ones again.
    stage(2)
    total = sum(seq)
    proc = _start(["relay", "run"], env, tmp_path / "relay-2.log")
    try:
        await _until(lambda: rs.pending_count(engine) == 0, "nothing pending", 120)
        code, _ = await asyncio.to_thread(_sigterm_and_time, proc)
    finally:
        _kill(proc)
    text = (tmp_path / "relay-2.log").read_text()
    assert code == 0 and "Traceback" not in text, text
    assert "stop_timeout_s" not in text, text  # Kafka up: nothing of the stop was cut short
    records = await rs.consume(
        kafka_bootstrap, topic, until=lambda r: len({rs.header(x, "ce_id") for x in r}) >= total
    )
    by_key: dict[str, list[int]] = {}
    for record in records:
        by_key.setdefault((record.key or b"").decode(), []).append(
            json.loads(record.value or b"")["seq"]
        )
    for k in range(keys):
        firsts = list(dict.fromkeys(by_key.get(f"k{k}", [])))
        assert firsts == list(range(seq[k])), (f"k{k}", by_key.get(f"k{k}"))


# --------------------------------------------------------------------------- consumer


def _config_from_env(**settings: Any) -> ConsumerConfig:
    """The test apps' consumer: ``FS_*`` and ``KAFKA_BOOTSTRAP_SERVERS`` from the environment,
    one record per transaction, and ``settings``."""
    env = os.environ
    return ConsumerConfig(
        group_id=env["FS_GROUP"],
        topics=[env["FS_TOPIC"]],
        database_url=env["FS_DATABASE_URL"],
        kafka_bootstrap_servers=env["KAFKA_BOOTSTRAP_SERVERS"],
        batch_max_records=1,
        **settings,
    )


def app_from_env() -> InboxConsumer:
    """``consumer run --app`` factory: ``fs_payments`` inserts, one record per transaction,
    each handler call ``STOP_DELAY_S`` long, so that records fetched before the outage are
    still being applied (and their offsets not committed) when Kafka goes away."""
    consumer = InboxConsumer(_config_from_env())
    delay_s = float(os.environ.get("STOP_DELAY_S", "0"))

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        await asyncio.sleep(delay_s)
        await ctx.session.execute(
            sa.insert(fs.payments).values(
                consumer_group=ctx.group_id,
                order_id=event.payload["order_id"],
                amount=Decimal(event.payload["amount"]),
            )
        )

    return consumer


async def _produce(bootstrap: str, topic: str, orders: list[str]) -> None:
    for partition in (0, 1):
        events = [order_event(topic, o) for o in orders[partition::2]]
        await produce(bootstrap, topic, events, partition=partition)


async def test_consumer_stopped_while_kafka_is_down_exits_within_the_bound(
    engine: Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: TopicFactory,
    services_script: str,
    tmp_path: Path,
) -> None:
    fs.metadata.create_all(engine)
    topic = await new_topic.acreate("stop-consumer", partitions=2)
    group = f"stop-{uuid.uuid4().hex[:8]}"
    env = {**fs.base_env(database_url, kafka_bootstrap, topic, group), "STOP_DELAY_S": "0.25"}
    first = [f"A{i}" for i in range(80)]
    await _produce(kafka_bootstrap, topic, first)
    log = tmp_path / "consumer.log"
    proc = _start(["consumer", "run", "--app", APP], env, log)
    applied_in_outage = 0

    async def outage() -> None:
        # Records fetched before the outage are applied meanwhile; their offset commits and
        # the group's heartbeats fail.
        nonlocal applied_in_outage
        await asyncio.sleep(3)
        applied_in_outage = len(_paid(engine, group))

    try:
        await _until(lambda: len(_paid(engine, group)) >= 4, "the first orders applied")
        code, took_s, text = await _sigterm_in_outage(proc, services_script, log, outage)
    finally:
        _kill(proc)
    print(
        f"consumer: SIGTERM -> exit {code} in {took_s:.1f} s (bound {CONSUMER_STOP_TIMEOUT_S} s),"
        f" {applied_in_outage} of 80 applied"
    )
    assert code == 0, text
    assert "Traceback" not in text, text
    assert took_s < CONSUMER_STOP_TIMEOUT_S + MARGIN_S, (took_s, text)
    assert applied_in_outage < 80  # stopped with records left: the restart must apply them

    # Kafka is back: a restarted consumer applies the rest once, and the records applied
    # whose offsets were not committed are recognised by the inbox (never applied twice).
    second = [f"B{i}" for i in range(10)]
    await _produce(kafka_bootstrap, topic, second)
    log2 = tmp_path / "consumer-2.log"
    proc = _start(["consumer", "run", "--app", APP], {**env, "STOP_DELAY_S": "0"}, log2)
    try:
        await _until(lambda: len(_paid(engine, group)) >= 90, "all 90 orders applied", 120)
        await asyncio.sleep(1)  # a duplicate would be applied by now
        code, _ = await asyncio.to_thread(_sigterm_and_time, proc)
    finally:
        _kill(proc)
    text = log2.read_text()
    assert code == 0 and "Traceback" not in text, text
    assert "stop_timeout_s" not in text, text  # Kafka up: nothing of the stop was cut short
    assert sorted(_paid(engine, group)) == sorted(first + second)
    # ... and its final commit (on SIGTERM, Kafka up) passed every record.
    assert [await committed(kafka_bootstrap, group, topic, p) for p in (0, 1)] == [45, 45]


def _paid(engine: Engine, group: str) -> list[str]:
    with engine.connect() as conn:
        return [
            str(order)
            for order in conn.execute(
                sa.select(fs.payments.c.order_id).where(fs.payments.c.consumer_group == group)
            ).scalars()
        ]


# ------------------------------------------------- consumer, dead-letter send in flight


def dlq_app_from_env() -> InboxConsumer:
    """``consumer run --app`` factory: ``fs_payments`` inserts; an order whose id starts
    with ``P`` is declined for good (dead-lettered), ``PW...`` only once the file
    ``DLQ_GO`` exists (its handler writes ``DLQ_ENTERED`` when it starts waiting): so the
    dead-letter producer is started by the first poison record and the second one's send
    is in flight when the broker is away."""
    env = os.environ
    consumer = InboxConsumer(
        _config_from_env(
            dead_letter_topic=env["FS_DLQ"],
            dead_letter_on=(fs.PaymentDeclined,),
            stop_timeout_s=float(env["STOP_TIMEOUT_S"]),
        )
    )
    go, entered = Path(env["DLQ_GO"]), Path(env["DLQ_ENTERED"])

    @consumer.handler("OrderPlaced")
    async def pay(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
        order = str(event.payload["order_id"])
        if order.startswith("PW"):
            await asyncio.to_thread(entered.touch)
            await _until(go.exists, "the test's go", 300)
        if order.startswith("P"):
            raise fs.PaymentDeclined(f"order {order} declined")
        await ctx.session.execute(
            sa.insert(fs.payments).values(
                consumer_group=ctx.group_id,
                order_id=order,
                amount=Decimal(event.payload["amount"]),
            )
        )

    return consumer


async def test_consumer_stopped_while_a_dead_letter_send_waits_for_kafka_exits_within_the_bound(
    engine: Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: TopicFactory,
    services_script: str,
    tmp_path: Path,
) -> None:
    """Before the bound on the send in flight the consumer had not exited 90 s after SIGTERM
    (the dead-letter send waited out its request timeout, then was retried until abandoned,
    then the producer's close waited for its flush); with it: 6.6 s (stop_timeout_s 3)."""
    fs.metadata.create_all(engine)
    topic = await new_topic.acreate("stop-dlq", partitions=1)
    dlq = await new_topic.acreate("stop-dlq-dlq", partitions=1)
    group = f"stop-dlq-{uuid.uuid4().hex[:8]}"
    stop_timeout_s = 3.0
    env = {
        **fs.base_env(database_url, kafka_bootstrap, topic, group),
        "FS_DLQ": dlq,
        "STOP_TIMEOUT_S": str(stop_timeout_s),
        "DLQ_GO": str(tmp_path / "go"),
        "DLQ_ENTERED": str(tmp_path / "entered"),
    }
    await produce(kafka_bootstrap, topic, [order_event(topic, o) for o in ("P1", "A1", "PW2")])
    app = "tests.faults.test_stop_during_outage:dlq_app_from_env"
    log = tmp_path / "consumer.log"
    proc = _start(["consumer", "run", "--app", app], env, log)

    async def outage() -> None:
        (tmp_path / "go").touch()  # PW2 is declined now: its dead-letter send waits
        await asyncio.sleep(2)

    try:
        # P1 dead-lettered (the producer is started), A1 applied, PW2's handler waiting.
        await _until(lambda: (tmp_path / "entered").exists(), "PW2's handler entered")
        assert _paid(engine, group) == ["A1"], log.read_text()
        code, took_s, text = await _sigterm_in_outage(proc, services_script, log, outage)
    finally:
        _kill(proc)
    # The send's grace, then the commit's and the client's stop (docs/operations.md).
    bound_s = 2 * stop_timeout_s + 1
    print(f"consumer (dead-letter send in flight): SIGTERM -> exit {code} in {took_s:.1f} s")
    assert code == 0, text
    assert "Traceback" not in text, text
    assert took_s < bound_s + MARGIN_S, (took_s, text)

    # Kafka is back: the restarted consumer dead-letters PW2 (the first send was given up
    # or may have been stored: at least once), applies nothing twice and commits past it.
    proc = _start(["consumer", "run", "--app", app], env, tmp_path / "consumer-2.log")
    try:
        await _until(
            lambda: asyncio.run(committed(kafka_bootstrap, group, topic, 0)) == 3,
            "the offset past PW2 committed",
            120,
        )
        code, _ = await asyncio.to_thread(_sigterm_and_time, proc)
    finally:
        _kill(proc)
    text = (tmp_path / "consumer-2.log").read_text()
    assert code == 0 and "Traceback" not in text, text
    assert _paid(engine, group) == ["A1"]
    orders = [
        json.loads(r.value or b"")["order_id"]
        for r in await rs.consume(kafka_bootstrap, dlq, until=lambda r: len(r) >= 2)
    ]
    assert orders[0] == "P1" and set(orders[1:]) == {"PW2"}, orders
