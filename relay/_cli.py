"""Command line of the relay: ``run``, ``check``, ``status`` and ``rebase``.

Every :class:`RelayConfig` field is a setting (derived from the dataclass, so none can be
missed): flag ``--field-name``, variable ``LEDGERBOX_RELAY_FIELD_NAME``; the URLs also read
``DATABASE_URL`` and ``KAFKA_BOOTSTRAP_SERVERS`` (the prefixed one wins); a flag wins over the
environment. ``--metrics-port`` and ``--log-level`` follow the same scheme. Renamed: the
schema variable was ``LEDGERBOX_RELAY_DB_SCHEMA``, ``on_dead_letter`` was ``on_dead``
(``LEDGERBOX_RELAY_ON_DEAD``, ``--on-dead``); the old names work for one release, with a
warning. The mechanism: :mod:`ledgerbox._core.settings`; the table: docs/configuration.md.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence

import typer

from ledgerbox._core.errors import ConfigurationError, LedgerboxError
from ledgerbox._core.settings import (
    CommandSettings,
    Setting,
    Values,
    configure_logging,
    settings_from_dataclass,
)
from ledgerbox.relay._config import RelayConfig
from ledgerbox.relay._hooks import RelayHooks
from ledgerbox.relay._pgstore import pg_store_factory
from ledgerbox.relay._publisher import KafkaPublisher
from ledgerbox.relay._relay import Relay

__all__ = ["RELAY_SETTINGS", "app", "main"]

app = typer.Typer(help="ledgerbox relay: publish committed outbox events to Kafka.")

#: Every setting of ``ledgerbox relay`` (the fields of RelayConfig, then the daemon's own).
RELAY_SETTINGS = CommandSettings(
    "relay",
    [
        *settings_from_dataclass(
            RelayConfig,
            database_url={"well_known": ("DATABASE_URL",), "secret": True, "label": "database URL"},
            kafka_bootstrap_servers={
                "well_known": ("KAFKA_BOOTSTRAP_SERVERS",),
                "default": "127.0.0.1:9092",
                "required": False,
            },
            schema={"old_env": ("LEDGERBOX_RELAY_DB_SCHEMA",)},
            on_dead_letter={"old_env": ("LEDGERBOX_RELAY_ON_DEAD",), "old_flags": ("--on-dead",)},
        ),
        Setting(
            "metrics_port", int, default=0, help="Serve Prometheus metrics on this port (0: off)"
        ),
        Setting("log_level", str, default="INFO", help="Logging level (DEBUG, INFO, WARNING)"),
        Setting(
            "margin_s",
            float,
            default=3600.0,
            help="rebase: rows created up to this long before a shard's last persist are sent"
            " again too (clock skew between the old and the new server)",
        ),
    ],
)

_CONFIG_FIELDS = tuple(s.name for s in settings_from_dataclass(RelayConfig))
_CONNECTION = ("database_url", "kafka_bootstrap_servers", "outbox_table", "schema")


def _config(values: Values) -> RelayConfig:
    """The validated config (unset fields: the settings' defaults); exit 2 with one line."""
    merged = {**RELAY_SETTINGS.defaults(), **{k: v for k, v in values.items() if v is not None}}
    given = {k: v for k, v in merged.items() if k in _CONFIG_FIELDS and v is not None}
    try:
        return RelayConfig(**given)
    except ConfigurationError as exc:
        RELAY_SETTINGS.fail(exc, merged)


@RELAY_SETTINGS.typer_command(app, "run", [*_CONFIG_FIELDS, "metrics_port", "log_level"])
def run(values: Values, ctx: typer.Context) -> None:
    """Run the relay until SIGTERM or SIGINT; exit 0 after a clean shutdown."""
    configure_logging(RELAY_SETTINGS, values["log_level"])
    config = _config(values)
    if values["metrics_port"]:
        from prometheus_client import start_http_server

        start_http_server(values["metrics_port"])
    asyncio.run(_run(config, ctx.find_object(RelayHooks)))


async def _run(config: RelayConfig, hooks: RelayHooks | None) -> None:
    relay = Relay(config, hooks=hooks)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, relay.stop)
    logging.getLogger("ledgerbox.relay").info("relay %s starting", config.member_id)
    await relay.run()
    logging.getLogger("ledgerbox.relay").info("relay %s stopped", config.member_id)


@RELAY_SETTINGS.typer_command(app, "check", _CONNECTION)
def check(values: Values, ctx: typer.Context) -> None:
    """Health: exit 0 if PostgreSQL and Kafka answer, 1 otherwise (one line of output)."""
    ok, line = asyncio.run(_check(_config(values)))
    typer.echo(line)
    raise typer.Exit(0 if ok else 1)


async def _check(config: RelayConfig) -> tuple[bool, str]:
    store = pg_store_factory(config)("check")
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
    refused = await _refused(config) if db == "ok" else ""
    healthy = db == "ok" and kafka == "ok" and not refused
    line = f"relay {'ok' if healthy else 'unhealthy'}: database {db}, kafka {kafka}"
    return healthy, line + refused


async def _refused(config: RelayConfig) -> str:
    """``"; shards 3,7 refused: <reason>; <repair>"`` or ``""`` (cursor ahead of the database:
    restored from a dump into another cluster, docs/relay.md, "Restore and rebase")."""
    store = pg_store_factory(config)("check")
    try:
        refused = await asyncio.wait_for(store.refused_shards(), 10)
    except (LedgerboxError, TimeoutError) as exc:
        return f"; cursors FAIL ({type(exc).__name__})"
    finally:
        await store.aclose()
    if not refused:
        return ""
    shards = _ranges([s for s, _ in refused]).split(" ")[0]
    return (
        f"; shards {shards} refused: {refused[0][1]}; stop the relays and run"
        " `ledgerbox relay rebase` (docs/relay.md, 'Restore and rebase')"
    )


@RELAY_SETTINGS.typer_command(
    app, "status", ["database_url", "outbox_table", "schema", "shard_count"]
)
def status(values: Values, ctx: typer.Context) -> None:
    """Pending count, oldest pending age, dead count and the shard owners."""
    config = _config(values)

    async def read() -> None:
        store = pg_store_factory(config)("status")
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
        typer.echo(f"held: {stats.held}")
        if stats.refused:
            typer.echo(
                f"refused shards: {_ranges([s for s, _ in stats.refused])}: {stats.refused[0][1]}"
                " (run `ledgerbox relay rebase`)"
            )

    try:
        asyncio.run(read())
    except LedgerboxError as exc:
        typer.echo(f"status failed: {exc}", err=True)
        raise typer.Exit(1) from exc


@RELAY_SETTINGS.typer_command(
    app,
    "rebase",
    ["database_url", "outbox_table", "schema", "shard_count", "margin_s"],
    switches={
        "dry_run": "Print what would be stamped per shard; change nothing",
        "force": "Run although a live relay holds a lease (its persists are then refused)",
    },
)
def rebase(values: Values, ctx: typer.Context) -> None:
    """Re-seat every shard's cursor after a restore (relays stopped): each event the old
    cursor had not passed, or created after its last persist minus --margin-s, is published
    again, once, in per-key id order (docs/relay.md, 'Restore and rebase')."""
    config = _config(values)

    async def go() -> int:
        store = pg_store_factory(config)("rebase")
        try:
            stats = await store.stats(config.shard_count)
            live = sorted({o for s, o, _, ok in stats.owners if ok and o is not None})
            if live and not values["force"]:
                typer.echo(
                    f"rebase refused: relays {', '.join(live)} hold leases; stop them (or pass"
                    " --force)",
                    err=True,
                )
                return 1
            done = await store.rebase(values["margin_s"], dry_run=values["dry_run"])
        finally:
            await store.aclose()
        verb = "would stamp" if values["dry_run"] else "stamped"
        for shard in done:
            if shard.restamped or shard.frozen:
                typer.echo(
                    f"shard {shard.shard}: {verb} {shard.restamped} rows to send again,"
                    f" {shard.frozen} as published"
                )
        again = sum(s.restamped for s in done)
        typer.echo(
            f"rebase {'dry run' if values['dry_run'] else 'done'}: {len(done)} shards,"
            f" {again} rows to send again"
        )
        return 0

    try:
        code = asyncio.run(go())
    except LedgerboxError as exc:
        typer.echo(f"rebase failed: {exc}", err=True)
        raise typer.Exit(1) from exc
    raise typer.Exit(code)


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


def main(argv: Sequence[str] | None = None, *, hooks: RelayHooks | None = None) -> None:
    """Entry point of ``python -m ledgerbox.relay``.

    Parameters
    ----------
    argv : Sequence[str] | None
        Arguments (default: ``sys.argv[1:]``).
    hooks : RelayHooks | None
        Test-only: handed to the :class:`Relay` of ``run`` (a test entry point under
        ``tests/`` builds them; production never passes any).
    """
    app(args=list(argv) if argv is not None else None, obj=hooks)
