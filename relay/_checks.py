"""The relay's startup checks (``ledgerbox relay check`` and the start of ``relay run``).

Each problem is ONE line naming the cause and the fix, and is either *permanent* (the
settings are wrong: a refused login, a database that does not exist; ``relay run`` exits
with code 2) or *transient* (something is not there yet or not reachable: the relay starts,
stays ``down`` with the cause and recovers by itself once it is fixed). Nothing here raises
for an expected condition (docs/relay.md, "Health").
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ledgerbox._core.database_url import database_label, refused_login
from ledgerbox._core.errors import kafka_unreachable
from ledgerbox._core.faults import Fault, login_refused
from ledgerbox._core.kafka_probe import LOGIN_REFUSED, probe_kafka
from ledgerbox._core.names import SCHEMA_REVISION_MIN, SCHEMA_REVISIONS, revision_served
from ledgerbox.relay._config import RelayConfig
from ledgerbox.relay._errors import PublishError, StoreError
from ledgerbox.relay._maintenance import stray_cause
from ledgerbox.relay._policy import shard_ranges
from ledgerbox.relay._publisher import KafkaPublisher
from ledgerbox.relay._store import RelayStore, SchemaReport

__all__ = ["CheckResult", "Problem", "check_relay"]

#: Kafka error kinds that mean "the login was refused" (permanent: wrong credentials).
_KAFKA_LOGIN = LOGIN_REFUSED


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing in the way of publishing.

    Attributes
    ----------
    permanent : bool
        The settings are wrong (``relay run`` exits); else it may fix itself or be fixed
        while the relay runs.
    line : str
        ``"<cause>: <fix>"`` in one line, without secrets.
    """

    permanent: bool
    line: str
    #: A permanent verdict read from libpq's account of a failed connection (a restarting
    #: server looks like a refused login once): ``relay run`` looks once more before exiting.
    recheck: bool = False


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The outcome of :func:`check_relay`: the problems, and what was found healthy."""

    problems: list[Problem]
    healthy: list[str]

    @property
    def ok(self) -> bool:
        """No problem at all."""
        return not self.problems


async def check_relay(
    config: RelayConfig, store: RelayStore, kafka: KafkaPublisher, *, timeout_s: float = 15.0
) -> CheckResult:
    """Check the database (reachable, tables and columns at the expected schema revision,
    grants, not read-only), Kafka (reachable, the TLS and SASL settings accepted: one login
    by hand, :func:`ledgerbox._core.kafka_probe.probe_kafka`) and the topics of waiting
    events (exist, or the brokers create topics).

    Parameters
    ----------
    timeout_s : float
        Bound of each of the database and Kafka checks, in seconds.
    """
    problems: list[Problem] = []
    healthy: list[str] = []
    pending_topics: list[str] = []
    try:
        async with asyncio.timeout(timeout_s):
            await store.ping()
            report = await store.schema_report()
    except StoreError as exc:
        problems.append(_database_problem(config, exc))
    except TimeoutError:
        problems.append(
            Problem(False, f"the database did not answer within {timeout_s:g} s: check it runs")
        )
    else:
        found = _schema_problems(config, report)
        if not found:
            found = await _refused_problems(store, timeout_s)
        if not found:
            found = await _stray_problems(config, store, timeout_s)
        problems += found
        pending_topics = report.pending_topics
        if not found:
            healthy.append(f"database ok (schema {report.revision or 'embedded'})")
    if any(p.permanent for p in problems):
        # The relay will not start (run exits with this line alone): Kafka is not asked.
        return CheckResult(problems, healthy)
    servers = config.kafka_settings.bootstrap_servers
    login = await probe_kafka(config.kafka_settings, timeout_s=timeout_s)
    if login is not None:
        if login.kind == "Unreachable":
            problems.append(
                Problem(
                    False,
                    kafka_unreachable(servers),
                )
            )
        else:
            problems.append(Problem(login.permanent, login.cause))
        return CheckResult(problems, healthy)
    try:
        async with asyncio.timeout(timeout_s):
            brokers, topics, auto_create = await kafka.cluster(pending_topics)
    except PublishError as exc:
        problems.append(_kafka_problem(config, exc))
    except TimeoutError:
        problems.append(
            Problem(
                False,
                f"Kafka at {servers} did not answer within "
                f"{timeout_s:g} s: start it, or fix --kafka-bootstrap-servers",
            )
        )
    else:
        healthy.append(f"kafka ok ({brokers} broker{'s' if brokers != 1 else ''})")
        missing = sorted(set(pending_topics) - topics)
        if missing and not auto_create:
            problems.append(
                Problem(
                    False,
                    f"topics {', '.join(missing)} have events waiting but do not exist and "
                    "the brokers do not create topics: create them",
                )
            )
    return CheckResult(problems, healthy)


def _database_problem(config: RelayConfig, exc: StoreError) -> Problem:
    state = exc.sqlstate or ""
    if login_refused(exc):  # the user, the password or the database: named, all three
        where = database_label(config.database_url)
        return Problem(True, refused_login(exc, where, "the database URL"), recheck=True)
    if state == "3D000":
        return Problem(True, f"{exc}: create the database or fix the database URL")
    if state.startswith("42"):
        return Problem(False, f"the database refused the check ({exc}): GRANT the relay's role")
    return Problem(False, f"the database is unreachable ({exc}): start it or fix the URL's host")


def _grant_line(config: RelayConfig, report: SchemaReport) -> str:
    """``role "r" lacks UPDATE, DELETE on outbox: GRANT UPDATE, DELETE ON outbox TO "r"``: the
    missing privileges (``"<privilege> on <table>"``) grouped per table, with the statements
    that fix them (the same form as the consumer's check; docs/security.md, "Least
    privilege")."""
    per_table: dict[str, list[str]] = {}
    for item in report.missing_privileges:
        privilege, _, table = item.partition(" on ")
        per_table.setdefault(table, []).append(privilege)
    role = f'"{report.role}"' if report.role else "the relay's role"
    prefix = f"{config.schema}." if config.schema else ""
    lacks = " and ".join(f"{', '.join(p)} on {t}" for t, p in per_table.items())
    grants = "; ".join(
        f"GRANT {', '.join(p)} ON {prefix}{t} TO {role}" for t, p in per_table.items()
    )
    return f"role {role} lacks {lacks}: {grants}"


def _schema_problems(config: RelayConfig, report: SchemaReport) -> list[Problem]:
    where = f"schema {config.schema}" if config.schema else "the search path"
    problems: list[Problem] = []
    if report.missing_tables:
        problems.append(
            Problem(
                False,
                f"tables {', '.join(report.missing_tables)} do not exist in {where}: run "
                "`ledgerbox migrate` (or check --schema / --outbox-table)",
            )
        )
        return problems
    if report.revision is not None and not revision_served(report.revision):
        if report.revision in SCHEMA_REVISIONS:
            line = (
                f"the ledgerbox tables are at schema revision {report.revision}, this relay "
                f"needs {SCHEMA_REVISION_MIN} or later: run `ledgerbox migrate`"
            )
        else:
            line = (
                f"the ledgerbox tables are at schema revision {report.revision!r}, which this "
                f"relay does not know (it knows {SCHEMA_REVISION_MIN} to {SCHEMA_REVISIONS[-1]}): "
                "upgrade ledgerbox"
            )
        problems.append(Problem(False, line))
    if report.missing_columns:
        problems.append(
            Problem(
                False,
                f"columns {', '.join(report.missing_columns)} do not exist: the schema is "
                "behind this relay: run `ledgerbox migrate` (or the ops of the new revision "
                "in your own Alembic env, docs/migrations.md)",
            )
        )
    if report.missing_privileges:
        problems.append(Problem(False, _grant_line(config, report)))
    if report.read_only:
        problems.append(
            Problem(
                False,
                "the database session is read-only (a replica, or "
                "default_transaction_read_only): point the relay at the primary",
            )
        )
    return problems


async def _stray_problems(
    config: RelayConfig, store: RelayStore, timeout_s: float
) -> list[Problem]:
    # Events in shards outside 0..shard_count-1 are never claimed (the writers' shard_count
    # is larger): not fatal for `relay run` (the other shards are published), but never
    # "ok" (a newcomer's review found status and check silent while half the events waited).
    try:
        async with asyncio.timeout(timeout_s):
            stats = await store.stats(config.shard_count)
    except (StoreError, TimeoutError) as exc:
        cause = f"the pending events could not be counted ({exc}): check the database"
        return [Problem(False, cause)]
    if not stats.stray:
        return []
    return [Problem(False, stray_cause(stats.stray, config.shard_count))]


async def _refused_problems(store: RelayStore, timeout_s: float) -> list[Problem]:
    # Cursors ahead of the database: restored from a dump into another cluster (docs/relay.md,
    # "Restore and rebase"). Not fatal for `relay run`: the other shards are published.
    try:
        async with asyncio.timeout(timeout_s):
            refused = await store.refused_shards()
    except (StoreError, TimeoutError) as exc:
        return [Problem(False, f"the cursors could not be read ({exc}): check the database")]
    if not refused:
        return []
    shards = shard_ranges([s for s, _ in refused])
    return [
        Problem(
            False,
            f"shards {shards} refused: {refused[0][1]}: stop the relays and run "
            "`ledgerbox relay rebase` (docs/relay.md, 'Restore and rebase')",
        )
    ]


def _kafka_problem(config: RelayConfig, exc: PublishError) -> Problem:
    if exc.kind in _KAFKA_LOGIN:
        return Problem(True, f"Kafka refused the login ({exc}): fix the Kafka credentials")
    if exc.fault is Fault.ENVIRONMENT and exc.kind == "TopicAuthorizationFailedError":
        return Problem(False, f"Kafka refused access ({exc}): grant the relay's principal")
    return Problem(
        False,
        kafka_unreachable(config.kafka_settings.bootstrap_servers, str(exc)),
    )
