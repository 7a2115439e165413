"""What the security tests share: the secured local endpoints (``scripts/services.sh`` with
``OUTBOX_SECURITY=1`` prints ``OUTBOX_SEC_*``), the Kafka settings of each listener, the
environment of the real CLIs, a TCP proxy that counts connections, the consumer app that
``ledgerbox consumer run`` loads, and an OAUTHBEARER token provider."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import AbstractTokenProvider

from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer, KafkaSettings, Secret
from ledgerbox.outbox import EventEnvelope
from tests import _services

REPO = Path(__file__).resolve().parents[2]
HOW = "run `make test-security` (or OUTBOX_SECURITY=1 scripts/services.sh up)"

metadata = sa.MetaData()
#: The consumer's business table: one row per applied order.
orders = sa.Table(
    "sec_orders",
    metadata,
    sa.Column("consumer_group", sa.Text, primary_key=True),
    sa.Column("order_id", sa.Text, primary_key=True),
    sa.Column("amount", sa.Numeric(12, 2), nullable=False),
)


class OrderRejected(Exception):
    """Raised by the handler for ``OrderRejected`` events: dead-lettered after one try."""


@dataclass(frozen=True)
class Secured:
    """The secured endpoints of ``services.sh`` (paths and ports; secrets in files)."""

    dir: Path
    user: str
    sasl_ssl: str
    mtls: str
    redis_auth_port: int
    redis_tls_port: int

    @classmethod
    def from_env(cls) -> Secured:
        env = os.environ
        names = ("OUTBOX_SEC_DIR", "OUTBOX_SEC_KAFKA_SASL_SSL", "OUTBOX_SEC_KAFKA_MTLS")
        missing = [n for n in names if not env.get(n)]
        if missing:
            _services.unavailable(f"{', '.join(missing)} not set: {HOW}")
        return cls(
            dir=Path(env["OUTBOX_SEC_DIR"]),
            user=env.get("OUTBOX_SEC_USER", "ledgerbox"),
            sasl_ssl=env["OUTBOX_SEC_KAFKA_SASL_SSL"],
            mtls=env["OUTBOX_SEC_KAFKA_MTLS"],
            redis_auth_port=int(env["OUTBOX_SEC_REDIS_AUTH_PORT"]),
            redis_tls_port=int(env["OUTBOX_SEC_REDIS_TLS_PORT"]),
        )

    def file(self, name: str) -> str:
        return str(self.dir / name)

    def secret(self, name: str) -> str:
        return (self.dir / name).read_text().strip()

    @property
    def ca(self) -> str:
        return self.file("ca.pem")

    @property
    def sasl_password(self) -> str:
        return self.secret("kafka-sasl-password")

    @property
    def key_password(self) -> str:
        return self.secret("client-key-password")

    @property
    def redis_password(self) -> str:
        return self.secret("redis-password")

    def redis_url(self, *, tls: bool, password: str | None = None) -> str:
        scheme, port = ("rediss", self.redis_tls_port) if tls else ("redis", self.redis_auth_port)
        return f"{scheme}://{self.user}:{password or self.redis_password}@127.0.0.1:{port}/0"

    # -- Kafka -----------------------------------------------------------------------------

    def env(self, kind: str, *, password_file: str | None = None) -> dict[str, str]:
        """The ``KAFKA_*`` variables of one way in: ``"scram"`` (SASL_SSL, SCRAM-SHA-512,
        the password from its file), ``"mtls"`` (SSL with the client certificate, the key's
        passphrase from its file), ``"oauth"`` (SASL_SSL, OAUTHBEARER, the token provider of
        this module)."""
        if kind == "scram":
            return {
                "KAFKA_BOOTSTRAP_SERVERS": self.sasl_ssl,
                "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                "KAFKA_SSL_CAFILE": self.ca,
                "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
                "KAFKA_SASL_USERNAME": self.user,
                "KAFKA_SASL_PASSWORD_FILE": password_file or self.file("kafka-sasl-password"),
            }
        if kind == "mtls":
            return {
                "KAFKA_BOOTSTRAP_SERVERS": self.mtls,
                "KAFKA_SECURITY_PROTOCOL": "SSL",
                "KAFKA_SSL_CAFILE": self.ca,
                "KAFKA_SSL_CERTFILE": self.file("client.pem"),
                "KAFKA_SSL_KEYFILE": self.file("client.key"),
                "KAFKA_SSL_KEY_PASSWORD_FILE": self.file("client-key-password"),
            }
        if kind == "oauth":
            return {
                "KAFKA_BOOTSTRAP_SERVERS": self.sasl_ssl,
                "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                "KAFKA_SSL_CAFILE": self.ca,
                "KAFKA_SASL_MECHANISM": "OAUTHBEARER",
                "KAFKA_OAUTH_TOKEN_PROVIDER": "tests.security._support:TokenProvider",
            }
        raise ValueError(kind)

    def kafka(self, kind: str) -> KafkaSettings:
        """The :class:`KafkaSettings` of one way in (what the CLIs build from :meth:`env`)."""
        if kind == "scram":
            return KafkaSettings(
                bootstrap_servers=self.sasl_ssl,
                security_protocol="SASL_SSL",
                ssl_cafile=self.ca,
                sasl_mechanism="SCRAM-SHA-512",
                sasl_username=self.user,
                sasl_password=Secret.from_file(self.file("kafka-sasl-password")),
            )
        if kind == "mtls":
            return KafkaSettings(
                bootstrap_servers=self.mtls,
                security_protocol="SSL",
                ssl_cafile=self.ca,
                ssl_certfile=self.file("client.pem"),
                ssl_keyfile=self.file("client.key"),
                ssl_key_password=Secret.from_file(self.file("client-key-password")),
            )
        if kind == "oauth":
            return KafkaSettings(
                bootstrap_servers=self.sasl_ssl,
                security_protocol="SASL_SSL",
                ssl_cafile=self.ca,
                sasl_mechanism="OAUTHBEARER",
                token_provider=TokenProvider(),
            )
        raise ValueError(kind)


# -- OAUTHBEARER --------------------------------------------------------------------------

#: Claims of the test token: fixed, so that a test can compute the exact token string to
#: look for in captured output. Kafka's unsecured validator (test brokers only) checks
#: ``alg: none``, ``sub`` and the time claims.
TOKEN_CLAIMS = {"sub": "ledgerbox-consumer", "iat": 1_700_000_000, "exp": 4_000_000_000}


def unsecured_jwt(claims: dict[str, Any] | None = None) -> str:
    def part(data: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'none'})}.{part(claims or planted_token_claims())}."


def planted_token_claims() -> dict[str, Any]:
    """The claims, with ``SEC_TOKEN_NONCE`` (a per-test value) so the token is unique."""
    nonce = os.environ.get("SEC_TOKEN_NONCE", "none")
    return {**TOKEN_CLAIMS, "jti": f"planted-token-{nonce}"}


class TokenProvider(AbstractTokenProvider):
    """``--kafka-oauth-token-provider tests.security._support:TokenProvider``: an unsecured
    JWT for the local broker (a real provider fetches one from the identity provider and
    caches it until it expires)."""

    async def token(self) -> str:
        return unsecured_jwt()


# -- the consumer app ---------------------------------------------------------------------


def consumer_from_env() -> InboxConsumer:
    """``ledgerbox consumer run --app tests.security._support:consumer_from_env``.

    Kafka: ``KafkaSettings.from_env("consumer")`` (the ``KAFKA_*`` variables); ``SEC_*``:
    group, topic, database URL, Redis URL and CA file."""
    env = os.environ
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=env["SEC_GROUP"],
            topics=[env["SEC_TOPIC"]],
            dead_letter_topic=env.get("SEC_DLQ") or None,
            database_url=env["SEC_DATABASE_URL"],
            kafka=KafkaSettings.from_env("consumer"),
            redis_url=env.get("SEC_REDIS_URL") or None,
            redis_ssl_cafile=env.get("SEC_REDIS_CAFILE") or None,
            dead_letter_on=(OrderRejected,),
            commit_interval_ms=50,
            batch_max_records=1,
        )
    )

    @consumer.handler("OrderPlaced")
    async def placed(ctx: HandlerContext[Any], event: EventEnvelope) -> None:
        await ctx.session.execute(
            sa.insert(orders).values(
                consumer_group=ctx.group_id,
                order_id=event.payload["order_id"],
                amount=Decimal(event.payload["amount"]),
            )
        )

    @consumer.handler("OrderRejected")
    async def rejected(ctx: HandlerContext[Any], event: EventEnvelope) -> None:
        raise OrderRejected(f"order {event.payload['order_id']} is rejected for good")

    return consumer


# -- processes ----------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any ledgerbox / Kafka / SEC setting, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LEDGERBOX_", "KAFKA_", "SEC_", "FS_"))
        and k not in ("DATABASE_URL", "REDIS_URL")
    }
    env.update(extra)
    return env


#: ``entry=UNSCRUBBED``: the real CLI with the redaction safety net off (tests/unscrubbed_entry.py).
UNSCRUBBED = "tests.unscrubbed_entry"


def start(
    args: list[str], env: dict[str, str], log: Path, *, entry: str = "ledgerbox"
) -> subprocess.Popen[bytes]:
    """``python -m ledgerbox ARGS`` (the real CLI) with stdout and stderr into ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", entry, *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def run(
    args: list[str], env: dict[str, str], timeout_s: float = 120, *, entry: str = "ledgerbox"
) -> tuple[int, str]:
    """``python -m ledgerbox ARGS`` to completion: ``(exit code, stdout + stderr)``."""
    done = subprocess.run(
        [sys.executable, "-m", entry, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return done.returncode, done.stdout + done.stderr


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise


def lines(text: str) -> list[str]:
    """Non-empty lines, less the INFO lines of alembic (imported by the tests' modules)."""
    return [line for line in text.splitlines() if line.strip() and " INFO alembic" not in line]


# -- Kafka helpers ------------------------------------------------------------------------


async def read_topic(
    kafka: KafkaSettings, topic: str, want: int, within_s: float = 60
) -> list[Any]:
    """Read ``topic`` from the beginning over ``kafka`` until ``want`` records came."""
    consumer = AIOKafkaConsumer(
        **kafka.client_kwargs(), enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    records: list[Any] = []
    try:
        deadline = time.monotonic() + within_s
        partitions = None
        while not partitions:
            partitions = consumer.partitions_for_topic(topic)
            if not partitions:
                await consumer._client.force_metadata_update()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no metadata for {topic}")
                await asyncio.sleep(0.2)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while len(records) < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(records)} of {want} records read from {topic}")
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                records.extend(batch)
    finally:
        await consumer.stop()
    return records


class CountingProxy:
    """A TCP port that forwards to ``target`` and counts the connections made to it and the
    logins: connections that sent anything (a TCP reachability check sends nothing). For a
    client that cannot get past the bootstrap server, the logins are its attempts."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.connections = 0
        self.logins = 0
        self.address = ""
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> CountingProxy:
        self.server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            first = await reader.read(65536)
        except (ConnectionError, OSError):
            first = b""
        if not first:
            writer.close()
            return
        self.logins += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        up_writer.write(first)

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))
