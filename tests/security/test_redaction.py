"""Nothing secret is ever printed (docs/security.md, "What is never printed"): a whole chain runs
with planted secrets (the database passwords of the relay's and the consumer's roles, the Redis
ACL password, the SASL password, an OAUTHBEARER token, a key passphrase, and wrong passwords
too) and EVERYTHING captured is searched for them: the output of every command (`check`,
`status`, `run` at DEBUG with the drivers' log records, the one-line refusals), both daemons'
`/metrics`, and in this process the messages and reprs of the errors and configs.

The commands run with the redaction safety net OFF (tests/unscrubbed_entry.py): what is searched
is what the sources print, so a message built with a secret fails here even though production
would mask it. Found and fixed at the source by this test: the reprs of RelayConfig and
ConsumerConfig showed the database and Redis URLs with their passwords."""

from __future__ import annotations

import asyncio
import os
import socket
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine, make_url

from ledgerbox import BrokerError, DatabaseError, LedgerboxError
from ledgerbox.inbox import (
    ConsumerConfig,
    KafkaSettings,
    RedisDedupStore,
    RedisUnavailableError,
    Secret,
)
from ledgerbox.inbox._checks import check_consumer
from ledgerbox.inbox._redis import redis_client
from ledgerbox.relay import KafkaPublisher, RelayConfig
from ledgerbox.relay._pgstore import pg_store_factory
from tests._roles import Roles, doc_roles, execute
from tests._services import TopicFactory
from tests.security import _support as s
from tests.security.test_kafka_security import FAST_RELAY, applied, stage_orders, until

pytestmark = pytest.mark.timeout(300)

APP = ["--app", "tests.security._support:consumer_from_env"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Planted:
    """The secrets of one run, and every form they could leak in."""

    def __init__(self, sec: s.Secured) -> None:
        def fresh() -> str:
            return uuid.uuid4().hex[:10]

        nonce = fresh()
        self.nonce = nonce
        # Characters that URLs must percent-encode, so both forms are searched (and each
        # part of them: an unencoded one may be cut at a "/" or "#" by a URL parser).
        self.relay_db = f"Rdb#{fresh()}/p@ss{fresh()}"
        self.consumer_db = f"Cdb?{fresh()}:pa ss{fresh()}"
        self.wrong_db = f"wrong-db-{fresh()}"
        self.wrong_sasl = f"wrong-sasl-{fresh()}"
        self.wrong_redis = f"wrong-redis-{fresh()}"
        os.environ["SEC_TOKEN_NONCE"] = nonce  # this process computes the same token
        try:
            self.token = s.unsecured_jwt(s.planted_token_claims())
        finally:
            del os.environ["SEC_TOKEN_NONCE"]
        self.values = {
            "relay database password": self.relay_db,
            "consumer database password": self.consumer_db,
            "wrong database password": self.wrong_db,
            "SASL password": sec.sasl_password,
            "wrong SASL password": self.wrong_sasl,
            "Redis password": sec.redis_password,
            "wrong Redis password": self.wrong_redis,
            "key passphrase": sec.key_password,
            "OAUTHBEARER token": self.token,
            "OAUTHBEARER token claims": self.token.split(".")[1],
        }

    def forms(self) -> Iterator[tuple[str, str]]:
        for what, value in self.values.items():
            yield what, value
            quoted = urllib.parse.quote(value, safe="")
            if quoted != value:
                yield f"{what} (URL-encoded)", quoted
            for part in value.replace("#", "/").replace("?", "/").replace("@", "/").split("/"):
                if len(part) >= 8 and part != value:
                    yield f"{what} (the part {part!r})", part

    def find(self, text: str) -> list[str]:
        return [what for what, value in self.forms() if value in text]


@pytest.fixture
def planted(sec: s.Secured) -> Planted:
    return Planted(sec)


@pytest.fixture
def roles(database_url: str, business: Engine, planted: Planted) -> Iterator[Roles]:
    passwords = {"relay": planted.relay_db, "consumer": planted.consumer_db, "app": "app-pw"}
    with doc_roles(database_url, passwords) as made:
        execute(
            database_url, f"GRANT SELECT, INSERT, UPDATE ON sec_orders TO {made.names['consumer']}"
        )
        yield made


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


async def test_a_full_run_never_prints_a_planted_secret(
    sec: s.Secured,
    planted: Planted,
    roles: Roles,
    database_url: str,
    business: Engine,
    new_topic: TopicFactory,
    tmp_path: Path,
) -> None:
    captured: list[tuple[str, str]] = []  # (what ran, everything it printed)
    topic = await new_topic.acreate("sec-redact", partitions=2)
    dlq = await new_topic.acreate("sec-redact-dlq", partitions=1)
    group = f"sec-redact-{uuid.uuid4().hex[:6]}"
    stage_orders(business, topic, placed=4, rejected=1)
    relay_url = roles.urls["relay"]
    consumer_url = roles.urls["consumer"] + f"?sslmode=verify-full&sslrootcert={sec.ca}"
    # The relay logs in with the password as a VALUE (variable), not a file.
    scram = {**sec.env("scram"), "KAFKA_SASL_PASSWORD": sec.sasl_password}
    del scram["KAFKA_SASL_PASSWORD_FILE"]
    relay_env = s.clean_env(DATABASE_URL=relay_url, **scram, **FAST_RELAY)
    consumer_env = s.clean_env(
        SEC_GROUP=group,
        SEC_TOPIC=topic,
        SEC_DLQ=dlq,
        SEC_DATABASE_URL=consumer_url,
        SEC_REDIS_URL=sec.redis_url(tls=True),
        SEC_REDIS_CAFILE=sec.ca,
        SEC_TOKEN_NONCE=planted.nonce,
        **sec.env("oauth"),
    )
    mtls = {**sec.env("mtls"), "KAFKA_SSL_KEY_PASSWORD": sec.key_password}
    del mtls["KAFKA_SSL_KEY_PASSWORD_FILE"]

    async def cli(what: str, args: list[str], env: dict[str, str], code: int | None) -> str:
        got, out = await asyncio.to_thread(s.run, args, env, entry=s.UNSCRUBBED)
        captured.append((what, out))
        assert code is None or got == code, (what, got, out)
        return out

    # Healthy commands.
    assert "relay ok" in await cli("relay check", ["relay", "check"], relay_env, 0)
    await cli("relay status", ["relay", "status"], relay_env, 0)
    health, *lag = (
        await cli("consumer check", ["consumer", "check", *APP], consumer_env, 0)
    ).splitlines()
    assert health == "ok" and lag and all(line.startswith("lag ") for line in lag), lag
    mtls_env = s.clean_env(DATABASE_URL=relay_url, **mtls)
    assert "relay ok" in await cli("relay check (mTLS)", ["relay", "check"], mtls_env, 0)

    # Both daemons at DEBUG (the drivers' log records included), with their metrics.
    relay_port, consumer_port = free_port(), free_port()
    relay_log, consumer_log = tmp_path / "relay.log", tmp_path / "consumer.log"
    debug = ["--log-level", "DEBUG"]
    relay = s.start(
        ["relay", "run", *debug, "--metrics-port", str(relay_port)],
        relay_env,
        relay_log,
        entry=s.UNSCRUBBED,
    )
    consumer = s.start(
        ["consumer", "run", *APP, *debug, "--metrics-port", str(consumer_port)],
        consumer_env,
        consumer_log,
        entry=s.UNSCRUBBED,
    )
    try:
        await until(lambda: applied(business, group) == 4, "4 orders applied")
        await s.read_topic(sec.kafka("oauth"), dlq, want=1)
        await asyncio.sleep(1.5)  # a few heartbeats, metadata refreshes, commits
        captured.append(("relay /metrics", _metrics(relay_port)))
        captured.append(("consumer /metrics", _metrics(consumer_port)))
    finally:
        codes = (s.stop(relay), s.stop(consumer))
    captured.append(("relay run", relay_log.read_text()))
    captured.append(("consumer run", consumer_log.read_text()))
    assert codes == (0, 0), captured[-2:]
    assert "Authenticated via OAUTHBEARER" in captured[-1][1]  # DEBUG really was on

    # Refusals: wrong passwords, an unparsable URL holding a password, unreachable hosts.
    wrong_db = make_url(relay_url).set(password=planted.wrong_db)
    env = {**relay_env, "DATABASE_URL": wrong_db.render_as_string(hide_password=False)}
    out = await cli("relay run, wrong database password", ["relay", "run"], env, 2)
    assert s.lines(out) == [line for line in s.lines(out) if "refused the login" in line], out
    env = {**relay_env, "KAFKA_SASL_PASSWORD": planted.wrong_sasl}
    out = await cli("relay run, wrong SASL password", ["relay", "run"], env, 2)
    assert "refused the login of SASL user" in out
    unencoded = f"postgresql://{roles.names['relay']}:{planted.relay_db}@127.0.0.1:1/app"
    env = {**relay_env, "DATABASE_URL": unencoded}
    await cli("relay check, unparsable URL", ["relay", "check"], env, None)
    await cli("relay status, unparsable URL", ["relay", "status"], env, None)
    env = {**consumer_env, "SEC_REDIS_URL": sec.redis_url(tls=True, password=planted.wrong_redis)}
    out = await cli("consumer check, wrong Redis password", ["consumer", "check", *APP], env, 1)
    assert out.startswith("degraded: redis unreachable (redis: AuthenticationError")
    bad_db = make_url(roles.urls["consumer"]).set(password=planted.wrong_db)
    env = {**consumer_env, "SEC_DATABASE_URL": bad_db.render_as_string(hide_password=False)}
    out = await cli("consumer run, wrong database password", ["consumer", "run", *APP], env, 2)
    assert "refused the login" in out
    args = [
        "--database-url",
        consumer_url.replace("@127.0.0.1", "@127.0.0.1:1", 1),
        "--kafka-bootstrap-servers",
        sec.sasl_ssl,
    ]
    await cli("consumer check, unparsable URL", ["consumer", "check", *args], s.clean_env(), None)

    # In this process: the errors' messages and the configs' reprs.
    captured.extend(await _in_process(sec, planted, roles, database_url))

    leaks = [(what, found) for what, text in captured if (found := planted.find(text))]
    assert not leaks, "\n".join(f"{what}: {found}" for what, found in leaks)
    assert len(captured) > 15


async def _in_process(
    sec: s.Secured, planted: Planted, roles: Roles, database_url: str
) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []

    def record(what: str, exc: BaseException) -> None:
        seen.append((what, f"{exc}\n{exc!r}\n{exc.__cause__!r}"))

    bad_relay = make_url(roles.urls["relay"]).set(password=planted.wrong_db)
    config = RelayConfig(
        database_url=bad_relay.render_as_string(hide_password=False), kafka=sec.kafka("scram")
    )
    seen.append(("RelayConfig repr", repr(config)))
    store = pg_store_factory(config)("redact")
    with pytest.raises(DatabaseError) as db_error:
        await store.ping()
    await store.aclose()
    record("relay store error", db_error.value)
    wrong = KafkaSettings(
        bootstrap_servers=sec.sasl_ssl,
        security_protocol="SASL_SSL",
        ssl_cafile=sec.ca,
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username=sec.user,
        sasl_password=planted.wrong_sasl,
    )
    seen.append(("KafkaSettings repr", f"{wrong!r} {wrong} {wrong.describe()}"))
    publisher = KafkaPublisher(wrong, compression="none", request_timeout_ms=5000)
    with pytest.raises(BrokerError) as broker_error:
        await publisher.start()
    record("publisher start error", broker_error.value)
    client = redis_client(sec.redis_url(tls=False, password=planted.wrong_redis), timeout_s=3)
    with pytest.raises(RedisUnavailableError) as redis_error:
        await RedisDedupStore(client).ping()
    seen.append(("redis client repr", repr(client)))
    await client.aclose()
    record("redis error", redis_error.value)
    consumer_config = ConsumerConfig(
        group_id="g",
        topics=["t"],
        database_url=roles.urls["consumer"],
        kafka=sec.kafka("oauth"),
        redis_url=sec.redis_url(tls=True),
        redis_ssl_cafile=sec.ca,
    )
    seen.append(("ConsumerConfig repr", repr(consumer_config)))
    result = await check_consumer(consumer_config)
    seen.append(("consumer check result", f"{result!r} {result.line}"))
    with pytest.raises(LedgerboxError) as config_error:
        KafkaSettings(
            bootstrap_servers="k:1", sasl_password=Secret(planted.wrong_sasl)
        )  # a SASL password without SASL
    record("KafkaSettings error", config_error.value)
    engine = sa.create_engine(roles.urls["consumer"])
    seen.append(("SQLAlchemy engine repr", repr(engine)))
    engine.dispose()
    return seen


def test_the_planted_search_finds_a_leak(sec: s.Secured, planted: Planted) -> None:
    """The search is not blind: each planted form is found in a text holding it."""
    for what, value in planted.forms():
        assert planted.find(f"... {value} ..."), what
    assert planted.find(f"x {urllib.parse.quote(planted.relay_db, safe='')} x")
    assert not planted.find("a text without any of them")
