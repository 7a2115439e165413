"""Where the test services come from, and small helpers shared by the fixtures in conftest.

Resolution order for each of PostgreSQL, Kafka and Redis:

1. the environment URL (``DATABASE_URL``, ``KAFKA_BOOTSTRAP_SERVERS``, ``REDIS_URL``), as printed
   by ``scripts/services.sh up`` and used by CI;
2. a throwaway container started through testcontainers when a Docker engine answers;
3. otherwise the tests needing the service are skipped locally, but fail under ``CI=true`` so a
   misconfigured CI run can never go green by skipping everything.

Nothing here touches a service at import time: ``tests/unit`` imports conftest too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import io
import os
import re
import socket
import struct
import subprocess
import tarfile
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

ENV_DATABASE_URL = "DATABASE_URL"
ENV_KAFKA = "KAFKA_BOOTSTRAP_SERVERS"
ENV_REDIS_URL = "REDIS_URL"

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVICES_SCRIPT = REPO_ROOT / "scripts" / "services.sh"

# Same images as docker-compose.yml, so the Docker route and `docker compose up` agree.
POSTGRES_IMAGE = "postgres:16"
KAFKA_IMAGE = "apache/kafka:4.1.1"
REDIS_IMAGE = "redis:7"

HOW_TO_GET_SERVICES = 'run `make test` or `eval "$(scripts/services.sh up)"`'

T = TypeVar("T")


def running_in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def unavailable(message: str) -> NoReturn:
    """Skip locally, fail in CI: a CI run that silently skips its integration tests is a lie."""
    if running_in_ci():
        pytest.fail(f"{message} (CI=true: missing services are an error)", pytrace=False)
    pytest.skip(message)


def missing_service_message(env_var: str) -> str:
    return f"{env_var} not set and no Docker engine: {HOW_TO_GET_SERVICES}"


# --------------------------------------------------------------------------- Docker route


@functools.cache
def docker_available() -> bool:
    """True if a Docker engine answers; cached because `docker info` can take seconds."""
    try:
        import docker  # type: ignore[import-untyped]  # ships with testcontainers
    except ImportError:
        pass
    else:
        try:
            client = docker.from_env(timeout=10)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except Exception:
            return False
    try:
        proc = subprocess.run(
            ["docker", "info"],
            capture_output=True,
            timeout=20,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


class Containers:
    """Containers started on demand for this session; stopped by the session fixture."""

    def __init__(self) -> None:
        self._started: list[Any] = []

    def _track(self, container: T) -> T:
        self._started.append(container)
        return container

    def postgres_url(self) -> str:
        try:
            from testcontainers.community.postgres import PostgresContainer
        except ImportError:  # testcontainers < 4.10 has no `community` namespace
            from testcontainers.postgres import PostgresContainer

        pg = PostgresContainer(
            POSTGRES_IMAGE, username="postgres", password="postgres", dbname="app", driver="psycopg"
        )
        self._track(pg).start()
        return str(pg.get_connection_url())

    def redis_url(self) -> str:
        try:
            from testcontainers.community.redis import RedisContainer
        except ImportError:
            from testcontainers.redis import RedisContainer

        rc = RedisContainer(REDIS_IMAGE)
        self._track(rc).start()
        return f"redis://{rc.get_container_host_ip()}:{rc.get_exposed_port(6379)}/0"

    def kafka_bootstrap(self) -> str:
        container = _ApacheKafkaContainer()
        self._track(container).start()
        return container.bootstrap_server()

    def stop_all(self) -> None:
        while self._started:
            container = self._started.pop()
            with contextlib.suppress(Exception):
                container.stop()


class _ApacheKafkaContainer:
    """Single-node KRaft `apache/kafka` container.

    testcontainers' KafkaContainer only drives Confluent's cp-kafka image; we want the same
    Apache Kafka build as docker-compose and CI. The advertised listener must carry the host port
    Docker picked, which is only known after start, so the container waits for a start script
    that we copy in once the port is mapped (the same trick testcontainers uses).
    """

    EXTERNAL_PORT = 9093
    START_SCRIPT = "/tmp/ledgerbox-start.sh"

    def __init__(self, image: str = KAFKA_IMAGE) -> None:
        from testcontainers.core.container import DockerContainer

        env = {
            "CLUSTER_ID": "bGVkZ2VyYm94LXRlc3RzMQ",
            "KAFKA_NODE_ID": "1",
            "KAFKA_PROCESS_ROLES": "broker,controller",
            "KAFKA_LISTENERS": (
                f"EXTERNAL://0.0.0.0:{self.EXTERNAL_PORT},"
                "BROKER://0.0.0.0:9092,CONTROLLER://0.0.0.0:9094"
            ),
            "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": (
                "EXTERNAL:PLAINTEXT,BROKER:PLAINTEXT,CONTROLLER:PLAINTEXT"
            ),
            "KAFKA_INTER_BROKER_LISTENER_NAME": "BROKER",
            "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
            "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9094",
            "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
            "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
            "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
            "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        }
        self._container = DockerContainer(image)
        for key, value in env.items():
            self._container.with_env(key, value)
        self._container.with_exposed_ports(self.EXTERNAL_PORT)
        self._container.with_command(
            [
                "bash",
                "-c",
                f"while [ ! -f {self.START_SCRIPT} ]; do sleep 0.1; done; "
                f"exec bash {self.START_SCRIPT}",
            ]
        )

    def start(self) -> None:
        from testcontainers.core.waiting_utils import wait_for_logs

        self._container.start()
        host = self._container.get_container_host_ip()
        port = self._container.get_exposed_port(self.EXTERNAL_PORT)
        script = (
            f"export KAFKA_ADVERTISED_LISTENERS=EXTERNAL://{host}:{port},BROKER://localhost:9092\n"
            "exec /etc/kafka/docker/run\n"
        ).encode()
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(Path(self.START_SCRIPT).name)
            info.size = len(script)
            info.mode = 0o755
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(script))
        self._container.get_wrapped_container().put_archive(
            str(Path(self.START_SCRIPT).parent), buf.getvalue()
        )
        wait_for_logs(self._container, r"Kafka Server started", timeout=180)
        self._bootstrap = f"{host}:{port}"

    def bootstrap_server(self) -> str:
        return self._bootstrap

    def stop(self) -> None:
        self._container.stop()


# --------------------------------------------------------------------------- PostgreSQL


def normalize_database_url(raw: str) -> URL:
    """The framework is psycopg-3 only; accept `postgresql://` URLs but pin the driver."""
    url = make_url(raw)
    if url.get_backend_name() != "postgresql":
        raise ValueError(f"{ENV_DATABASE_URL} must be a PostgreSQL URL, got {url.drivername!r}")
    return url.set(drivername="postgresql+psycopg")


def url_str(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def redact(raw: str) -> str:
    try:
        return make_url(raw).render_as_string(hide_password=True)
    except Exception:
        return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", raw)


def _admin_engine(server_url: URL) -> Any:
    # CREATE/DROP DATABASE refuse to run inside a transaction block.
    return create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)


def _quote_ident(name: str) -> str:
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"refusing unusual database name {name!r}")
    return f'"{name}"'


def unique_db_name(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


def create_database(server_url: URL, name: str, template: str | None = None) -> URL:
    ddl = f"CREATE DATABASE {_quote_ident(name)}"
    if template is not None:
        ddl += f" TEMPLATE {_quote_ident(template)}"
    engine = _admin_engine(server_url)
    try:
        with engine.connect() as conn:
            conn.execute(text(ddl))
    finally:
        engine.dispose()
    return server_url.set(database=name)


def seal_template(server_url: URL, name: str) -> None:
    """Stop anyone from connecting to the template.

    CREATE DATABASE ... TEMPLATE fails with "source database is being accessed by other users"
    while any session is connected to it, e.g. a pooled connection the migration code left open.
    """
    engine = _admin_engine(server_url)
    try:
        with engine.connect() as conn:
            conn.execute(text(f"ALTER DATABASE {_quote_ident(name)} WITH ALLOW_CONNECTIONS false"))
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": name},
            )
    finally:
        engine.dispose()


def drop_database(server_url: URL, name: str) -> None:
    engine = _admin_engine(server_url)
    try:
        with engine.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {_quote_ident(name)} WITH (FORCE)"))
    finally:
        engine.dispose()


def postgres_version(raw_url: str, timeout: float = 3.0) -> str:
    engine = create_engine(
        normalize_database_url(raw_url),
        poolclass=NullPool,
        connect_args={"connect_timeout": max(1, int(timeout))},
    )
    try:
        with engine.connect() as conn:
            return str(conn.execute(text("SHOW server_version")).scalar_one())
    finally:
        engine.dispose()


# --------------------------------------------------------------------------- Redis


def redis_version(url: str, timeout: float = 3.0) -> str:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        info = client.info("server")
        return str(info.get("redis_version", "?"))
    finally:
        client.close()


# --------------------------------------------------------------------------- Kafka


def kafka_version(bootstrap: str) -> str:
    return kafka_broker_info(bootstrap).describe()


def split_bootstrap(servers: str) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for item in servers.split(","):
        item = item.strip()
        if not item:
            continue
        host, _, port = item.rpartition(":")
        out.append((host.strip("[]") or "localhost", int(port)))
    if not out:
        raise ValueError(f"empty {ENV_KAFKA}")
    return out


# metadata.version feature levels as defined by Apache Kafka's MetadataVersion enum (levels 7-29
# read from kafka-server-common 4.1.1). The finalized level names the release line that formatted
# the cluster; the highest supported level names the broker software's release line.
_METADATA_VERSIONS = {
    1: "3.0-IV1", 2: "3.1-IV0", 3: "3.2-IV0", 4: "3.3-IV0", 5: "3.3-IV1", 6: "3.3-IV2",
    7: "3.3-IV3", 8: "3.4-IV0", 9: "3.5-IV0", 10: "3.5-IV1", 11: "3.5-IV2", 12: "3.6-IV0",
    13: "3.6-IV1", 14: "3.6-IV2", 15: "3.7-IV0", 16: "3.7-IV1", 17: "3.7-IV2", 18: "3.7-IV3",
    19: "3.7-IV4", 20: "3.8-IV0", 21: "3.9-IV0", 22: "4.0-IV0", 23: "4.0-IV1", 24: "4.0-IV2",
    25: "4.0-IV3", 26: "4.1-IV0", 27: "4.1-IV1", 28: "4.2-IV0", 29: "4.2-IV1",
}  # fmt: skip


def metadata_version_name(level: int) -> str:
    name = _METADATA_VERSIONS.get(level)
    if name is not None:
        return name
    return f"level {level} (newer than 4.2)" if level > 29 else f"level {level}"


@dataclass
class BrokerInfo:
    address: str
    api_count: int = 0
    api_versions: dict[int, tuple[int, int]] = field(default_factory=dict)
    supported_features: dict[str, tuple[int, int]] = field(default_factory=dict)
    finalized_features: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def release(self) -> str | None:
        """Release line ("4.1") of the broker software, from the metadata.version it supports."""
        supported = self.supported_features.get("metadata.version")
        if supported is None:
            return None
        name = _METADATA_VERSIONS.get(supported[1])
        return name.split("-")[0] if name else None

    def describe(self) -> str:
        if self.api_count < 0:
            return f"Kafka broker older than 2.4 (no ApiVersions v3) at {self.address}"
        parts: list[str] = []
        release = self.release
        parts.append(f"Apache Kafka {release}.x" if release else "Kafka (release unknown)")
        details: list[str] = []
        fin = self.finalized_features.get("metadata.version")
        if fin is not None:
            details.append(f"metadata.version {metadata_version_name(fin[1])} finalized")
        sup = self.supported_features.get("metadata.version")
        if sup is not None:
            details.append(f"supports up to {metadata_version_name(sup[1])}")
        for feature in ("kraft.version", "group.version", "transaction.version"):
            if feature in self.finalized_features:
                details.append(f"{feature}={self.finalized_features[feature][1]}")
        details.append(f"{self.api_count} APIs")
        if 3 in self.api_versions:
            details.append(f"Metadata v{self.api_versions[3][1]}")
        if 0 in self.api_versions:
            details.append(f"Produce v{self.api_versions[0][1]}")
        parts.append(f"({', '.join(details)}) at {self.address}")
        return " ".join(parts)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("truncated Kafka response")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def int16(self) -> int:
        return int(struct.unpack(">h", self.take(2))[0])

    def int32(self) -> int:
        return int(struct.unpack(">i", self.take(4))[0])

    def uvarint(self) -> int:
        shift = result = 0
        while True:
            byte = self.take(1)[0]
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7

    def compact_string(self) -> str:
        n = self.uvarint() - 1
        return "" if n <= 0 else self.take(n).decode()

    def tagged_fields(self) -> dict[int, bytes]:
        fields: dict[int, bytes] = {}
        for _ in range(self.uvarint()):
            tag = self.uvarint()
            fields[tag] = self.take(self.uvarint())
        return fields

    def features(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for _ in range(self.uvarint() - 1):
            name = self.compact_string()
            first, second = self.int16(), self.int16()
            self.tagged_fields()
            out[name] = (first, second)
        return out


def _uvarint_bytes(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _compact_string(value: str) -> bytes:
    raw = value.encode()
    return _uvarint_bytes(len(raw) + 1) + raw


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        chunks += chunk
    return bytes(chunks)


def kafka_broker_info(bootstrap: str, timeout: float = 5.0) -> BrokerInfo:
    """One ApiVersions v3 round trip, raw, because aiokafka 0.14 has no version check.

    v3 is the first version whose response carries the broker's supported and finalized
    features; metadata.version identifies the Apache Kafka release line. Sync and dependency
    free so that pytest_report_header can call it before any event loop exists.
    """
    errors: list[str] = []
    for host, port in split_bootstrap(bootstrap):
        try:
            with socket.create_connection((host, port), timeout=timeout) as sock:
                sock.settimeout(timeout)
                client_id = b"ledgerbox-tests"
                header = struct.pack(">hhih", 18, 3, 1, len(client_id)) + client_id + b"\x00"
                body = _compact_string("ledgerbox-tests") + _compact_string("1") + b"\x00"
                payload = header + body
                sock.sendall(struct.pack(">i", len(payload)) + payload)
                size = struct.unpack(">i", _recv_exact(sock, 4))[0]
                reader = _Reader(_recv_exact(sock, size))
        except OSError as exc:
            errors.append(f"{host}:{port}: {exc}")
            continue
        # ApiVersions responses always use header v0 (correlation id only).
        reader.int32()
        info = BrokerInfo(address=f"{host}:{port}")
        error_code = reader.int16()
        if error_code != 0:
            # UNSUPPORTED_VERSION from a pre-2.4 broker: it still lists its v0 API table.
            info.api_count = -1
            return info
        for _ in range(reader.uvarint() - 1):
            key, lo, hi = reader.int16(), reader.int16(), reader.int16()
            reader.tagged_fields()
            info.api_versions[key] = (lo, hi)
        info.api_count = len(info.api_versions)
        reader.int32()  # throttle_time_ms
        tagged = reader.tagged_fields()
        if 0 in tagged:
            info.supported_features = _Reader(tagged[0]).features()
        if 2 in tagged:
            # FinalizedFeatures entries are (max_version_level, min_version_level); store them as
            # (min, max) like the supported ones.
            info.finalized_features = {
                name: (min_level, max_level)
                for name, (max_level, min_level) in _Reader(tagged[2]).features().items()
            }
        return info
    raise ConnectionError(f"no Kafka broker answered at {bootstrap}: {'; '.join(errors)}")


def run_coroutine_blocking(factory: Callable[[], Coroutine[Any, Any, T]], timeout: float) -> T:
    """Run a coroutine to completion from sync code, even if called inside a running loop.

    Sync fixtures/factories are also called from async tests, where asyncio.run() is illegal;
    a private loop in a worker thread keeps the caller's loop and its objects untouched.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(asyncio.wait_for(factory(), timeout))
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(lambda: asyncio.run(asyncio.wait_for(factory(), timeout)))
        return future.result(timeout=timeout + 5)


async def poll_until(
    check: Callable[[], Awaitable[bool]], *, within: float, interval: float = 0.05, what: str
) -> None:
    deadline = time.monotonic() + within
    while True:
        if await check():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(interval)


_TOPIC_PREFIX_RE = re.compile(r"[A-Za-z0-9-]+")


class TopicFactory:
    """`new_topic(prefix="t", partitions=3) -> str`: a fresh, fully propagated topic.

    Callable from sync and async code alike (see run_coroutine_blocking); async code that wants
    to avoid blocking its loop can `await new_topic.acreate(...)`. Topics are deleted at session
    end.
    """

    TIMEOUT = 60.0

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.created: list[str] = []

    def __call__(self, prefix: str = "t", partitions: int = 3) -> str:
        name = self._name(prefix)
        run_coroutine_blocking(lambda: self._create(name, partitions), self.TIMEOUT)
        return name

    async def acreate(self, prefix: str = "t", partitions: int = 3) -> str:
        name = self._name(prefix)
        await asyncio.wait_for(self._create(name, partitions), self.TIMEOUT)
        return name

    def _name(self, prefix: str) -> str:
        # '.' and '_' collide in Kafka metric names, so only letters, digits and '-'.
        if not _TOPIC_PREFIX_RE.fullmatch(prefix):
            raise ValueError(f"topic prefix must match {_TOPIC_PREFIX_RE.pattern}: {prefix!r}")
        return f"{prefix}-{uuid.uuid4().hex}"

    async def _create(self, name: str, partitions: int) -> None:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=30000)
        await admin.start()
        try:
            response = await admin.create_topics(
                [NewTopic(name=name, num_partitions=partitions, replication_factor=1)]
            )
            for topic_error in response.topic_errors:
                if topic_error[1] != 0:
                    raise RuntimeError(f"CreateTopics {name}: {topic_error}")
            self.created.append(name)

            async def ready() -> bool:
                topics = await admin.describe_topics([name])
                if not topics or topics[0]["error_code"] != 0:
                    return False
                parts = topics[0]["partitions"]
                return len(parts) == partitions and all(p["leader"] >= 0 for p in parts)

            await poll_until(ready, within=self.TIMEOUT, what=f"topic {name} metadata")
        finally:
            await admin.close()

    def delete_all(self) -> None:
        topics, self.created = self.created, []
        delete_topics(self.bootstrap, topics)


def delete_topics(bootstrap: str, topics: list[str]) -> None:
    """Delete those of ``topics`` that exist, best effort (a fault test may have left the
    broker stopped)."""
    if not topics:
        return

    async def delete() -> None:
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
        await admin.start()
        try:
            doomed = sorted(set(topics) & set(await admin.list_topics()))
            if doomed:
                await admin.delete_topics(doomed)
        finally:
            await admin.close()

    with contextlib.suppress(Exception):
        run_coroutine_blocking(delete, timeout=30)


# Topics a test created outside TopicFactory (with topic configs, or auto-created by a relay or
# an inbox's dead-letter producer) under a fresh name: bootstrap -> names. Deleted when the
# session ends (tests/conftest.py), so runs do not pile up topics that cost Kafka CPU later.
_SESSION_TOPICS: dict[str, set[str]] = {}


def delete_at_session_end(bootstrap: str, *topics: str) -> None:
    """Have ``topics`` deleted when the test session ends (those that exist then)."""
    _SESSION_TOPICS.setdefault(bootstrap, set()).update(topics)


def delete_session_topics() -> None:
    """Delete every topic given to delete_at_session_end (called once, at session end)."""
    while _SESSION_TOPICS:
        bootstrap, topics = _SESSION_TOPICS.popitem()
        delete_topics(bootstrap, sorted(topics))
