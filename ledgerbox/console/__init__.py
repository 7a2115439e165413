"""ledgerbox ``console``: the ops console in the browser (``ledgerbox console``).

One server-rendered page per console (FastAPI + Jinja2, no build step) showing per service
the relay status (pending, oldest pending age, publish rate, shard owners), the keys held
behind a dead event, the dead events and dead-letter records with replay/discard buttons
(confirm dialogs), and the consumer lag. Every action is a call of the operator API
:mod:`ledgerbox.admin`, the same as the CLI's, recorded in the audit table with the actor
``console:<remote address>``. It listens on ``127.0.0.1`` unless told otherwise and then
requires a token. The guide: docs/console.md.

Example
-------
>>> config = ConsoleConfig(services=[ServiceTarget(name="orders",
...                        database_url="postgresql+psycopg://...", groups=["payments"])])
>>> app = create_app(config)     # doctest: +SKIP  (serve with uvicorn)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ledgerbox._core.lazy import lazy_exports

if TYPE_CHECKING:
    from ledgerbox.console._app import create_app
    from ledgerbox.console._config import ConsoleConfig, ServiceTarget, load_services_file
    from ledgerbox.console._source import AdminSource, ConsoleSource

__all__ = [
    "AdminSource",
    "ConsoleConfig",
    "ConsoleSource",
    "ServiceTarget",
    "create_app",
    "load_services_file",
]

if not TYPE_CHECKING:  # type checkers see the imports above, so typos stay errors
    __getattr__, __dir__ = lazy_exports(
        __name__,
        globals(),
        {
            "AdminSource": "ledgerbox.console._source",
            "ConsoleConfig": "ledgerbox.console._config",
            "ConsoleSource": "ledgerbox.console._source",
            "ServiceTarget": "ledgerbox.console._config",
            "create_app": "ledgerbox.console._app",
            "load_services_file": "ledgerbox.console._config",
        },
    )
