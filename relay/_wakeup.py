"""The relay's wake-up: ``LISTEN`` on the outbox channel, a hint that rows were committed.

The write path's trigger sends at most one ``NOTIFY`` per transaction, at commit. The
listener wakes every lane; lanes also poll every ``poll_interval_s``, so a lost notification
(or a dropped ``LISTEN`` connection, reconnected with backoff) only delays a batch
(docs/relay.md, "Wake-up").

After a wake-up the listener stops reading until a lane waits for the next one (or
:data:`READ_PAUSE_MAX_S` passed): a lane that is claiming or publishing reads what committed
meanwhile with its next claim anyway, and the notifications that arrive meanwhile wait in the
socket and are then read together, in one read. At 1,000 commits/s that is one read per
batch instead of one per commit (each costs a system call and a wake-up of the event loop:
docs/performance.md). The pause is bounded so that the server's notification queue never
backs up behind a relay that is never idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ledgerbox._core.backoff import Backoff
from ledgerbox._core.stop import StopSignal
from ledgerbox.relay import _metrics as m
from ledgerbox.relay._errors import StoreError
from ledgerbox.relay._store import RelayStore

__all__ = ["READ_PAUSE_MAX_S", "WakeUp", "WakeUpDeps"]

#: Longest pause of the listener between a wake-up and its next read, in seconds.
READ_PAUSE_MAX_S = 0.1

log = logging.getLogger("ledgerbox.relay")


@dataclass(frozen=True, slots=True)
class WakeUpDeps:
    """What :class:`WakeUp` uses.

    Attributes
    ----------
    store : RelayStore
        The LISTEN connection (role ``"listen"``).
    wake_all : Callable[[], None]
        Wakes every lane.
    backoff : Backoff
        Pause before listening again after the connection dropped.
    stop : StopSignal
    idle : asyncio.Event | None
        Set by a lane that starts waiting for a wake-up (``LaneDeps.on_idle``); the listener
        clears it after each wake-up and reads again once it is set (module docstring).
        ``None``: read every notification at once.
    clock : Callable[[], float]
        Monotonic clock in seconds (how long LISTEN was lost, in the line when it is back).
    on_notification : Callable[[str | None], None]
        Called with each notification's payload before the lanes are woken
        (:meth:`~ledgerbox.relay._gate.WakeGate.on_notification`); ``None`` when LISTEN
        became active.
    on_lost : Callable[[], None]
        Called when the LISTEN connection dropped
        (:meth:`~ledgerbox.relay._gate.WakeGate.on_listen_lost`).
    """

    store: RelayStore
    wake_all: Callable[[], None]
    backoff: Backoff
    stop: StopSignal
    idle: asyncio.Event | None = None
    clock: Callable[[], float] = time.monotonic
    on_notification: Callable[[str | None], None] = lambda payload: None
    on_lost: Callable[[], None] = lambda: None


class WakeUp:
    """Wakes every lane once LISTEN is active and on every notification.

    Parameters
    ----------
    deps : WakeUpDeps
    """

    def __init__(self, deps: WakeUpDeps) -> None:
        self._deps = deps
        self.listening = False  # LISTEN is active on the connection

    async def _until_wanted(self) -> None:
        # Every lane was just woken: none waits for a notification until one goes idle.
        idle = self._deps.idle
        if idle is None:
            return
        idle.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(idle.wait(), READ_PAUSE_MAX_S)

    async def run(self) -> None:
        """Until stopped (cancelled by the relay); never raises on database errors (counted
        as ``retries_total{stage="listen"}``). An outage is two WARNING lines, whatever its
        length: ``LISTEN connection lost: <cause>`` at the first failure and ``LISTEN
        connection back after <s> s`` once LISTEN is active again; the retries in between log
        at DEBUG (docs/relay.md, "Health": an hour of outage is two lines, not 3,600)."""
        deps = self._deps
        attempt = 0
        lost_at: float | None = None
        while not deps.stop.is_set():
            try:
                # The first item comes once LISTEN is active: a commit before it notified
                # no one, so every lane claims then (and on every notification after).
                async for payload in deps.store.notifications():
                    if lost_at is not None:
                        log.warning("LISTEN connection back after %.1f s", deps.clock() - lost_at)
                        lost_at = None
                    attempt = 0
                    self.listening = True
                    deps.on_notification(payload)
                    deps.wake_all()
                    await self._until_wanted()
            except StoreError as exc:
                self.listening = False
                deps.on_lost()
                attempt += 1
                m.RETRIES.labels(stage="listen").inc()
                if lost_at is None:
                    lost_at = deps.clock()
                    log.warning(
                        "LISTEN connection lost: %s (the lanes poll until it is back; retries "
                        "logged at DEBUG)",
                        exc,
                        extra={"attempt": attempt},
                    )
                else:
                    log.debug(
                        "LISTEN connection still lost (attempt %d): %s",
                        attempt,
                        exc,
                        extra={"attempt": attempt},
                    )
                await deps.store.aclose()
                await deps.stop.sleep(deps.backoff.delay_s(attempt))
