"""``ledgerbox inbox`` / ``python -m ledgerbox.inbox``: run a consumer, check its health, purge.

Every flag is mirrored by an environment variable (pydantic-settings), e.g. ``--app`` by
``LEDGERBOX_INBOX_APP``; connection URLs also read ``DATABASE_URL``, ``KAFKA_BOOTSTRAP_SERVERS``
and ``REDIS_URL``. ``check`` exit codes: 0 ok, 1 degraded (Redis down, consumers still
correct), 2 down (PostgreSQL or Kafka unreachable, inbox table missing or behind, privilege,
read-only database, topics missing); it prints one line naming the cause and the fix
(:mod:`ledgerbox.inbox._checks`). ``run`` and ``purge`` report an expected refusal in one
line on stderr and exit 2, without a traceback.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import signal
import sys
from typing import Annotated, Any

import typer
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ledgerbox._core.errors import LedgerboxError
from ledgerbox.inbox._checks import check_consumer
from ledgerbox.inbox._config import ConsumerConfig
from ledgerbox.inbox._consumer import InboxConsumer
from ledgerbox.inbox._health import HEALTH_CODES

__all__ = ["InboxSettings", "app", "load_consumer"]

app = typer.Typer(help="ledgerbox inbox consumer: run handlers, check health, purge.")


def _refused(command: str, exc: BaseException) -> typer.Exit:
    # An expected refusal (settings, credentials, a purge inside the dedup window): one line.
    typer.echo(f"consumer {command}: {exc}", err=True)
    return typer.Exit(2)


class InboxSettings(BaseSettings):
    """Settings of the inbox CLI; each field is a flag and an environment variable."""

    model_config = SettingsConfigDict(env_prefix="LEDGERBOX_INBOX_", extra="ignore")

    app: str | None = None
    log_level: str = "INFO"
    metrics_port: int | None = None
    database_url: str | None = Field(
        default=None, validation_alias=AliasChoices("LEDGERBOX_INBOX_DATABASE_URL", "DATABASE_URL")
    )
    kafka_bootstrap_servers: str | None = Field(
        default=None,
        validation_alias=AliasChoices(
            "LEDGERBOX_INBOX_KAFKA_BOOTSTRAP_SERVERS", "KAFKA_BOOTSTRAP_SERVERS"
        ),
    )
    redis_url: str | None = Field(
        default=None, validation_alias=AliasChoices("LEDGERBOX_INBOX_REDIS_URL", "REDIS_URL")
    )


def _settings(**given: Any) -> InboxSettings:
    # Flags override the environment; None means "not given on the command line".
    values = {k: v for k, v in given.items() if v is not None}
    return InboxSettings(**values)


def load_consumer(reference: str) -> InboxConsumer:
    """Import ``module:attribute``: an :class:`InboxConsumer` or a no-argument factory of one.

    Raises
    ------
    typer.BadParameter
        If the reference is malformed or does not name a consumer.
    """
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise typer.BadParameter(f"expected module:attribute, got {reference!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: the working directory is importable
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    if not isinstance(target, InboxConsumer) and callable(target):
        target = target()
    if not isinstance(target, InboxConsumer):
        raise typer.BadParameter(f"{reference} is not an InboxConsumer nor a factory of one")
    return target


async def _run(consumer: InboxConsumer) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, consumer.stop)
    await consumer.run()


@app.command("run")
def run_command(
    app_ref: Annotated[
        str | None, typer.Option("--app", help="module:attribute of an InboxConsumer or factory")
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="logging level")] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="serve Prometheus metrics on this port")
    ] = None,
) -> None:
    """Run the consumer until SIGTERM/SIGINT; in-flight records finish, offsets commit."""
    settings = _settings(app=app_ref, log_level=log_level, metrics_port=metrics_port)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    if settings.app is None:
        raise typer.BadParameter("--app (or LEDGERBOX_INBOX_APP) is required")
    try:
        consumer = load_consumer(settings.app)
        if settings.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(settings.metrics_port)
        asyncio.run(_run(consumer))
    except LedgerboxError as exc:  # invalid settings, refused credentials
        raise _refused("run", exc) from None


@app.command("check")
def check_command(
    app_ref: Annotated[str | None, typer.Option("--app", help="module:attribute")] = None,
    database_url: Annotated[str | None, typer.Option(help="SQLAlchemy URL")] = None,
    kafka_bootstrap_servers: Annotated[str | None, typer.Option(help="host:port")] = None,
    redis_url: Annotated[str | None, typer.Option(help="redis://...")] = None,
) -> None:
    """Print ok / degraded: cause / down: cause (one line with the fix); exit 0 / 1 / 2."""
    settings = _settings(
        app=app_ref,
        database_url=database_url,
        kafka_bootstrap_servers=kafka_bootstrap_servers,
        redis_url=redis_url,
    )
    if settings.app is not None:
        try:
            config = load_consumer(settings.app).config
        except LedgerboxError as exc:
            raise _refused("check", exc) from None
    else:
        if settings.database_url is None or settings.kafka_bootstrap_servers is None:
            raise typer.BadParameter("give --app, or --database-url and --kafka-bootstrap-servers")
        config = ConsumerConfig(
            group_id="ledgerbox-check",
            topics=["ledgerbox-check"],
            database_url=settings.database_url,
            kafka_bootstrap_servers=settings.kafka_bootstrap_servers,
            redis_url=settings.redis_url,
        )
    result = asyncio.run(check_consumer(config, check_topics=settings.app is not None))
    typer.echo(result.line)
    raise typer.Exit(HEALTH_CODES[result.state])


@app.command("purge")
def purge_command(
    app_ref: Annotated[str | None, typer.Option("--app", help="module:attribute")] = None,
    older_than_s: Annotated[
        float | None, typer.Option(help="age in seconds (default: the consumer's retention_s)")
    ] = None,
) -> None:
    """Delete the group's inbox rows older than the dedup window whose records Kafka can no
    longer redeliver, in small batches."""
    settings = _settings(app=app_ref)
    if settings.app is None:
        raise typer.BadParameter("--app (or LEDGERBOX_INBOX_APP) is required")
    try:
        consumer = load_consumer(settings.app)

        async def purge() -> int:
            try:
                return await consumer.purge(older_than_s)
            finally:
                await consumer.aclose()

        typer.echo(f"deleted {asyncio.run(purge())} inbox rows")
    except LedgerboxError as exc:  # inside the dedup window, Kafka or the database away
        raise _refused("purge", exc) from None
