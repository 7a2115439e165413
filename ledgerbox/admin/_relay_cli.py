"""``ledgerbox relay dead list|show|replay|discard``: the relay side of the operator API on
the command line (docs/operations.md).

The settings are the relay's (:data:`ledgerbox.relay._cli.RELAY_SETTINGS`: ``--database-url``
/ ``DATABASE_URL``, ``--schema``, ``--outbox-table``) and the shared selection flags (the
filters ``--key``, ``--event-type``, ``--topic``, ``--older-than-s``, ``--error``; the cap
``--limit``, not a filter; ``--actor``; :mod:`ledgerbox._core.operator_settings`).
``--json`` prints one JSON document; ``--dry-run`` changes nothing (an audit row is written,
flagged). The selection flags and ``--actor`` are read from the command line only (never
``LEDGERBOX_RELAY_*``); ``--all-matching`` needs at least one filter, an empty filter value
is refused, and a selection that matches nothing is refused without an audit row. An
expected failure (bad filter, unknown id, database unreachable, operator tables missing)
prints ONE line on stderr, the cause and the fix
(:func:`ledgerbox._core.database_url.database_remedy`), and exits 2.

This module imports only the relay's CLI and the settings: the operator API (SQLAlchemy) is
imported when a ``dead`` command runs, so ``ledgerbox relay run`` stays light.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from ledgerbox._core.errors import LedgerboxError
from ledgerbox._core.operator_settings import OPERATOR_SWITCHES
from ledgerbox._core.settings import Values
from ledgerbox.admin._output import database, fail, log_actions, run
from ledgerbox.admin._output import print_json as _print_json
from ledgerbox.admin._output import short as _short
from ledgerbox.admin._output import table as _table
from ledgerbox.relay._cli import RELAY_SETTINGS
from ledgerbox.relay._cli import app as relay_app

if TYPE_CHECKING:
    from ledgerbox.admin._types import ActionResult, Database, DeadEvent, DeadFilter

__all__ = ["dead_app", "relay_app"]

T = TypeVar("T")

dead_app = typer.Typer(
    help="Dead-lettered outbox events: list, show, replay (in per-key order), discard.",
    pretty_exceptions_show_locals=False,
    no_args_is_help=True,
)
relay_app.add_typer(dead_app, name="dead")

_DB = ["database_url", "outbox_table", "schema"]
_FILTERS = ["key", "event_type", "topic", "older_than_s", "error", "limit"]


def _fail(command: str, exc: BaseException) -> typer.Exit:
    return fail(f"ledgerbox relay dead {command}", exc)


def _run(command: str, make: Callable[[], Coroutine[Any, Any, T]], db: Database) -> T:
    return run(f"ledgerbox relay dead {command}", make, db)


def _database(command: str, values: Values) -> Database:
    return database(
        f"ledgerbox relay dead {command}", values, RELAY_SETTINGS, outbox_table="outbox"
    )


def _filter(command: str, values: Values) -> DeadFilter:
    from ledgerbox.admin._types import DeadFilter

    try:
        return DeadFilter(
            key=values["key"],
            event_type=values["event_type"],
            topic=values["topic"],
            older_than_s=values["older_than_s"],
            error=values["error"],
            limit=values["limit"] if values["limit"] is not None else 100,
        )
    except LedgerboxError as exc:
        raise _fail(command, exc) from None


def _when(event: DeadEvent) -> str:
    return event.created_at.strftime("%Y-%m-%dT%H:%M:%SZ")


@RELAY_SETTINGS.typer_command(
    dead_app,
    "list",
    [*_DB, *_FILTERS],
    switches={"json": OPERATOR_SWITCHES["json"]},
    full_name="relay dead list",
)
def list_command(values: Values, ctx: typer.Context) -> None:
    """List dead-lettered outbox events (id order), with how many events each holds."""
    from ledgerbox import admin

    db, selection = _database("list", values), _filter("list", values)
    found = _run("list", lambda: admin.list_dead_events(db, selection), db)
    if values["json"]:
        _print_json([e.to_json() for e in found])
        return
    if not found:
        typer.echo("no dead-lettered events")
        return
    rows = [["id", "event id", "key", "event type", "topic", "held", "created (UTC)", "error"]]
    for e in found:
        rows.append(
            [
                str(e.id),
                e.event_id,
                e.key,
                e.event_type,
                e.topic,
                str(e.held_behind),
                _when(e),
                _short(e.last_error),
            ]
        )
    _table(rows)


@RELAY_SETTINGS.typer_command(
    dead_app,
    "show",
    _DB,
    switches={"json": OPERATOR_SWITCHES["json"]},
    arguments={"ids": "Outbox row id (from `relay dead list`)"},
    full_name="relay dead show",
)
def show_command(values: Values, ctx: typer.Context) -> None:
    """Show one dead-lettered event with its payload and headers."""
    from ledgerbox import admin

    row_id = _ids("show", values["ids"], exactly_one=True)[0]
    db = _database("show", values)
    event = _run("show", lambda: admin.show_dead_event(db, row_id), db)
    if values["json"]:
        _print_json(event.to_json())
        return
    for name, value in event.to_json().items():
        typer.echo(f"{name.replace('_', ' ')}: {'-' if value is None else value}")


def _ids(command: str, given: list[str], *, exactly_one: bool = False) -> list[int]:
    from ledgerbox.admin._errors import InvalidFilterError

    try:
        ids = [int(v) for v in given]
    except ValueError:
        bad = next(v for v in given if not v.lstrip("-").isdigit())
        raise _fail(
            command, InvalidFilterError(f"{bad!r} is not an outbox row id (an integer)")
        ) from None
    if exactly_one and len(ids) != 1:
        raise _fail(command, InvalidFilterError("give exactly one outbox row id"))
    return ids


def _act(command: str, values: Values) -> None:
    from ledgerbox import admin
    from ledgerbox.admin._errors import InvalidFilterError

    ids = _ids(command, values["ids"])
    db = _database(command, values)
    narrowed = any(values[n] is not None for n in _FILTERS if n != "limit")
    if ids and (narrowed or values["all_matching"]):
        raise _fail(
            command, InvalidFilterError("give ids or --all-matching with filters, not both")
        )
    if not ids and not values["all_matching"]:
        raise _fail(
            command,
            InvalidFilterError(
                "give the outbox row ids to act on, or --all-matching with a filter (--key, "
                "--event-type, --topic, --older-than-s, --error; --limit caps how many) for "
                "every row the filters select"
            ),
        )
    if not ids and not narrowed:
        raise _fail(
            command,
            InvalidFilterError(
                "--all-matching without a filter would select every dead-lettered event: "
                "narrow it with --key, --event-type, --topic, --older-than-s or --error "
                "(every one, deliberately: --older-than-s 0)"
            ),
        )
    selection = None if ids else _filter(command, values)
    log_actions()
    function = admin.replay_dead_events if command == "replay" else admin.discard_dead_events
    result = _run(
        command,
        lambda: function(
            db, ids, filter=selection, actor=values["actor"], dry_run=values["dry_run"]
        ),
        db,
    )
    if values["json"]:
        _print_json(result.to_json())
        return
    typer.echo(_summary(command, result))


def _summary(command: str, result: ActionResult) -> str:
    rows = f"{len(result.ids)} dead-lettered event{'s' if len(result.ids) != 1 else ''}"
    listed = ", ".join(result.ids) or "-"
    if result.dry_run:
        return (
            f"dry run: would {command} {rows}: {listed}; nothing changed"
            f" (audit {result.audit_id}, actor {result.actor})"
        )
    verb = "replayed" if command == "replay" else "discarded"
    tail = (
        "the relay sends them again, in per-key order, with their event ids"
        if command == "replay"
        else "never sent; the events their keys held go on"
    )
    return (
        f"{verb} {rows}: {listed}; {result.changed} rows changed ({tail})"
        f" (audit {result.audit_id}, actor {result.actor})"
    )


_ACT_SWITCHES = {
    "dry_run": OPERATOR_SWITCHES["dry_run"],
    "json": OPERATOR_SWITCHES["json"],
    "all_matching": OPERATOR_SWITCHES["all_matching"],
}


@RELAY_SETTINGS.typer_command(
    dead_app,
    "replay",
    [*_DB, *_FILTERS, "actor"],
    switches=_ACT_SWITCHES,
    arguments={"ids": "Outbox row ids of dead-lettered events"},
    full_name="relay dead replay",
)
def replay_command(values: Values, ctx: typer.Context) -> None:
    """Send dead-lettered events again: each, then the events its key held behind it, in id
    order, with their original event ids (consumers that applied one see a duplicate)."""
    _act("replay", values)


@RELAY_SETTINGS.typer_command(
    dead_app,
    "discard",
    [*_DB, *_FILTERS, "actor"],
    switches=_ACT_SWITCHES,
    arguments={"ids": "Outbox row ids of dead-lettered events"},
    full_name="relay dead discard",
)
def discard_command(values: Values, ctx: typer.Context) -> None:
    """Give up dead-lettered events (never sent); the events their keys held go on."""
    _act("discard", values)
