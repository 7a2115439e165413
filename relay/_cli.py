"""Command line of the relay: ``run``, ``check``, ``status`` and ``rebase``.

Every :class:`RelayConfig` field is a setting (derived from the dataclass, so none can be
missed): flag ``--field-name``, variable ``LEDGERBOX_RELAY_FIELD_NAME``; the URLs also read
``DATABASE_URL`` and ``KAFKA_BOOTSTRAP_SERVERS`` (the prefixed one wins); a flag wins over the
environment. The Kafka security settings (``--kafka-security-protocol``, ``--kafka-sasl-*``,
``--kafka-ssl-*``, with their ``KAFKA_*`` variables and ``_file`` forms: docs/security.md)
build the one :class:`~ledgerbox.relay.KafkaSettings` of every Kafka client of the command.
``--metrics-port``, ``--metrics-host`` (default ``127.0.0.1``) and ``--log-level`` follow the
same scheme. Nothing printed carries a secret: the refusals and ``check`` lines are built
without them and scrubbed (:func:`ledgerbox._core.redaction.scrub`). Renamed: the
schema variable was ``LEDGERBOX_RELAY_DB_SCHEMA``, ``on_dead_letter`` was ``on_dead``
(``LEDGERBOX_RELAY_ON_DEAD``, ``--on-dead``); the old names work for one release, with a
warning. The mechanism: :mod:`ledgerbox._core.settings`; the table: docs/configuration.md.
A database URL that can never work is refused by :class:`RelayConfig` (exit 2 at once); a
database that is down is waited for. ``status`` and ``rebase`` report a failed database call
in one line ``ledgerbox relay <command>: <cause>: <fix>`` and exit 2; ``status --json``
prints the fields of ``ledgerbox.admin.RelayStatus``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import signal
import time
from collections.abc import Sequence
from typing import Any

import typer

from ledgerbox._core import telemetry
from ledgerbox._core.database_url import database_label, database_remedy
from ledgerbox._core.durations import check_duration
from ledgerbox._core.endpoint import DEFAULT_HOST, check_port, serve_metrics
from ledgerbox._core.errors import ConfigurationError, DatabaseError, LedgerboxError
from ledgerbox._core.event_loop import EVENT_LOOP_SETTING, loop_name, runner
from ledgerbox._core.faults import PermanentVerdict
from ledgerbox._core.kafka import KAFKA_SETTING_NAMES, KafkaSettings, cli_settings
from ledgerbox._core.operator_settings import OPERATOR_FILTERS, OPERATOR_SWITCHES
from ledgerbox._core.redaction import install_scrub_filter, scrub
from ledgerbox._core.settings import (
    LOG_LEVEL_SETTING,
    CommandSettings,
    Setting,
    Values,
    configure_logging,
    settings_from_dataclass,
)
from ledgerbox.relay._checks import CheckResult, check_relay
from ledgerbox.relay._config import RelayConfig
from ledgerbox.relay._hooks import RelayHooks
from ledgerbox.relay._maintenance import stray_cause
from ledgerbox.relay._pgstore import pg_store_factory
from ledgerbox.relay._policy import shard_ranges
from ledgerbox.relay._publisher import KafkaPublisher
from ledgerbox.relay._relay import Relay
from ledgerbox.relay._status import UNUSED_KAFKA
from ledgerbox.relay._store import HeldKeyRow, RelayStats

__all__ = ["RELAY_SETTINGS", "app", "main"]

# pretty_exceptions_show_locals=False: an unexpected traceback must not print the values
# (URLs, passwords) of the local variables (typer before 0.12.4 showed them by default).
app = typer.Typer(
    help="ledgerbox relay: publish committed outbox events to Kafka.",
    pretty_exceptions_show_locals=False,
)

#: Every setting of ``ledgerbox relay`` (the fields of RelayConfig, then the daemon's own).
RELAY_SETTINGS = CommandSettings(
    "relay",
    [
        *settings_from_dataclass(
            RelayConfig,
            database_url={"well_known": ("DATABASE_URL",), "secret": True, "label": "database URL"},
            # No default: a daemon with an unset address must not silently try localhost.
            kafka_bootstrap_servers={
                "well_known": ("KAFKA_BOOTSTRAP_SERVERS",),
                "label": "Kafka bootstrap servers",
                "required": True,
                "default": None,
            },
            schema={"old_env": ("LEDGERBOX_RELAY_DB_SCHEMA",)},
            on_dead_letter={"old_env": ("LEDGERBOX_RELAY_ON_DEAD",), "old_flags": ("--on-dead",)},
        ),
        *cli_settings(),
        Setting(
            "metrics_port",
            int,
            default=0,
            help="Serve Prometheus metrics on this port (1..65535; 0: off)",
        ),
        Setting(
            "metrics_host",
            str,
            default=DEFAULT_HOST,
            help="Address the metrics endpoint binds to (another one exposes it beyond this "
            "machine)",
        ),
        LOG_LEVEL_SETTING,
        EVENT_LOOP_SETTING,
        Setting(
            "margin_s",
            float,
            default=3600.0,
            help="rebase: rows created up to this long before a shard's last persist are sent"
            " again too (clock skew between the old and the new server)",
        ),
        # `ledgerbox relay dead list|show|replay|discard` (ledgerbox.admin; docs/operations.md)
        *OPERATOR_FILTERS,
        Setting("topic", str, help="dead: only rows of this topic", command_line=True),
    ],
)

_CONFIG_FIELDS = tuple(s.name for s in settings_from_dataclass(RelayConfig))
_CONNECTION = ("database_url", "kafka_bootstrap_servers", *KAFKA_SETTING_NAMES)
_TABLES = ("outbox_table", "schema")
_DAEMON = ("metrics_port", "metrics_host", "log_level", "event_loop")


def _config(values: Values) -> RelayConfig:
    """The validated config (unset fields: the settings' defaults; the Kafka settings from
    the ``kafka_*`` ones); exit 2 with one line."""
    merged = {**RELAY_SETTINGS.defaults(), **{k: v for k, v in values.items() if v is not None}}
    given = {k: v for k, v in merged.items() if k in _CONFIG_FIELDS and v is not None}
    try:
        kafka = None
        # Given, even empty: KafkaSettings names the flag's problem ("must not be empty"), not
        # RelayConfig, whose message is for library callers (it offers kafka=KafkaSettings()).
        if "kafka_bootstrap_servers" in given:
            kafka = KafkaSettings.from_values(
                merged, bootstrap_servers=given["kafka_bootstrap_servers"]
            )
        return RelayConfig(**given, kafka=kafka)
    except ConfigurationError as exc:
        RELAY_SETTINGS.fail(exc, merged)


def _database_config(values: Values) -> RelayConfig:
    """:func:`_config` for the commands that read or change the database only (``status``,
    ``rebase``): no Kafka address is needed, nor used, so none is required."""
    return _config({**values, "kafka_bootstrap_servers": UNUSED_KAFKA})


@RELAY_SETTINGS.typer_command(app, "run", [*_CONFIG_FIELDS, *KAFKA_SETTING_NAMES, *_DAEMON])
def run(values: Values, ctx: typer.Context) -> None:
    """Run the relay until SIGTERM or SIGINT; exit 0 after a clean shutdown."""
    configure_logging(RELAY_SETTINGS, values["log_level"])
    install_scrub_filter()
    config = _config(values)
    try:
        check_port(values["metrics_port"], "metrics_port", zero="off")
    except ConfigurationError as exc:
        RELAY_SETTINGS.fail(exc, values)
    try:
        telemetry.configure("ledgerbox-relay")  # spans only if OTEL_* asks for them
    except ConfigurationError as exc:
        RELAY_SETTINGS.fail(exc, values)
    if values["metrics_port"]:
        try:
            serve_metrics(values["metrics_port"], values["metrics_host"])
        except ConfigurationError as exc:
            RELAY_SETTINGS.fail(exc, values)
    try:
        run_loop = runner(values["event_loop"])
    except ConfigurationError as exc:
        RELAY_SETTINGS.fail(exc, values)
    try:
        run_loop(_run(config, ctx.find_object(RelayHooks)))
    finally:
        telemetry.shutdown()  # export the last spans


async def _run(config: RelayConfig, hooks: RelayHooks | None) -> None:
    log = logging.getLogger("ledgerbox.relay")
    confirm = PermanentVerdict()  # a restarting server looks like a refused login once
    while True:
        result = await _check(config)
        permanent = [p for p in result.problems if p.permanent]
        if not permanent:
            break
        if not all(p.recheck for p in permanent) or confirm.holds(True, time.monotonic()):
            typer.echo(scrub(f"ledgerbox relay: {permanent[0].line}"), err=True)
            raise typer.Exit(2)
        await asyncio.sleep(confirm.window_s)  # one more look at a refused login
    for problem in result.problems:
        # Not fatal: the relay starts, stays down with the cause and recovers once fixed.
        log.warning("relay starts down: %s", problem.line)
    relay = Relay(config, hooks=hooks)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, relay.stop)
    log.info(
        "relay %s starting: database %s, kafka %s, event loop %s",
        config.member_id,
        config.database_label,
        config.kafka_settings.describe(),
        loop_name(),
    )
    await relay.run()
    log.info("relay %s stopped", config.member_id)


@RELAY_SETTINGS.typer_command(app, "check", [*_CONNECTION, *_TABLES])
def check(values: Values, ctx: typer.Context) -> None:
    """Health: database, tables at the expected schema revision, grants, Kafka, topics.

    Exit 0 and ``relay ok: ...`` when the relay could publish; exit 2 and one line
    ``relay down: <cause>: <fix>`` per problem otherwise.
    """
    result = asyncio.run(_check(_config(values)))
    if result.ok:
        typer.echo(scrub(f"relay ok: {', '.join(result.healthy)}"))
        raise typer.Exit(0)
    for problem in result.problems:
        typer.echo(scrub(f"relay down: {problem.line}"))
    raise typer.Exit(2)


async def _check(config: RelayConfig) -> CheckResult:
    store = pg_store_factory(config)("check")
    publisher = KafkaPublisher(config.kafka_settings, compression="none")
    try:
        return await check_relay(config, store, publisher)
    finally:
        await store.aclose()
        await publisher.stop()


@RELAY_SETTINGS.typer_command(
    app,
    "status",
    ["database_url", "outbox_table", "schema", "shard_count"],
    switches={"json": OPERATOR_SWITCHES["json"]},
)
def status(values: Values, ctx: typer.Context) -> None:
    """Pending count, oldest pending age, dead count, the shard owners and the held keys
    (each key behind a dead-lettered event: which event, how many wait). --json prints one
    document, the fields of ledgerbox.admin.RelayStatus. A failure is one line on stderr
    with the fix, exit 2."""
    config = _database_config(values)

    async def read() -> tuple[RelayStats, list[HeldKeyRow]]:
        store = pg_store_factory(config)("status")
        try:
            return await store.stats(config.shard_count), await store.held_keys(_HELD_KEYS_SHOWN)
        finally:
            await store.aclose()

    try:
        stats, keys = asyncio.run(read())
    except LedgerboxError as exc:
        raise _failed("status", config, exc) from None
    if values["json"]:
        typer.echo(json.dumps(_status_json(stats, keys), indent=2, sort_keys=True))
        return
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
    for held in keys:
        typer.echo(
            f"held key {held.key}: dead event {held.dead_id} ({held.dead_event_id}),"
            f" {held.held} held behind it, since {held.since:%Y-%m-%dT%H:%M:%SZ}"
            f" (`ledgerbox relay dead replay|discard {held.dead_id}`)"
        )
    if len(keys) == _HELD_KEYS_SHOWN:
        typer.echo(f"held keys: the first {_HELD_KEYS_SHOWN} shown (`ledgerbox relay dead list`)")
    if stats.refused:
        typer.echo(
            f"refused shards: {_ranges([s for s, _ in stats.refused])}: {stats.refused[0][1]}"
            " (run `ledgerbox relay rebase`)"
        )
    if stats.stray:
        typer.echo(f"stray: {stray_cause(stats.stray, config.shard_count)}")


def _status_json(stats: RelayStats, keys: list[HeldKeyRow]) -> dict[str, Any]:
    """``relay status --json``: the fields and JSON forms of ``ledgerbox.admin.RelayStatus``
    (``to_json()``: datetimes ISO 8601 UTC), built here so the relay's CLI stays without
    SQLAlchemy."""
    return {
        "pending": stats.pending,
        "oldest_pending_age_s": stats.oldest_pending_age_s,
        "dead_lettered": stats.dead_lettered,
        "held": stats.held,
        "owners": [
            {"shard": s, "owner": o, "fence": f, "live": live} for s, o, f, live in stats.owners
        ],
        "refused": [[s, why] for s, why in stats.refused],
        "stray": stats.stray,
        "held_keys": [
            {
                "key": k.key,
                "dead_id": k.dead_id,
                "dead_event_id": k.dead_event_id,
                "dead_count": k.dead_count,
                "held": k.held,
                "since": k.since.astimezone(dt.UTC).isoformat(),
            }
            for k in keys
        ],
    }


def _failed(command: str, config: RelayConfig, exc: LedgerboxError) -> typer.Exit:
    """``ledgerbox relay <command>: <cause>: <fix>`` on stderr (one line, scrubbed); exit 2,
    like every expected failure of an operator command."""
    line = str(exc)
    if isinstance(exc, DatabaseError):
        line = database_remedy(exc, database_label(config.database_url))
    typer.echo(scrub(f"ledgerbox relay {command}: {line}"), err=True)
    return typer.Exit(2)


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
    config = _database_config(values)
    try:
        check_duration(values["margin_s"], "margin_s")  # -5, 1e300: refused, not run
    except ConfigurationError as exc:
        RELAY_SETTINGS.fail(exc, values)

    async def go() -> int:
        store = pg_store_factory(config)("rebase")
        try:
            stats = await store.stats(config.shard_count)
            live = sorted({o for s, o, _, ok in stats.owners if ok and o is not None})
            if live and not values["force"]:
                # Exit 2, like every refusal of an operator command (1 is `check`'s "degraded").
                typer.echo(
                    scrub(
                        f"ledgerbox relay rebase: refused: relays {', '.join(live)} hold "
                        "leases; stop them (or pass --force)"
                    ),
                    err=True,
                )
                return 2
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
        raise _failed("rebase", config, exc) from None
    raise typer.Exit(code)


#: ``relay status`` lists at most this many held keys.
_HELD_KEYS_SHOWN = 20


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5 (4)"``."""
    return f"{shard_ranges(values)} ({len(values)})"


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
