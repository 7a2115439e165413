"""How the example APIs are served: the ``uvicorn`` command line the demo, the soak and the
``demo_pipeline`` benchmark all use (one place, so what is measured is what the demo runs).

Choices (explained in ``example_services/README.md``, "Request path"):

- ``--loop uvloop --http httptools`` (both in the ``services`` extra): libuv's event loop and
  the C HTTP parser instead of asyncio's selector loop and pure-Python h11. psycopg's async
  connections register and unregister a reader with the loop on every round trip, which is
  where asyncio's selector loop spends most of its time.
- ``--no-access-log``: an access-log line per request costs CPU in ``logging``; the
  ``example_http_requests_total`` metric counts requests by route and status instead.
- ``--log-level warning``: startup chatter off, errors still logged.
- One worker: each API is one process (the benchmark and the demo give every service its
  own process); scale out with more processes behind a balancer, not threads.
"""

from __future__ import annotations

import sys

__all__ = ["api_command"]


def api_command(app: str, port: int, *, python: str | None = None) -> list[str]:
    """``python -m uvicorn --factory APP`` on ``127.0.0.1:port`` with the lean settings.

    Parameters
    ----------
    app : str
        ``module:factory``, e.g. ``example_services.orders.api:create_app``.
    port : int
        TCP port on 127.0.0.1.
    python : str | None
        Interpreter (default: the running one).
    """
    return [
        *(python or sys.executable, "-m", "uvicorn", "--factory", app),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--loop", "uvloop", "--http", "httptools"),
        *("--log-level", "warning", "--no-access-log"),
    ]
