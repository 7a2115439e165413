"""The event loop a daemon runs on: the ``event_loop`` setting of ``ledgerbox relay run`` and
``ledgerbox consumer run`` (docs/configuration.md).

``auto`` (the default) runs uvloop when it is installed (``pip install 'ledgerbox[uvloop]'``;
not on Windows), else asyncio's own loop; ``asyncio`` and ``uvloop`` force one. The daemons
spend much of their CPU in the loop itself - every PostgreSQL and Kafka round trip is a
socket wake-up, a selector call and a task switch - and libuv's loop does that work in C:
measured at 1,000 events/s (``python -m bench e2e_latency``, docs/performance.md) the relay
used ~8% and the consumer ~10% less CPU under uvloop. Nothing else changes: the same
coroutines run, psycopg and aiokafka support both loops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ledgerbox._core.settings import Setting, SettingsError

__all__ = ["EVENT_LOOPS", "EVENT_LOOP_SETTING", "loop_name", "runner"]

#: The values of the ``event_loop`` setting.
EVENT_LOOPS = ("auto", "asyncio", "uvloop")

T = TypeVar("T")


def runner(choice: str) -> Callable[[Coroutine[Any, Any, T]], T]:
    """The function that runs a daemon's main coroutine to completion on the loop ``choice``
    names (``asyncio.run`` or ``uvloop.run``: same signature, same shutdown of async
    generators and executors).

    Checked before the coroutine is created, so a wrong choice creates nothing.

    Raises
    ------
    SettingsError
        (a ``ConfigurationError``) ``choice`` is not one of :data:`EVENT_LOOPS`, or is
        ``"uvloop"`` and uvloop is not installed, cannot be imported or is older than 0.18
        (no ``uvloop.run``). ``"auto"`` never raises for uvloop: it falls back to asyncio.
    """
    if choice not in EVENT_LOOPS:
        raise SettingsError(
            f"event_loop must be one of {', '.join(EVENT_LOOPS)} (got {choice!r})",
            setting="event_loop",
        )
    if choice == "asyncio":
        return asyncio.run
    try:
        import uvloop
    except ImportError as exc:
        if choice == "auto":  # not installed, or a broken wheel: asyncio's loop
            return asyncio.run
        raise SettingsError(
            f"event_loop is uvloop but uvloop cannot be imported ({exc}): pip install"
            " 'ledgerbox[uvloop]' (or use auto or asyncio)",
            setting="event_loop",
        ) from None
    run: Callable[[Coroutine[Any, Any, T]], T] | None = getattr(uvloop, "run", None)
    if run is None:  # uvloop.run came with 0.18; an older one (e.g. another package's pin)
        if choice == "auto":
            return asyncio.run
        raise SettingsError(
            f"event_loop is uvloop but uvloop {getattr(uvloop, '__version__', '?')} is too old"
            " (0.19 or later): pip install 'ledgerbox[uvloop]' (or use auto or asyncio)",
            setting="event_loop",
        )
    return run


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the loop running now (for the start-up log line)."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


#: The ``event_loop`` setting of the daemon commands (``relay run``, ``consumer run``).
EVENT_LOOP_SETTING = Setting(
    "event_loop",
    str,
    default="auto",
    choices=EVENT_LOOPS,
    help="Event loop: auto (uvloop when installed, else asyncio), asyncio or uvloop",
)
