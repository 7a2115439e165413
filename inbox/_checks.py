"""Startup checks of an inbox consumer: is everything it needs there, and if not, why and
what fixes it, in one line (``ledgerbox consumer check`` and the start of
:meth:`inbox.InboxConsumer.run`).

Checked in order, the first failure decides:

1. PostgreSQL answers (refused credentials: a permanent fault);
2. the inbox table exists with the expected columns, and the ledgerbox schema revision is
   the one this code needs when ``ledgerbox_alembic_version`` exists;
3. the role may SELECT, INSERT and UPDATE the inbox table (``has_table_privilege``);
4. new transactions are not read-only (``default_transaction_read_only``, a standby);
5. Kafka answers and accepts the TLS and SASL settings (one login by hand,
   :func:`ledgerbox._core.kafka_probe.probe_kafka`: a refused password, a TLS listener spoken
   to in plaintext or an untrusted certificate is permanent) and the subscribed topics exist,
   or the broker creates topics on first use (``auto.create.topics.enable``);
6. Redis answers (else ``degraded``: the consumer stays correct on the database alone).

Every failure but refused credentials is transient: ``run`` waits for it to pass (health
``down``), it never gives up nor dead-letters anything. The messages name objects and the
fix, never a password, an SQL statement or a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from ledgerbox._core.database_url import (
    connect_args,
    database_label,
    refused_login,
    sqlalchemy_url,
)
from ledgerbox._core.errors import BrokerError, DatabaseError, kafka_unreachable
from ledgerbox._core.faults import login_refused
from ledgerbox._core.kafka import KafkaSettings
from ledgerbox._core.kafka_probe import LOGIN_REFUSED, probe_kafka
from ledgerbox._core.names import SCHEMA_REVISION_MIN, SCHEMA_VERSION_TABLE, revision_served
from ledgerbox.inbox._config import ConsumerConfig
from ledgerbox.inbox._health import Health
from ledgerbox.inbox._table import InboxTable

__all__ = ["CheckResult", "check_consumer", "kafka_start_fault", "kafka_start_verdict"]

#: Kafka client errors that mean the credentials were refused: waiting will not fix them.
_KAFKA_AUTH = LOGIN_REFUSED

_COLUMNS = sa.text(
    "SELECT attname FROM pg_attribute "
    "WHERE attrelid = CAST(:table AS regclass) AND attnum > 0 AND NOT attisdropped"
)
#: {table}: the validated (schema-qualified) name of the version table.
_REVISIONS = "SELECT version_num FROM {table}"
_PRIVILEGES = sa.text(
    "SELECT p FROM unnest(CAST(:wanted AS text[])) AS p "
    "WHERE NOT has_table_privilege(CAST(:table AS regclass), p)"
)


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The verdict of :func:`check_consumer`.

    Attributes
    ----------
    state : "ok" | "degraded" | "down"
        The health.
    cause : str | None
        One line: what is wrong and how to fix it; ``None`` when ``ok``.
    permanent : bool
        True when waiting cannot fix it (credentials refused): ``run`` exits.
    recheck : bool
        A permanent verdict read from libpq's account of a failed connection (a refused
        login looks like a server closing the connection right after taking the password,
        as a restart does): ``run`` looks once more after
        :data:`ledgerbox._core.faults.PERMANENT_CONFIRM_S` before it exits.
    """

    state: Health
    cause: str | None = None
    permanent: bool = False
    recheck: bool = False

    @property
    def line(self) -> str:
        """``ok``, or ``<state>: <cause>``: what ``ledgerbox consumer check`` prints."""
        return self.state if self.cause is None else f"{self.state}: {self.cause}"


def _down(cause: str, *, permanent: bool = False, recheck: bool = False) -> CheckResult:
    return CheckResult("down", cause, permanent, recheck)


async def check_consumer(
    config: ConsumerConfig,
    *,
    check_topics: bool = True,
    check_redis: bool = True,
    timeout_s: float = 10.0,
) -> CheckResult:
    """Check what the consumer configured by ``config`` needs (see the module docstring).

    Parameters
    ----------
    config : ConsumerConfig
        The consumer's settings (database, inbox table, Kafka, topics, Redis).
    check_topics : bool
        Check that ``config.topics`` exist (``False`` for a check without a consumer).
    check_redis : bool
        Check Redis (``False`` at the start of ``run``: Redis only degrades).
    timeout_s : float
        Time allowed to each service, in seconds.

    Returns
    -------
    CheckResult
        ``ok``; ``degraded`` when only Redis does not answer; ``down`` with the cause of the
        first failure. Never raises for a failing service.
    """
    found = await _check_database(config, timeout_s)
    if found is None:
        found = await _check_kafka(config, check_topics, timeout_s)
    if found is None and check_redis and config.redis_url is not None:
        found = await _check_redis(config, timeout_s)
    return found or CheckResult("ok")


async def _check_database(config: ConsumerConfig, timeout_s: float) -> CheckResult | None:
    engine = create_async_engine(
        sqlalchemy_url(config.database_url),
        poolclass=sa.pool.NullPool,
        connect_args=connect_args(config.database_url),
    )
    url = engine.url
    where = f"{url.host or 'localhost'}:{url.port or 5432}"
    try:
        async with asyncio.timeout(timeout_s), engine.connect() as conn:
            return await _check_schema(conn, config)
    except TimeoutError:
        return _down(f"database at {where} did not answer within {timeout_s:g} s")
    except Exception as exc:
        error = DatabaseError.translate(exc, "connect")
        if error is None:
            raise
        detail = _detail(error)
        if login_refused(exc):  # the user, the password or the database: named, all three
            error.__cause__ = exc
            label = database_label(config.database_url)
            return _down(refused_login(error, label, "database_url"), permanent=True, recheck=True)
        return _down(f"database at {where} unreachable: {detail}: start it or fix database_url")
    finally:
        await engine.dispose()


async def _check_schema(conn: AsyncConnection, config: ConsumerConfig) -> CheckResult | None:
    table = InboxTable(config.inbox_table, schema=config.schema)
    name = table.qualified_name
    database = await conn.scalar(sa.text("SELECT current_database()"))
    place = f'inbox table "{name}" in database "{database}"'
    found = await conn.scalar(sa.text("SELECT to_regclass(:t)"), {"t": name})
    if found is None:
        return _down(
            f'inbox table "{name}" does not exist in database "{database}": run ledgerbox migrate'
        )
    columns = set((await conn.execute(_COLUMNS, {"table": name})).scalars())
    missing = [c.name for c in table.table.columns if c.name not in columns]
    if missing:
        return _down(f"{place} lacks column(s) {', '.join(missing)}: run ledgerbox migrate")
    versions = f"{config.schema}.{SCHEMA_VERSION_TABLE}" if config.schema else SCHEMA_VERSION_TABLE
    readable = sa.text(
        "SELECT CASE WHEN to_regclass(:t) IS NULL THEN false "
        "ELSE has_table_privilege(to_regclass(:t), 'SELECT') END"
    )
    # A role that may not read the version table: the column check above still guards.
    if await conn.scalar(readable, {"t": versions}):
        revisions = set((await conn.execute(sa.text(_REVISIONS.format(table=versions)))).scalars())
        if not any(revision_served(r) for r in revisions):
            at = ", ".join(sorted(revisions)) or "none"
            return _down(
                f'ledgerbox schema in database "{database}" is at revision {at}, this version '
                f"needs {SCHEMA_REVISION_MIN} or later: run ledgerbox migrate"
            )
    wanted = ["SELECT", "INSERT", "UPDATE"]
    lacking = list((await conn.execute(_PRIVILEGES, {"wanted": wanted, "table": name})).scalars())
    if lacking:
        user = await conn.scalar(sa.text("SELECT current_user"))
        return _down(
            f'role "{user}" lacks {", ".join(lacking)} on {place}: '
            f'GRANT {", ".join(lacking)} ON {name} TO "{user}"'
        )
    read_only = await conn.scalar(sa.text("SELECT current_setting('transaction_read_only')"))
    if read_only == "on":
        return _down(
            f'database "{database}" is read-only for new transactions (a standby, or '
            "default_transaction_read_only): point database_url at the primary, or "
            f'ALTER DATABASE "{database}" RESET default_transaction_read_only'
        )
    return None


def kafka_start_fault(exc: BaseException, servers: str) -> CheckResult:
    """The verdict for a Kafka client that could not start against ``servers``:
    refused credentials are permanent, anything else (no broker answers) transient."""
    error = BrokerError.translate(exc, "connect")
    detail = _detail(error)
    if error.kind in _KAFKA_AUTH:
        return _down(
            f"kafka at {servers} refused the credentials: {detail}: fix the SASL settings",
            permanent=True,
        )
    return _down(kafka_unreachable(servers, detail))


async def kafka_start_verdict(exc: BaseException, kafka: KafkaSettings) -> CheckResult:
    """:func:`kafka_start_fault`, after one login by hand when aiokafka's error hides the
    cause ("Unable to bootstrap"): a refused password or a TLS mismatch is permanent."""
    problem = await probe_kafka(kafka)
    if problem is not None and problem.kind != "Unreachable":
        return _down(problem.cause, permanent=problem.permanent)
    return kafka_start_fault(exc, kafka.bootstrap_servers)


async def _check_kafka(
    config: ConsumerConfig, check_topics: bool, timeout_s: float
) -> CheckResult | None:
    from aiokafka import AIOKafkaConsumer

    kafka = config.kafka_settings
    servers = kafka.bootstrap_servers
    # Checked first so that a broker that is away, or refuses our login, costs no aiokafka
    # client (which logs an ERROR line of its own for every refused connection and hides
    # the cause of a refusal behind "Unable to bootstrap").
    problem = await probe_kafka(kafka, timeout_s)
    if problem is not None:
        return _down(problem.cause, permanent=problem.permanent)
    probe = AIOKafkaConsumer(**kafka.client_kwargs(), request_timeout_ms=int(timeout_s * 1000))
    try:
        async with asyncio.timeout(timeout_s + 5):
            await probe.start()
            topics = await probe.topics()
    except TimeoutError:
        return _down(f"kafka at {servers} did not answer within {timeout_s:g} s")
    except Exception as exc:
        return kafka_start_fault(exc, servers)
    finally:
        with contextlib.suppress(Exception):
            await probe.stop()
    wanted = {t for t, _p in config.assignment} if config.assignment else set(config.topics)
    missing = sorted(wanted - set(topics)) if check_topics else []
    if missing and not await _auto_creates_topics(kafka, timeout_s):
        return _down(
            f"topic(s) {', '.join(missing)} do not exist on kafka at {servers} and the broker "
            "does not create topics (auto.create.topics.enable=false): create them"
        )
    return None


async def _auto_creates_topics(kafka: KafkaSettings, timeout_s: float) -> bool:
    # The broker's own setting; unknown (no permission to describe it) counts as "no".
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = AIOKafkaAdminClient(**kafka.client_kwargs(), request_timeout_ms=int(timeout_s * 1000))
    try:
        async with asyncio.timeout(timeout_s + 5):
            await admin.start()
            cluster = await admin.describe_cluster()
            broker = str(cluster["brokers"][0]["node_id"])
            resource = ConfigResource(
                ConfigResourceType.BROKER, broker, {"auto.create.topics.enable": None}
            )
            responses = await admin.describe_configs([resource])
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            await admin.close()
    for response in responses:
        for _code, _message, _type, _name, entries in response.resources:
            for entry in entries:
                if entry[0] == "auto.create.topics.enable":
                    return str(entry[1]).lower() == "true"
    return False


async def _check_redis(config: ConsumerConfig, timeout_s: float) -> CheckResult | None:
    from ledgerbox.inbox._redis import RedisDedupStore, redis_client

    assert config.redis_url is not None
    client = redis_client(
        config.redis_url,
        timeout_s=min(config.redis_timeout_s, timeout_s),
        ca_file=config.redis_ssl_cafile,
    )
    try:
        await RedisDedupStore(client).ping()
    except Exception as exc:
        return CheckResult(
            "degraded",
            f"redis unreachable ({_first_line(exc)}): consumers stay correct on the database "
            "alone, slower; start redis or fix redis_url",
        )
    finally:
        with contextlib.suppress(Exception):
            await client.aclose()
    return None


def _detail(error: BaseException) -> str:
    # "connect failed: OperationalError: ..." -> the part after the seam's prefix.
    text = _first_line(error)
    return text.split(" failed: ", 1)[1] if " failed: " in text else text


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
