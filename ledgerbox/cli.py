"""The ``ledgerbox`` command: the daemons and the operations in one place.

::

    ledgerbox migrate                 create/upgrade the ledgerbox tables (Alembic)
    ledgerbox relay run|check|status|rebase   the outbox relay daemon
    ledgerbox relay dead list|show|replay|discard   dead-lettered outbox events
    ledgerbox consumer run|check|purge|lag    an inbox consumer, its lag
    ledgerbox consumer dlq list|show|replay|discard  dead-letter records
    ledgerbox console                 the ops console in the browser (docs/console.md)

One naming scheme for every command (docs/configuration.md): setting ``field_name`` of
``ledgerbox <command>`` has the flag ``--field-name`` and the environment variable
``LEDGERBOX_<COMMAND>_FIELD_NAME`` (connection URLs also ``DATABASE_URL``,
``KAFKA_BOOTSTRAP_SERVERS``, ``REDIS_URL``); ``check`` commands report health in their exit
code. The operator commands' selection flags and ``--actor`` are read from the command line
only (:attr:`ledgerbox._core.settings.Setting.command_line`).
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperGroup

from ledgerbox._core.migrate_settings import MIGRATE_SETTINGS, NAME_SETTINGS
from ledgerbox._core.settings import Values

__all__ = ["app", "main"]

#: Sub-command groups, imported only when used: ``ledgerbox relay run`` does not load the
#: inbox (SQLAlchemy, Redis client), which keeps the relay daemon's memory down. The operator
#: commands (``relay dead``, ``consumer dlq``, ``consumer lag``: :mod:`ledgerbox.admin`) are
#: added to the daemons' groups by the admin package's CLI modules.
_LAZY = {
    "relay": ("ledgerbox.admin._relay_cli", "relay_app"),
    "consumer": ("ledgerbox.admin._consumer_cli", "consumer_app"),
    "console": ("ledgerbox.console._cli", "app"),
}


class _LazyGroup(TyperGroup):
    """Click's documented lazy-loading pattern for the sub-command groups in ``_LAZY``."""

    # ``Any``: Typer vendors its own click types.
    def list_commands(self, ctx: Any) -> list[str]:
        return sorted({*super().list_commands(ctx), *_LAZY})

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in _LAZY:
            return super().get_command(ctx, cmd_name)
        module, attr = _LAZY[cmd_name]
        sub: Any = getattr(importlib.import_module(module), attr)
        # A group (relay, consumer) or, for a Typer app of one command (console), that command.
        command = typer.main.get_command(sub)
        command.name = cmd_name
        return command


app = typer.Typer(
    cls=_LazyGroup,
    pretty_exceptions_show_locals=False,  # a traceback must not print local values (secrets)
    help="ledgerbox: transactional outbox relay, inbox consumers and their operations.",
    no_args_is_help=True,
)


@app.callback()
def _root() -> None:
    """ledgerbox: transactional outbox relay, inbox consumers and their operations."""


@MIGRATE_SETTINGS.typer_command(app, "migrate", list(MIGRATE_SETTINGS.settings))
def migrate(values: Values, ctx: typer.Context) -> None:
    """Create or upgrade the outbox, inbox and relay tables (idempotent)."""
    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from ledgerbox import migrations
    from ledgerbox._core.database_url import (
        check_database_url,
        database_label,
        database_remedy,
    )
    from ledgerbox._core.errors import ConfigurationError, DatabaseError, LedgerboxError
    from ledgerbox._core.identifiers import (
        inbox_table_name,
        outbox_notify_channel,
        outbox_table_name,
        sql_identifier,
    )
    from ledgerbox._core.redaction import scrub

    url = values["database_url"]
    try:  # the daemons' check: a URL that can never connect (mysql://, port 70000) is refused
        check_database_url(url, reader="sqlalchemy")
        migrations._check_revision(values["revision"])  # before any connection
    except ConfigurationError as exc:
        MIGRATE_SETTINGS.fail(exc, values)
    checks = {"outbox_table": outbox_table_name, "inbox_table": inbox_table_name}
    for name in NAME_SETTINGS:
        if values[name] is not None:
            try:
                checks.get(name, sql_identifier)(values[name], name.replace("_", " "))
            except ConfigurationError as exc:
                MIGRATE_SETTINGS.fail(ConfigurationError(str(exc), setting=name), values)
    names = migrations.Names(**{name: values[name] for name in NAME_SETTINGS})
    try:  # the pair's NOTIFY channel: else "migrate failed: ConfigurationError: ..."
        outbox_notify_channel(names.outbox_table, names.schema)
    except ConfigurationError as exc:
        MIGRATE_SETTINGS.fail(ConfigurationError(str(exc), setting="outbox_table"), values)
    try:
        before = migrations._current_revision(url, names)
        migrations.upgrade_database(url, names, values["revision"])
        after = migrations._current_revision(url, names)
    except CommandError as exc:  # Alembic: a relative target that does not resolve, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        line = (
            f"{first}: give --revision head or one of {', '.join(migrations._revisions())} "
            "(`ledgerbox migrate` only upgrades)"
        )
        typer.echo(scrub(f"migrate failed: {line}"), err=True)
        raise typer.Exit(2) from None
    except (LedgerboxError, SQLAlchemyError) as exc:
        # A database that is down, a refused login (the user and the database named), a
        # missing privilege: one line with the fix (database_remedy), as the operator
        # commands say it; else the error as it is.
        error = exc
        if not isinstance(exc, LedgerboxError):
            error = DatabaseError.translate(exc, "the upgrade") or exc
            error.__cause__ = exc  # libpq's account of the login is read through it
        if isinstance(error, DatabaseError):
            line = database_remedy(error, database_label(url))
        else:
            line = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        typer.echo(scrub(f"migrate failed: {line}"), err=True)
        raise typer.Exit(2) from None
    # The revision the database is at now, not the one asked for: `--revision 0001` on a
    # database at 0003 changes nothing (Alembic's upgrade never goes back), and says so.
    where = f"ledgerbox tables at {after or 'base'} ({names.schema or 'search path'})"
    asked = values["revision"]
    rank = {"base": -1} | {r: i for i, r in enumerate(migrations._revisions())}
    if before == after and after in rank and asked in rank and rank[asked] < rank[after]:
        where += (
            f", past the requested {asked}: nothing done (`ledgerbox migrate` only upgrades; "
            "to go back, stop the relays and run alembic.command.downgrade("
            f"ledgerbox.migrations.alembic_config(url, names), {asked!r}): docs/migrations.md)"
        )
    typer.echo(where)


def main() -> None:
    """Entry point of the ``ledgerbox`` console script."""
    app()
