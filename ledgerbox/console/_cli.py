"""``ledgerbox console``: serve the ops console (docs/console.md).

Settings (docs/configuration.md; the one scheme of :mod:`ledgerbox._core.settings`: flag
``--field-name``, variable ``LEDGERBOX_CONSOLE_FIELD_NAME``): one service from
``--database-url`` (``DATABASE_URL``) and its table/group/topic settings, or several from
``--services-file`` (TOML); the ``kafka_*`` settings for the DLQ records and the lag;
``--host`` (default ``127.0.0.1``), ``--port``, ``--token`` (``LEDGERBOX_CONSOLE_TOKEN``,
or ``--token-file``), REQUIRED when the host is not a loopback address: the console refuses
to start without it (one line, exit 2).
"""

from __future__ import annotations

import errno
import logging
import socket

import typer

from ledgerbox._core.endpoint import DEFAULT_HOST
from ledgerbox._core.errors import ConfigurationError
from ledgerbox._core.kafka import KafkaSettings, cli_settings
from ledgerbox._core.redaction import Secret, install_scrub_filter
from ledgerbox._core.settings import (
    LOG_LEVEL_SETTING,
    CommandSettings,
    Setting,
    Values,
    configure_logging,
)
from ledgerbox.console._config import DEFAULT_PORT, ConsoleConfig, ServiceTarget, load_services_file

__all__ = ["CONSOLE_SETTINGS", "app", "build_config"]

app = typer.Typer(
    help="ledgerbox console: the ops console in the browser.",
    pretty_exceptions_show_locals=False,
)


def _list(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


#: Every setting of ``ledgerbox console``.
CONSOLE_SETTINGS = CommandSettings(
    "console",
    [
        Setting(
            "database_url",
            str,
            help="SQLAlchemy URL of the one service's database (or use --services-file)",
            well_known=("DATABASE_URL",),
            secret=True,
            label="database URL",
        ),
        Setting("service_name", str, default="default", help="Name of that service on the page"),
        Setting("schema", str, help="Schema of its ledgerbox tables (unset: the search path)"),
        Setting("outbox_table", str, default="outbox", help="Its outbox table"),
        Setting("inbox_table", str, default="inbox", help="Its inbox table"),
        Setting("shard_count", int, default=64, help="Its relays' shard_count (1..4096)"),
        Setting("groups", str, help="Comma-separated consumer groups whose lag is shown"),
        Setting(
            "dlq_topics", str, help="Comma-separated dead-letter topics whose records are shown"
        ),
        Setting(
            "relay_metrics",
            str,
            help="Comma-separated metrics URLs of its relays (http://host:port/metrics): the "
            "publish rate",
        ),
        Setting(
            "services_file",
            str,
            help="TOML file with one [[service]] table per service (instead of --database-url)",
        ),
        Setting(
            "kafka_bootstrap_servers",
            str,
            help="host:port[,host:port] of Kafka, for the DLQ records and the lag",
            well_known=("KAFKA_BOOTSTRAP_SERVERS",),
            label="Kafka bootstrap servers",
        ),
        *cli_settings(),
        Setting(
            "host",
            str,
            default=DEFAULT_HOST,
            help="Address to listen on; any but a loopback address requires --token",
        ),
        Setting("port", int, default=DEFAULT_PORT, help="TCP port"),
        Setting(
            "token",
            str,
            help="Token every request must carry (Bearer header or the login form); required "
            "when --host is not a loopback address; 16 characters or more",
            secret=True,
            label="token",
        ),
        Setting("token_file", str, help="File holding the token (instead of --token)"),
        Setting(
            "allowed_hosts",
            str,
            help="Comma-separated extra Host header names accepted (a proxy's name)",
        ),
        LOG_LEVEL_SETTING,
    ],
)

_SERVICE = (
    "database_url", "service_name", "schema", "outbox_table", "inbox_table", "shard_count",
    "groups", "dlq_topics", "relay_metrics",
)  # fmt: skip


def build_config(values: Values) -> ConsoleConfig:
    """The validated :class:`ConsoleConfig` of resolved settings.

    Raises
    ------
    ledgerbox.ConfigurationError
        One line naming the setting (a service without database, both --database-url and
        --services-file, a bad Kafka setting, a non-loopback host without token, ...).
    """
    merged = {**CONSOLE_SETTINGS.defaults(), **{k: v for k, v in values.items() if v is not None}}
    if merged.get("services_file"):
        services = load_services_file(merged["services_file"])
    else:
        if not merged.get("database_url"):
            raise ConfigurationError(
                "no service to show: give --database-url or --services-file",
                setting="database_url",
            )
        services = [
            ServiceTarget(
                name=merged["service_name"],
                database_url=merged["database_url"],
                schema=merged.get("schema"),
                outbox_table=merged["outbox_table"],
                inbox_table=merged["inbox_table"],
                shard_count=merged["shard_count"],
                groups=_list(merged.get("groups")),
                dlq_topics=_list(merged.get("dlq_topics")),
                relay_metrics=_list(merged.get("relay_metrics")),
            )
        ]
    kafka = None
    if merged.get("kafka_bootstrap_servers"):
        kafka = KafkaSettings.from_values(
            merged, bootstrap_servers=merged["kafka_bootstrap_servers"]
        )
    token: Secret | None = None
    if merged.get("token") and merged.get("token_file"):
        raise ConfigurationError("token and token_file are both set: keep one", setting="token")
    if merged.get("token"):
        token = Secret(merged["token"])
    elif merged.get("token_file"):
        try:
            token = Secret.from_file(merged["token_file"])
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or type(exc).__name__
            raise ConfigurationError(
                f"token_file {merged['token_file']!r} cannot be read: {why}",
                setting="token_file",
            ) from None
    return ConsoleConfig(
        services=services,
        kafka=kafka,
        host=merged["host"],
        port=merged["port"],
        token=token,
        allowed_hosts=_list(merged.get("allowed_hosts")),
    )


@CONSOLE_SETTINGS.typer_command(app, "console", list(CONSOLE_SETTINGS.settings))
def console(values: Values, ctx: typer.Context) -> None:
    """Serve the ops console: per service pending, oldest age, publish rate, shard owners,
    held keys, dead events and DLQ records (replay/discard), consumer lag
    (docs/console.md). Until SIGTERM or SIGINT."""
    configure_logging(CONSOLE_SETTINGS, values["log_level"])
    install_scrub_filter()
    try:
        config = build_config(values)
    except ConfigurationError as exc:
        CONSOLE_SETTINGS.fail(exc, values)
    import uvicorn

    from ledgerbox.console._app import create_app

    # Bound before anything is logged: a port in use is the first and only line.
    try:
        sock = _bind(config.host, config.port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            why, fix = "the port is in use", "stop what holds it, or set another --port"
        else:
            why = exc.strerror or type(exc).__name__
            fix = "set --host to an address of this machine (127.0.0.1: this machine only)"
        typer.echo(
            f"ledgerbox console: cannot listen on {config.host}:{config.port} ({why}): {fix}",
            err=True,
        )
        raise typer.Exit(2) from None
    log = logging.getLogger("ledgerbox.console")
    # The port bound (--port 0: the one the system chose), an IPv6 host in brackets.
    bound = sock.getsockname()[1]
    host = f"[{config.host}]" if ":" in config.host else config.host
    log.info(
        "console on http://%s:%d/ for %s (token %s)",
        host,
        bound,
        ", ".join(s.name for s in config.services),
        "required" if config.token_value else "off: loopback only",
    )
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            log_level=values["log_level"].lower(),
            access_log=False,
            server_header=False,
        )
    )
    with sock:
        server.run(sockets=[sock])


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (what uvicorn would bind, with
    ``SO_REUSEADDR`` as it sets it), for :meth:`uvicorn.Server.run`.

    Raises
    ------
    OSError
        The port is in use (``EADDRINUSE``), the host is not an address of this machine,
        or the name does not resolve.
    """
    family, kind, proto, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
