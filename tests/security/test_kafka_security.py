"""The whole chain over secured Kafka: events written to the outbox, published by `ledgerbox relay
run`, applied by `ledgerbox consumer run`, the poison one on the dead-letter topic, over SASL_SSL
with SCRAM-SHA-512, over mTLS and over SASL_SSL with OAUTHBEARER (the real CLIs, the real broker);
and what a user sees when a setting is wrong: one line, exit 2, one login attempt, no traceback
(docs/security.md)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ledgerbox.outbox import OutboxWriter, TopicRouter
from tests._services import TopicFactory
from tests.security import _support as s

pytestmark = pytest.mark.timeout(180)

APP = ["--app", "tests.security._support:consumer_from_env"]
FAST_RELAY = {
    "LEDGERBOX_RELAY_LEASE_TTL_S": "3",
    "LEDGERBOX_RELAY_HEARTBEAT_INTERVAL_S": "0.5",
    "LEDGERBOX_RELAY_POLL_INTERVAL_S": "0.2",
}
DESCRIBED = {
    "scram": "(SASL_SSL, SCRAM-SHA-512 as 'ledgerbox')",
    "mtls": "(SSL, client certificate)",
    "oauth": "(SASL_SSL, OAUTHBEARER token)",
}


def stage_orders(engine: Engine, topic: str, placed: int, rejected: int) -> list[str]:
    writer = OutboxWriter(TopicRouter(default=topic), source="/security-tests")
    ids = [f"o{i}-{uuid.uuid4().hex[:6]}" for i in range(placed + rejected)]
    with Session(engine) as session, session.begin():
        for i, order in enumerate(ids):
            kind = "OrderPlaced" if i < placed else "OrderRejected"
            writer.stage(
                session,
                writer.event(
                    event_type=kind,
                    aggregate_type="order",
                    aggregate_id=order,
                    payload={"order_id": order, "amount": "12.50"},
                    idempotency_key=f"{order}:{kind}",
                ),
            )
    return ids


def applied(engine: Engine, group: str) -> int:
    with engine.connect() as conn:
        query = sa.select(sa.func.count()).where(s.orders.c.consumer_group == group)
        return int(conn.execute(query).scalar_one())


async def until(check: Any, what: str, within_s: float = 90) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.3)


@pytest.mark.parametrize("kind", ["scram", "mtls", "oauth"])
async def test_the_whole_chain_runs_over_the_secured_listener(
    kind: str,
    sec: s.Secured,
    database_url: str,
    business: Engine,
    new_topic: TopicFactory,
    tmp_path: Path,
) -> None:
    topic = await new_topic.acreate(f"sec-{kind}", partitions=3)
    dlq = await new_topic.acreate(f"sec-{kind}-dlq", partitions=1)
    group = f"sec-{kind}-{uuid.uuid4().hex[:6]}"
    stage_orders(business, topic, placed=5, rejected=1)
    kafka_env = sec.env(kind)
    relay_log, consumer_log = tmp_path / "relay.log", tmp_path / "consumer.log"
    relay = s.start(
        ["relay", "run"], s.clean_env(DATABASE_URL=database_url, **kafka_env, **FAST_RELAY),
        relay_log,
    )  # fmt: skip
    consumer_env = s.clean_env(
        SEC_GROUP=group, SEC_TOPIC=topic, SEC_DLQ=dlq, SEC_DATABASE_URL=database_url, **kafka_env
    )
    consumer = s.start(["consumer", "run", *APP], consumer_env, consumer_log)
    try:
        await until(lambda: applied(business, group) == 5, "5 orders applied")
        # The dead-lettered record, read back over the same secured listener.
        (record,) = await s.read_topic(sec.kafka(kind), dlq, want=1)
        headers = dict(record.headers)
        assert headers["ledgerbox_error_type"] == b"tests.security._support.OrderRejected"
        assert headers["ledgerbox_source_topic"] == topic.encode()
        code, out = await asyncio.to_thread(
            s.run, ["consumer", "check", *APP], consumer_env
        )  # the checks log in the same way
        health, *lag = out.strip().splitlines()
        assert (code, health) == (0, "ok"), out
        # The group's lag is read over the same secured listener (consumer check with --app).
        assert lag and lag[-1].startswith("lag of group ") and "unavailable" not in out, out
    finally:
        codes = (s.stop(relay), s.stop(consumer))
    logs = relay_log.read_text() + consumer_log.read_text()
    assert codes == (0, 0), logs
    assert "Traceback" not in logs, logs
    # One ERROR: the poison record. (A broker started moments ago may still be creating
    # __consumer_offsets: aiokafka logs its GroupCoordinatorNotAvailable once; not ours.)
    errors = [
        line
        for line in logs.splitlines()
        if " ERROR " in line and "GroupCoordinatorNotAvailableError" not in line
    ]
    assert len(errors) == 1 and "dead-lettered to" in errors[0], logs
    assert f"kafka {kafka_env['KAFKA_BOOTSTRAP_SERVERS']} {DESCRIBED[kind]}" in logs, logs


@pytest.mark.parametrize("command", [["relay", "run"], ["consumer", "run", *APP]])
async def test_a_wrong_password_exits_2_with_one_line_after_one_login(
    command: list[str], sec: s.Secured, database_url: str, business: Engine, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-kafka-password\n")
    async with s.CountingProxy(sec.sasl_ssl) as proxy:
        kafka = {
            **sec.env("scram", password_file=str(wrong)),
            "KAFKA_BOOTSTRAP_SERVERS": proxy.address,
        }
        env = s.clean_env(
            DATABASE_URL=database_url,
            SEC_GROUP="g-wrong",
            SEC_TOPIC="t-wrong",
            SEC_DATABASE_URL=database_url,
            **kafka,
        )
        started = time.monotonic()
        code, out = await asyncio.to_thread(s.run, command, env)
        took_s = time.monotonic() - started
    prefix = "ledgerbox relay: " if command[0] == "relay" else "ledgerbox consumer run: "
    assert code == 2, out
    assert s.lines(out) == [
        f"{prefix}kafka at {proxy.address} refused the login of SASL user 'ledgerbox' "
        "(SCRAM-SHA-512, SaslAuthenticationFailed): fix kafka_sasl_username or "
        "kafka_sasl_password"
    ]
    assert "Traceback" not in out and "not-the-kafka-password" not in out
    assert proxy.logins == 1, f"{proxy.logins} logins: a retry storm"
    assert proxy.connections <= 2  # and a TCP reachability check before it
    assert took_s < 30


@pytest.mark.parametrize(
    ("listener", "extra", "says"),
    [
        (
            "sasl_ssl",
            {},
            "speaks TLS but security_protocol is PLAINTEXT: set kafka_security_protocol to SSL "
            "or SASL_SSL (and kafka_ssl_cafile)",
        ),
        (
            "mtls",
            {"KAFKA_SECURITY_PROTOCOL": "SSL"},
            "has a TLS certificate this client does not trust (unable to get local issuer "
            "certificate): set kafka_ssl_cafile to the CA that signed the brokers' certificates "
            "(and connect by a name the certificate holds)",
        ),
        (
            "mtls",
            {"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CAFILE": "ca"},
            "closed the connection after the TLS handshake: it may require a client certificate "
            "(set kafka_ssl_certfile and kafka_ssl_keyfile) or a SASL login "
            "(kafka_security_protocol SASL_SSL)",
        ),
    ],
    ids=["plaintext-to-sasl-ssl", "no-ca", "no-client-certificate"],
)
async def test_a_client_the_listener_refuses_sees_one_line(
    listener: str,
    extra: dict[str, str],
    says: str,
    sec: s.Secured,
    database_url: str,
    business: Engine,
) -> None:
    address = sec.sasl_ssl if listener == "sasl_ssl" else sec.mtls
    settings = {k: (sec.ca if v == "ca" else v) for k, v in extra.items()}
    env = s.clean_env(DATABASE_URL=database_url, KAFKA_BOOTSTRAP_SERVERS=address, **settings)
    code, out = await asyncio.to_thread(s.run, ["relay", "check"], env)
    assert code == 2 and s.lines(out) == [f"relay down: kafka at {address} {says}"], out
    code, out = await asyncio.to_thread(s.run, ["relay", "run"], env)
    assert code == 2 and s.lines(out) == [f"ledgerbox relay: kafka at {address} {says}"], out
    args = ["--database-url", database_url]
    code, out = await asyncio.to_thread(s.run, ["consumer", "check", *args], env)
    assert code == 2 and s.lines(out) == [f"down: kafka at {address} {says}"], out


async def test_the_plaintext_listener_stays_for_plaintext_clients(
    kafka_bootstrap: str, database_url: str, business: Engine
) -> None:
    env = s.clean_env(DATABASE_URL=database_url, KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap)
    code, out = await asyncio.to_thread(s.run, ["relay", "check"], env)
    assert code == 0 and out.startswith("relay ok:"), out
