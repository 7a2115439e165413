"""``ledgerbox consumer`` / ``python -m ledgerbox.inbox``: run a consumer, check its health, purge.

Every flag is mirrored by an environment variable with the prefix ``LEDGERBOX_CONSUMER_``
(the command's name), e.g. ``--app`` by ``LEDGERBOX_CONSUMER_APP``; connection URLs also read
``DATABASE_URL``, ``KAFKA_BOOTSTRAP_SERVERS`` and ``REDIS_URL`` (the prefixed one wins). The
former prefix ``LEDGERBOX_INBOX_`` works for one release, with a warning. The mechanism:
:mod:`ledgerbox._core.settings`; the table: docs/configuration.md. ``check`` exit codes: 0 ok,
1 degraded (Redis down, consumers still correct; ``--group`` without ``--topic`` naming a
group that committed no offsets), 2 down (PostgreSQL or Kafka unreachable,
inbox table missing or behind, privilege, read-only database, topics missing); it prints one
line naming the cause and the fix (:mod:`ledgerbox.inbox._checks`). ``run`` and ``purge``
report an expected refusal in one line on stderr and exit 2, without a traceback.

Kafka security: the app's ``ConsumerConfig(kafka=...)`` decides (build it with
``KafkaSettings.from_env("consumer")`` to read ``LEDGERBOX_CONSUMER_KAFKA_*`` / ``KAFKA_*``);
``check`` without ``--app`` takes the same settings as flags (docs/security.md). The metrics
endpoint binds ``--metrics-host`` (default ``127.0.0.1``). What the commands print and log
is scrubbed of every secret in use (:mod:`ledgerbox._core.redaction`).
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import typer

from ledgerbox._core import telemetry
from ledgerbox._core.database_url import database_label
from ledgerbox._core.durations import check_duration
from ledgerbox._core.endpoint import DEFAULT_HOST, check_port, serve_metrics
from ledgerbox._core.errors import ConfigurationError, LedgerboxError
from ledgerbox._core.event_loop import EVENT_LOOP_SETTING, runner
from ledgerbox._core.kafka import KAFKA_SETTING_NAMES, KafkaSettings, cli_settings
from ledgerbox._core.operator_failures import failure_line, quiet_kafka_client
from ledgerbox._core.operator_settings import OPERATOR_FILTERS
from ledgerbox._core.redaction import install_scrub_filter, scrub
from ledgerbox._core.references import first_line, import_reference
from ledgerbox._core.settings import (
    LOG_LEVEL_SETTING,
    CommandSettings,
    Setting,
    SettingsError,
    Values,
    configure_logging,
)
from ledgerbox.inbox._checks import check_consumer
from ledgerbox.inbox._config import ConsumerConfig
from ledgerbox.inbox._consumer import InboxConsumer
from ledgerbox.inbox._health import HEALTH_CODES
from ledgerbox.inbox._lag import group_lag, no_offsets_line

__all__ = ["CONSUMER_SETTINGS", "app", "load_consumer"]

# pretty_exceptions_show_locals=False: a traceback must not print local values (secrets).
app = typer.Typer(
    help="ledgerbox inbox consumer: run handlers, check health, purge.",
    pretty_exceptions_show_locals=False,
)


def _refused(command: str, exc: BaseException | str) -> typer.Exit:
    # An expected refusal (settings, credentials, a purge inside the dedup window): one line.
    typer.echo(scrub(f"ledgerbox consumer {command}: {exc}"), err=True)
    return typer.Exit(2)


#: Every setting of ``ledgerbox consumer``.
CONSUMER_SETTINGS = CommandSettings(
    "consumer",
    [
        Setting(
            "app",
            str,
            help="module:attribute of an InboxConsumer or of a no-argument factory of one",
            label="consumer app (module:attribute)",
        ),
        LOG_LEVEL_SETTING,
        EVENT_LOOP_SETTING,
        Setting(
            "metrics_port",
            int,
            help="Serve Prometheus metrics on this port (1..65535; unset or 0: off)",
        ),
        Setting(
            "metrics_host",
            str,
            default=DEFAULT_HOST,
            help="Address the metrics endpoint binds to (another one exposes it beyond this "
            "machine)",
        ),
        Setting(
            "database_url",
            str,
            help="SQLAlchemy URL of the inbox database (check without --app)",
            well_known=("DATABASE_URL",),
            secret=True,
            label="database URL",
        ),
        Setting(
            "kafka_bootstrap_servers",
            str,
            help="host:port[,host:port] (check without --app)",
            well_known=("KAFKA_BOOTSTRAP_SERVERS",),
        ),
        *cli_settings(),
        Setting(
            "redis_url",
            str,
            help="redis://... or rediss://... (check without --app; unset: no Redis)",
            well_known=("REDIS_URL",),
            secret=True,
        ),
        Setting(
            "redis_ssl_cafile",
            str,
            help="PEM file of the Redis server's CA, for rediss:// (check without --app)",
        ),
        Setting(
            "older_than_s",
            float,
            help="purge: rows older than this (unset: the consumer's retention_s); dlq: only"
            " records dead-lettered more than this long ago",
            unit="s",
        ),
        # `ledgerbox consumer dlq ...` and `ledgerbox consumer lag` (ledgerbox.admin;
        # docs/operations.md)
        *(s for s in OPERATOR_FILTERS if s.name != "older_than_s"),
        Setting("schema", str, help="dlq: schema of the inbox and operator tables"),
        Setting("inbox_table", str, default="inbox", help="dlq: the inbox table"),
        Setting(
            "dlq_topic",
            str,
            help="dlq: the dead-letter topic to read (<source topic>.dlq by default)",
            command_line=True,
        ),
        Setting("group", str, help="dlq: only records of this consumer group; lag: the group"),
        Setting("topic", str, help="lag: these topics (comma-separated; unset: the group's own)"),
    ],
    old_prefix="LEDGERBOX_INBOX_",
)


def _require_app(values: Values) -> str:
    app_ref: str | None = values["app"]
    if app_ref is None:
        CONSUMER_SETTINGS.fail(SettingsError("no consumer app (module:attribute)", setting="app"))
    return app_ref


def load_consumer(reference: str) -> InboxConsumer:
    """Import ``module:attribute``: an :class:`InboxConsumer` or a no-argument factory of one.

    Raises
    ------
    ledgerbox.ConfigurationError
        ``setting="app"``, one line: the reference is malformed, its module is not found
        or failed to import, it has no such attribute, the factory failed (other than with
        a ledgerbox error, which is raised as it is: the consumer's own settings), or it is
        no consumer (:func:`ledgerbox._core.references.import_reference`).
    """
    target: Any = import_reference(reference, "app")
    if not isinstance(target, InboxConsumer) and callable(target):
        try:
            target = target()
        except LedgerboxError:
            raise  # the consumer's own configuration: said by the caller as it is
        except (Exception, SystemExit) as exc:  # a factory that calls sys.exit() too
            raise ConfigurationError(
                f"app {reference!r}: calling it as a no-argument factory raised "
                f"{first_line(exc)}: name an InboxConsumer or a factory of one",
                setting="app",
            ) from None
    if not isinstance(target, InboxConsumer):
        raise ConfigurationError(
            f"app {reference!r} is not an InboxConsumer nor a no-argument factory of one "
            f"(got {type(target).__name__})",
            setting="app",
        )
    return target


def _load(command: str, values: Values) -> InboxConsumer:
    """The consumer of ``--app``: a bad reference is one line naming --app and
    LEDGERBOX_CONSUMER_APP (exit 2); the consumer's own refusal (its config) one line too."""
    try:
        return load_consumer(_require_app(values))
    except ConfigurationError as exc:
        if exc.setting == "app":
            CONSUMER_SETTINGS.fail(exc, values)
        raise _refused(command, exc) from None
    except LedgerboxError as exc:
        raise _refused(command, exc) from None


async def _run(consumer: InboxConsumer) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, consumer.stop)
    await consumer.run()


@CONSUMER_SETTINGS.typer_command(
    app, "run", ["app", "log_level", "metrics_port", "metrics_host", "event_loop"]
)
def run_command(values: Values, ctx: typer.Context) -> None:
    """Run the consumer until SIGTERM/SIGINT; in-flight records finish, offsets commit."""
    configure_logging(CONSUMER_SETTINGS, values["log_level"])
    install_scrub_filter()
    try:
        run_loop = runner(values["event_loop"])
        if values["metrics_port"] is not None:
            check_port(values["metrics_port"], "metrics_port", zero="off")
    except ConfigurationError as exc:
        CONSUMER_SETTINGS.fail(exc, values)
    consumer = _load("run", values)
    try:
        telemetry.configure(f"ledgerbox-consumer-{consumer.group_id}")  # if OTEL_* asks
        if values["metrics_port"]:
            try:
                serve_metrics(values["metrics_port"], values["metrics_host"])
            except ConfigurationError as exc:
                CONSUMER_SETTINGS.fail(exc, values)
        run_loop(_run(consumer))
    except LedgerboxError as exc:  # invalid settings, refused credentials
        raise _refused("run", exc) from None
    finally:
        telemetry.shutdown()  # export the last spans


@CONSUMER_SETTINGS.typer_command(
    app,
    "check",
    [
        "app",
        "database_url",
        "kafka_bootstrap_servers",
        *KAFKA_SETTING_NAMES,
        "redis_url",
        "redis_ssl_cafile",
        "group",
        "topic",
    ],
)
def check_command(values: Values, ctx: typer.Context) -> None:
    """Print ok / degraded: cause / down: cause (one line with the fix); exit 0 / 1 / 2.
    With --app (or --group and --topic), then the group's lag per partition."""
    if values["app"] is not None:
        config = _load("check", values).config
        if values["group"] or values["topic"]:
            # A newcomer's review: --group was dropped without a word.
            typer.echo(
                f"ledgerbox consumer check: --group/--topic are not used with --app: the app's"
                f" group {config.group_id} and its topics are checked",
                err=True,
            )
    else:
        for name in ("database_url", "kafka_bootstrap_servers"):
            if values[name] is None:
                CONSUMER_SETTINGS.fail(
                    SettingsError(
                        f"no {name} (give --app, or --database-url and --kafka-bootstrap-servers)",
                        setting=name,
                    )
                )
        try:
            config = ConsumerConfig(
                group_id="ledgerbox-check",
                topics=["ledgerbox-check"],
                database_url=values["database_url"],
                kafka=KafkaSettings.from_values(
                    values, bootstrap_servers=values["kafka_bootstrap_servers"]
                ),
                redis_url=values["redis_url"],
                redis_ssl_cafile=values["redis_ssl_cafile"],
            )
        except ConfigurationError as exc:
            CONSUMER_SETTINGS.fail(exc, values)
    result = asyncio.run(check_consumer(config, check_topics=values["app"] is not None))
    typer.echo(scrub(result.line))
    code = HEALTH_CODES[result.state]
    if result.state != "down" and (values["app"] is not None or values["group"]):
        group = config.group_id if values["app"] is not None else values["group"]
        topics = list(config.topics) if values["app"] is not None else _topics(values)
        if not _echo_lag(config.kafka_settings, group, topics):
            code = max(code, HEALTH_CODES["degraded"])
    raise typer.Exit(code)


def _topics(values: Values) -> list[str] | None:
    return [t.strip() for t in (values["topic"] or "").split(",") if t.strip()] or None


def _echo_lag(kafka: KafkaSettings, group: str, topics: list[str] | None) -> bool:
    """``lag <topic>[<partition>]: ...`` per partition, then the total; a failure to read
    it is one line and does not change the health's exit code. ``False`` when the group
    (given without its topics) has committed no offsets anywhere: its lag is unknown, not
    0 (a misspelt name, or a group that never committed), said in one line: degraded."""
    try:
        found = asyncio.run(group_lag(kafka, group, topics))
        if not found and not topics:
            typer.echo(
                f"lag of group {group}: unknown: {asyncio.run(no_offsets_line(kafka, group))}"
            )
            return False
    except LedgerboxError as exc:
        typer.echo(scrub(f"lag of group {group}: unavailable: {exc}"))
        return True
    for lag in found:
        committed = "-" if lag.committed is None else str(lag.committed)
        typer.echo(
            f"lag {lag.topic}[{lag.partition}]: {lag.lag} (committed {committed}, high"
            f" watermark {lag.high})"
        )
    typer.echo(f"lag of group {group}: {sum(lag.lag for lag in found)} records")
    return True


@CONSUMER_SETTINGS.typer_command(app, "purge", ["app", "older_than_s"])
def purge_command(values: Values, ctx: typer.Context) -> None:
    """Delete the group's inbox rows older than the dedup window whose records Kafka can no
    longer redeliver, in small batches."""
    if values["older_than_s"] is not None:
        try:  # inf, nan, 1e300: refused before the app is loaded, naming the flag
            check_duration(values["older_than_s"], "older_than_s")
        except ConfigurationError as exc:
            CONSUMER_SETTINGS.fail(exc, values)
    consumer = _load("purge", values)

    async def purge() -> int:
        try:
            return await consumer.purge(values["older_than_s"])
        finally:
            await consumer.aclose()

    # Inside the dedup window, Kafka or the database away, the tables missing: one line with
    # the fix, as every operator command says it.
    config = consumer.config
    quiet_kafka_client()
    try:
        deleted = asyncio.run(purge())
    except LedgerboxError as exc:
        line = failure_line(
            exc,
            database_at=database_label(config.database_url),
            url_flag="database_url",
            kafka=config.kafka_settings,
        )
        raise _refused("purge", line) from None
    typer.echo(f"deleted {deleted} inbox rows")
