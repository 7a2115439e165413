"""The ``ledgerbox`` command: the daemons and the operations in one place.

::

    ledgerbox migrate                 create/upgrade the ledgerbox tables (Alembic)
    ledgerbox relay run|check|status  the outbox relay daemon (see ``python -m relay --help``)
    ledgerbox consumer run|check|purge  an inbox consumer (see ``python -m inbox --help``)

Every flag is mirrored by an environment variable (``DATABASE_URL``, ``KAFKA_BOOTSTRAP_SERVERS``,
``REDIS_URL``, ``LEDGERBOX_*``); ``check`` commands report health in their exit code.
"""

from __future__ import annotations

from typing import Annotated

import typer

from inbox._cli import app as consumer_app
from relay._cli import app as relay_app

__all__ = ["app", "main"]

app = typer.Typer(
    help="ledgerbox: transactional outbox relay, inbox consumers and their operations.",
    no_args_is_help=True,
)
app.add_typer(relay_app, name="relay")
app.add_typer(consumer_app, name="consumer")


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

    import migrations
    from outbox import LedgerboxError

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
