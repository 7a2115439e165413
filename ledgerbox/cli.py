"""The ``ledgerbox`` command: the daemons and the operations in one place.

::

    ledgerbox migrate                 create/upgrade the ledgerbox tables (Alembic)
    ledgerbox relay run|check|status  the outbox relay daemon
    ledgerbox consumer run|check|purge  an inbox consumer

Every flag is mirrored by an environment variable (``DATABASE_URL``, ``KAFKA_BOOTSTRAP_SERVERS``,
``REDIS_URL``, ``LEDGERBOX_*``); ``check`` commands report health in their exit code.
"""

from __future__ import annotations

import importlib
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

__all__ = ["app", "main"]

#: Sub-command groups, imported only when used: ``ledgerbox relay run`` does not load the
#: inbox (SQLAlchemy, Redis client), which keeps the relay daemon's memory down.
_LAZY = {
    "relay": ("ledgerbox.relay._cli", "app"),
    "consumer": ("ledgerbox.inbox._cli", "app"),
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
        command = typer.main.get_group(sub)
        command.name = cmd_name
        return command


app = typer.Typer(
    cls=_LazyGroup,
    help="ledgerbox: transactional outbox relay, inbox consumers and their operations.",
    no_args_is_help=True,
)


@app.callback()
def _root() -> None:
    """ledgerbox: transactional outbox relay, inbox consumers and their operations."""


@app.command()
def migrate(
    database_url: Annotated[
        str, typer.Option(envvar="DATABASE_URL", help="SQLAlchemy URL (postgresql+psycopg://...)")
    ],
    schema: Annotated[str | None, typer.Option(envvar="LEDGERBOX_SCHEMA")] = None,
    outbox_table: Annotated[str, typer.Option(envvar="LEDGERBOX_OUTBOX_TABLE")] = "outbox",
    inbox_table: Annotated[str, typer.Option(envvar="LEDGERBOX_INBOX_TABLE")] = "inbox",
    revision: Annotated[str, typer.Option(help="target Alembic revision")] = "head",
) -> None:
    """Create or upgrade the outbox, inbox and relay tables (idempotent)."""
    from sqlalchemy.exc import SQLAlchemyError

    from ledgerbox import migrations
    from ledgerbox._core.errors import LedgerboxError

    names = migrations.Names(schema=schema, outbox_table=outbox_table, inbox_table=inbox_table)
    try:
        migrations.upgrade_database(database_url, names, revision)
    except (LedgerboxError, SQLAlchemyError) as exc:
        typer.echo(f"migrate failed: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"ledgerbox tables at {revision} ({schema or 'search path'})")


def main() -> None:
    """Entry point of the ``ledgerbox`` console script."""
    app()
