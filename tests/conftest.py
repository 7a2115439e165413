"""Test harness: real PostgreSQL, Kafka and Redis for integration, fault and acceptance tests.

Services come from DATABASE_URL / KAFKA_BOOTSTRAP_SERVERS / REDIS_URL (`scripts/services.sh up`
prints them), else from testcontainers when a Docker engine answers, else the tests that need
them skip locally and fail under CI=true. See tests/_services.py.

Fixtures (scope):
  database_server_url (session)  SQLAlchemy URL of the server's maintenance database
  template_database (session)    name of a database migrated to head, cloned per module
  database_url (module)          SQLAlchemy URL of a fresh database cloned from the template
  empty_database_url (function)  SQLAlchemy URL of a fresh database with NO tables (unmigrated)
  engine (module)                sync Engine on database_url
  async_engine (function)        AsyncEngine (psycopg async) on database_url
  kafka_bootstrap (session)      "host:port[,host:port]"
  kafka_broker (session)         _services.BrokerInfo of the broker (release, API versions)
  new_topic (session)            new_topic(prefix="t", partitions=3) -> str, deleted at the end
  redis_url (session), redis_prefix (function), redis_client (function, async, bytes replies)
  services_script (session)      absolute path of scripts/services.sh (outage simulation)

Tests under tests/unit must not request any of these: that fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy import Engine, create_engine, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from ledgerbox import migrations
from tests import _services
from tests._services import (
    ENV_DATABASE_URL,
    ENV_KAFKA,
    ENV_REDIS_URL,
    BrokerInfo,
    Containers,
    TopicFactory,
)

UNIT_DIR = Path(__file__).resolve().parent / "unit"

SERVICE_FIXTURES = frozenset(
    {
        "database_server_url",
        "template_database",
        "database_url",
        "empty_database_url",
        "engine",
        "async_engine",
        "kafka_bootstrap",
        "kafka_broker",
        "new_topic",
        "redis_url",
        "redis_client",
        "services_script",
    }
)

_UNIT_SERVICE_USE = pytest.StashKey[list[str]]()


# --------------------------------------------------------------------------- hooks


def pytest_report_header(config: pytest.Config) -> list[str]:
    ci = _services.running_in_ci()
    fallback = "FAIL (CI=true)" if ci else "skip"
    lines = [
        f"ledgerbox services (CI={'true' if ci else 'false'}; a missing service => {fallback}):"
    ]
    probes: list[tuple[str, str, str, Callable[[str], str]]] = [
        ("postgres", ENV_DATABASE_URL, _services.POSTGRES_IMAGE, _services.postgres_version),
        ("kafka", ENV_KAFKA, _services.KAFKA_IMAGE, _services.kafka_version),
        ("redis", ENV_REDIS_URL, _services.REDIS_IMAGE, _services.redis_version),
    ]
    for label, env_var, image, probe in probes:
        value = os.environ.get(env_var, "").strip()
        if value:
            try:
                version = probe(value)
            except Exception as exc:
                version = f"NOT REACHABLE ({type(exc).__name__}: {exc})"
            lines.append(f"  {label}: {_services.redact(value)} (${env_var}) -> {version}")
        elif _services.docker_available():
            lines.append(f"  {label}: ${env_var} not set -> testcontainers {image} on first use")
        else:
            lines.append(f"  {label}: ${env_var} not set, no Docker engine -> {fallback}")
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        used = SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if not used:
            continue
        item.add_marker(pytest.mark.services)
        if UNIT_DIR in item.path.parents:
            item.stash[_UNIT_SERVICE_USE] = sorted(used)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _services.delete_session_topics()


def pytest_runtest_setup(item: pytest.Item) -> None:
    used = item.stash.get(_UNIT_SERVICE_USE, None)
    if used:
        pytest.fail(
            f"tests/unit must not touch services; move this test to tests/integration "
            f"(uses {', '.join(used)})",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _unit_tests_see_no_service_urls(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Settings objects read these variables; without them unit tests cannot reach a real
    # service by accident even when the developer's shell has `services.sh env` loaded.
    if UNIT_DIR in request.node.path.parents:
        for env_var in (ENV_DATABASE_URL, ENV_KAFKA, ENV_REDIS_URL):
            monkeypatch.delenv(env_var, raising=False)


# --------------------------------------------------------------------------- resolution


@pytest.fixture(scope="session")
def _containers() -> Iterator[Containers]:
    containers = Containers()
    try:
        yield containers
    finally:
        containers.stop_all()


def _announce(config: pytest.Config, message: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"[ledgerbox tests] {message}")


def _resolve(config: pytest.Config, env_var: str, label: str, start: Callable[[], str]) -> str:
    value = os.environ.get(env_var, "").strip()
    if value:
        return value
    if not _services.docker_available():
        _services.unavailable(_services.missing_service_message(env_var))
    try:
        import testcontainers  # noqa: F401
    except ImportError:
        _services.unavailable(
            f"{env_var} not set and testcontainers is not installed (pip install -e '.[dev]'); "
            f"or {_services.HOW_TO_GET_SERVICES}"
        )
    value = start()
    _announce(config, f"started {label} container: {_services.redact(value)}")
    return value


# --------------------------------------------------------------------------- PostgreSQL


@pytest.fixture(scope="session")
def database_server_url(pytestconfig: pytest.Config, _containers: Containers) -> str:
    raw = _resolve(pytestconfig, ENV_DATABASE_URL, "postgres", _containers.postgres_url)
    return _services.url_str(_services.normalize_database_url(raw))


@pytest.fixture(scope="session")
def template_database(database_server_url: str) -> Iterator[str]:
    server = make_url(database_server_url)
    name = _services.unique_db_name("ledgerbox_tpl_")
    _services.create_database(server, name)
    try:
        migrations.upgrade_database(_services.url_str(server.set(database=name)))
        _services.seal_template(server, name)
        yield name
    finally:
        _services.drop_database(server, name)


@pytest.fixture(scope="module")
def database_url(database_server_url: str, template_database: str) -> Iterator[str]:
    server = make_url(database_server_url)
    name = _services.unique_db_name("ledgerbox_t_")
    url = _services.create_database(server, name, template=template_database)
    try:
        yield _services.url_str(url)
    finally:
        _services.drop_database(server, name)


@pytest.fixture
def empty_database_url(database_server_url: str) -> Iterator[str]:
    server = make_url(database_server_url)
    name = _services.unique_db_name("ledgerbox_e_")
    url = _services.create_database(server, name)
    try:
        yield _services.url_str(url)
    finally:
        _services.drop_database(server, name)


@pytest.fixture(scope="module")
def engine(database_url: str) -> Iterator[Engine]:
    eng = create_engine(database_url)
    try:
        yield eng
    finally:
        eng.dispose()


@pytest_asyncio.fixture
async def async_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    # Function scoped: an AsyncEngine's pooled connections belong to the loop that opened them,
    # and pytest-asyncio gives each test its own loop.
    eng = create_async_engine(database_url)
    try:
        yield eng
    finally:
        await eng.dispose()


# --------------------------------------------------------------------------- Kafka


@pytest.fixture(scope="session")
def kafka_bootstrap(pytestconfig: pytest.Config, _containers: Containers) -> str:
    return _resolve(pytestconfig, ENV_KAFKA, "kafka", _containers.kafka_bootstrap)


@pytest.fixture(scope="session")
def kafka_broker(kafka_bootstrap: str) -> BrokerInfo:
    return _services.kafka_broker_info(kafka_bootstrap)


@pytest.fixture(scope="session")
def new_topic(kafka_bootstrap: str) -> Iterator[TopicFactory]:
    factory = TopicFactory(kafka_bootstrap)
    try:
        yield factory
    finally:
        factory.delete_all()


# --------------------------------------------------------------------------- Redis


@pytest.fixture(scope="session")
def redis_url(pytestconfig: pytest.Config, _containers: Containers) -> str:
    return _resolve(pytestconfig, ENV_REDIS_URL, "redis", _containers.redis_url)


@pytest.fixture
def redis_prefix() -> str:
    return f"t:{uuid.uuid4().hex[:8]}:"


@pytest_asyncio.fixture
async def redis_client(redis_url: str, redis_prefix: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    try:
        yield client
    finally:
        # Best effort: Redis is shared by concurrent runs, so remove only this test's keys,
        # and a fault test may have left the server stopped.
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(5):
                keys = [key async for key in client.scan_iter(match=f"{redis_prefix}*")]
                if keys:
                    await client.delete(*keys)
        await client.aclose()


# --------------------------------------------------------------------------- scripts


@pytest.fixture(scope="session")
def services_script() -> str:
    if not _services.SERVICES_SCRIPT.is_file():
        _services.unavailable(f"{_services.SERVICES_SCRIPT} is missing")
    return str(_services.SERVICES_SCRIPT)
