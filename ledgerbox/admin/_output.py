"""Plain-text and JSON output of the operator commands, and their one-line failures (no
heavy imports: the operator API is imported when a command runs)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from ledgerbox._core.errors import ConfigurationError, LedgerboxError
from ledgerbox._core.operator_failures import failure_line, quiet_kafka_client
from ledgerbox._core.redaction import scrub
from ledgerbox._core.settings import CommandSettings, Values

if TYPE_CHECKING:
    from ledgerbox._core.kafka import KafkaSettings
    from ledgerbox.admin._types import Database

__all__ = [
    "database",
    "fail",
    "log_actions",
    "print_json",
    "run",
    "setting_problem",
    "short",
    "table",
]

T = TypeVar("T")


def fail(command: str, exc: BaseException | str) -> typer.Exit:
    """Print ``<command>: <exc>`` (passwords scrubbed) as ONE line on stderr; the exit (2) to
    raise. ``command`` is the whole command, e.g. ``"ledgerbox relay dead replay"``."""
    typer.echo(scrub(f"{command}: {exc}"), err=True)
    return typer.Exit(2)


def run(
    command: str,
    make: Callable[[], Coroutine[Any, Any, T]],
    db: Database | None = None,
    kafka: KafkaSettings | None = None,
) -> T:
    """Run the coroutine; an expected failure (a LedgerboxError) is one line and exit 2
    (:func:`ledgerbox._core.operator_failures.failure_line`: a failed call to ``db`` says
    what to do about it, a Kafka client of ``kafka`` that reached no broker is probed once
    more; the Kafka client's own log lines are kept off stderr)."""
    quiet_kafka_client()
    try:
        return asyncio.run(make())
    except LedgerboxError as exc:
        where = db.label if db is not None else None
        raise fail(command, failure_line(exc, database_at=where, kafka=kafka)) from None


def database(
    command: str, values: Values, settings: CommandSettings | None = None, **tables: str
) -> Database:
    """The :class:`~ledgerbox.admin.Database` of ``--database-url`` / ``--schema`` and the
    table names given (``outbox_table=...`` or ``inbox_table=...``: the setting's value, else
    the default passed); no URL or a bad name is one line and exit 2, naming the flag and
    variables of the setting (from ``settings``, the command's)."""
    from ledgerbox.admin._types import Database

    if not values["database_url"]:
        missing = ConfigurationError("no database URL", setting="database_url")
        if settings is None:
            raise fail(command, f"{missing}: set --database-url or DATABASE_URL")
        raise fail(command, setting_problem(missing, settings))
    try:
        return Database(
            url=values["database_url"],
            schema=values["schema"],
            **{name: values[name] or default for name, default in tables.items()},
        )
    except ConfigurationError as exc:
        raise fail(command, setting_problem(exc, settings)) from None
    except LedgerboxError as exc:
        raise fail(command, exc) from None


def setting_problem(exc: ConfigurationError, settings: CommandSettings | None) -> str:
    """``"<exc>; set <flag> or <variables>"`` when ``exc.setting`` is one of ``settings``
    (the command's), else ``exc`` as it is: the one line names how to fix it."""
    name = exc.setting
    if settings is not None and name is not None and name in settings.settings:
        return f"{exc}; set {settings.where(name)}"
    return str(exc)


def print_json(value: Any) -> None:
    """One indented JSON document on stdout."""
    typer.echo(json.dumps(value, indent=2, sort_keys=True))


def table(rows: list[list[str]]) -> None:
    """``rows`` (the first: the header) as left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def short(text: str | None, width: int = 60) -> str:
    """``text`` on one line, cut to ``width`` characters (``-`` for none)."""
    one = " ".join((text or "-").split())
    return one if len(one) <= width else one[: width - 3] + "..."


def log_actions() -> None:
    """Send the operator action lines (logger ``ledgerbox.admin``, INFO) to stderr, once:
    stdout keeps only the command's output (``--json`` stays parseable)."""
    log = logging.getLogger("ledgerbox.admin")
    if not any(getattr(h, "ledgerbox_cli", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        handler.ledgerbox_cli = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
