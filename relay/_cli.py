"""Command line of the relay: ``run``, ``check`` and ``status``.

Every ``run`` flag is mirrored by an environment variable (``LEDGERBOX_RELAY_<FLAG>``, plus
``DATABASE_URL`` and ``KAFKA_BOOTSTRAP_SERVERS``) through :class:`RelaySettings`; a flag given
on the command line wins.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Annotated, Any

import typer
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ledgerbox._core.errors import LedgerboxError
from ledgerbox.relay._config import Compression, OnDeadLetter, RelayConfig
from ledgerbox.relay._publisher import KafkaPublisher
from ledgerbox.relay._relay import Relay
from ledgerbox.relay._store import RelayStore

__all__ = ["RelaySettings", "app", "main"]

app = typer.Typer(help="ledgerbox relay: publish committed outbox events to Kafka.")


class RelaySettings(BaseSettings):
    """Relay settings from the environment (prefix ``LEDGERBOX_RELAY_``); see RelayConfig."""

    model_config = SettingsConfigDict(env_prefix="LEDGERBOX_RELAY_", extra="ignore")

    database_url: str = Field(
        validation_alias=AliasChoices(
            "LEDGERBOX_RELAY_DATABASE_URL", "DATABASE_URL", "database_url"
        )
    )
    kafka_bootstrap_servers: str = Field(
        default="127.0.0.1:9092",
        validation_alias=AliasChoices(
            "LEDGERBOX_RELAY_KAFKA_BOOTSTRAP_SERVERS",
            "KAFKA_BOOTSTRAP_SERVERS",
            "kafka_bootstrap_servers",
        ),
    )
    outbox_table: str = "outbox"
    db_schema: str | None = None
    batch_size: int = 1000
    lanes: int = 8
    poll_interval_s: float = 1.0
    lease_ttl_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    compression: Compression = "lz4"
    on_dead_letter: OnDeadLetter = "hold"
    retention_s: float = 7 * 86400.0
    relay_id: str | None = None
    shard_count: int = 64
    linger_ms: int = 0
    metrics_port: int = 0
    log_level: str = "INFO"

    def to_config(self) -> RelayConfig:
        """The validated :class:`RelayConfig` (raises ``ledgerbox.ConfigurationError``)."""
        return RelayConfig(
            database_url=self.database_url,
            kafka_bootstrap_servers=self.kafka_bootstrap_servers,
            outbox_table=self.outbox_table,
            schema=self.db_schema,
            batch_size=self.batch_size,
            lanes=self.lanes,
            poll_interval_s=self.poll_interval_s,
            lease_ttl_s=self.lease_ttl_s,
            heartbeat_interval_s=self.heartbeat_interval_s,
            compression=self.compression,
            on_dead_letter=self.on_dead_letter,
            retention_s=self.retention_s,
            relay_id=self.relay_id,
            shard_count=self.shard_count,
            linger_ms=self.linger_ms,
        )


def _settings(**flags: Any) -> RelaySettings:
    given = {k: v for k, v in flags.items() if v is not None}
    try:
        return RelaySettings(**given)
    except Exception as exc:  # pydantic ValidationError: a readable message, exit 2
        typer.echo(f"invalid relay settings: {exc}", err=True)
        raise typer.Exit(2) from exc


_Url = Annotated[str | None, typer.Option(help="SQLAlchemy or libpq URL [env DATABASE_URL]")]
_Kafka = Annotated[
    str | None, typer.Option(help="host:port[,host:port] [env KAFKA_BOOTSTRAP_SERVERS]")
]
_Table = Annotated[str | None, typer.Option(help="outbox table [LEDGERBOX_RELAY_OUTBOX_TABLE]")]
_Schema = Annotated[str | None, typer.Option("--schema", help="schema [LEDGERBOX_RELAY_DB_SCHEMA]")]


@app.command()
def run(
    database_url: _Url = None,
    kafka_bootstrap_servers: _Kafka = None,
    outbox_table: _Table = None,
    schema: _Schema = None,
    batch_size: Annotated[int | None, typer.Option(help="events per batch")] = None,
    lanes: Annotated[int | None, typer.Option(help="concurrent pipelines, 1..64")] = None,
    poll_interval_s: Annotated[float | None, typer.Option(help="polling fallback, s")] = None,
    lease_ttl_s: Annotated[float | None, typer.Option(help="shard lease TTL, s")] = None,
    heartbeat_interval_s: Annotated[float | None, typer.Option(help="heartbeat, s")] = None,
    compression: Annotated[str | None, typer.Option(help="lz4|zstd|gzip|snappy|none")] = None,
    on_dead_letter: Annotated[str | None, typer.Option(help="hold|skip")] = None,
    retention_s: Annotated[float | None, typer.Option(help="keep published rows, s")] = None,
    relay_id: Annotated[str | None, typer.Option(help="name in the lease table")] = None,
    shard_count: Annotated[int | None, typer.Option(help="must match the writers")] = None,
    linger_ms: Annotated[int | None, typer.Option(help="producer linger, ms")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus port, 0 = off")] = None,
    log_level: Annotated[str | None, typer.Option(help="DEBUG|INFO|WARNING")] = None,
) -> None:
    """Run the relay until SIGTERM or SIGINT; exit 0 after a clean shutdown."""
    settings = _settings(
        database_url=database_url,
        kafka_bootstrap_servers=kafka_bootstrap_servers,
        outbox_table=outbox_table,
        db_schema=schema,
        batch_size=batch_size,
        lanes=lanes,
        poll_interval_s=poll_interval_s,
        lease_ttl_s=lease_ttl_s,
        heartbeat_interval_s=heartbeat_interval_s,
        compression=compression,
        on_dead_letter=on_dead_letter,
        retention_s=retention_s,
        relay_id=relay_id,
        shard_count=shard_count,
        linger_ms=linger_ms,
        metrics_port=metrics_port,
        log_level=log_level,
    )
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    config = _config(settings)
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port)
    asyncio.run(_run(config))


async def _run(config: RelayConfig) -> None:
    relay = Relay(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, relay.stop)
    logging.getLogger("ledgerbox.relay").info("relay %s starting", config.member_id)
    await relay.run()
    logging.getLogger("ledgerbox.relay").info("relay %s stopped", config.member_id)


def _config(settings: RelaySettings) -> RelayConfig:
    try:
        return settings.to_config()
    except LedgerboxError as exc:
        typer.echo(f"invalid relay settings: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command()
def check(
    database_url: _Url = None,
    kafka_bootstrap_servers: _Kafka = None,
    outbox_table: _Table = None,
    schema: _Schema = None,
) -> None:
    """Health: exit 0 if PostgreSQL and Kafka answer, 1 otherwise (one line of output)."""
    settings = _settings(
        database_url=database_url,
        kafka_bootstrap_servers=kafka_bootstrap_servers,
        outbox_table=outbox_table,
        db_schema=schema,
    )
    ok, line = asyncio.run(_check(_config(settings)))
    typer.echo(line)
    raise typer.Exit(0 if ok else 1)


async def _check(config: RelayConfig) -> tuple[bool, str]:
    store = RelayStore(config, "check")
    db = "ok"
    try:
        await asyncio.wait_for(store.ping(), 10)
    except (LedgerboxError, TimeoutError) as exc:
        db = f"FAIL ({type(exc).__name__})"
    finally:
        await store.aclose()
    publisher = KafkaPublisher(config.kafka_bootstrap_servers, compression="none")
    kafka = "ok"
    try:
        await asyncio.wait_for(publisher.check(), 15)
    except Exception as exc:
        kafka = f"FAIL ({type(exc).__name__})"
    finally:
        await publisher.stop()
    healthy = db == "ok" and kafka == "ok"
    return healthy, f"relay {'ok' if healthy else 'unhealthy'}: database {db}, kafka {kafka}"


@app.command()
def status(
    database_url: _Url = None,
    outbox_table: _Table = None,
    schema: _Schema = None,
    shard_count: Annotated[int | None, typer.Option(help="must match the writers")] = None,
) -> None:
    """Pending count, oldest pending age, dead count and the shard owners."""
    settings = _settings(
        database_url=database_url,
        outbox_table=outbox_table,
        db_schema=schema,
        shard_count=shard_count,
    )
    config = _config(settings)

    async def read() -> None:
        store = RelayStore(config, "status")
        try:
            stats = await store.stats(config.shard_count)
        finally:
            await store.aclose()
        age = stats.oldest_pending_age_s
        typer.echo(f"pending: {stats.pending}")
        typer.echo(f"oldest pending age s: {'-' if age is None else f'{age:.1f}'}")
        typer.echo(f"dead-lettered: {stats.dead_lettered}")
        if not stats.owners:
            typer.echo("shards: no lease rows yet (no relay has started)")
        owners: dict[str, list[int]] = {}
        for shard, owner, _fence, live in stats.owners:
            name = "leader" if shard < 0 else "shards"
            label = f"{owner if (owner and live) else '(free)'}"
            owners.setdefault(f"{label} {name}", []).append(shard)
        for label, shards in sorted(owners.items()):
            typer.echo(f"{label}: {_ranges(shards)}")

    try:
        asyncio.run(read())
    except LedgerboxError as exc:
        typer.echo(f"status failed: {exc}", err=True)
        raise typer.Exit(1) from exc


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5 (4)"``."""
    parts: list[str] = []
    ordered = sorted(values)
    start = prev = ordered[0]
    for value in [*ordered[1:], None]:
        if value is not None and value == prev + 1:
            prev = value
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return f"{','.join(parts)} ({len(values)})"


def main() -> None:
    """Entry point of ``python -m ledgerbox.relay``."""
    app()
