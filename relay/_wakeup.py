"""The relay's wake-up: ``LISTEN`` on the outbox channel, a hint that rows were committed.

The write path's trigger sends at most one ``NOTIFY`` per transaction, at commit. The
listener wakes every lane; lanes also poll every ``poll_interval_s``, so a lost notification
(or a dropped ``LISTEN`` connection, reconnected with backoff) only delays a batch
(docs/relay.md, "Wake-up").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ledgerbox._core.backoff import Backoff
from ledgerbox.relay import _metrics as m
from ledgerbox.relay._errors import StoreError
from ledgerbox.relay._stop import StopSignal
from ledgerbox.relay._store import RelayStore

__all__ = ["WakeUp", "WakeUpDeps"]

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
    """

    store: RelayStore
    wake_all: Callable[[], None]
    backoff: Backoff
    stop: StopSignal


class WakeUp:
    """Wakes every lane once LISTEN is active and on every notification.

    Parameters
    ----------
    deps : WakeUpDeps
    """

    def __init__(self, deps: WakeUpDeps) -> None:
        self._deps = deps

    async def run(self) -> None:
        """Until stopped (cancelled by the relay); never raises on database errors (logged,
        counted as ``retries_total{stage="listen"}``)."""
        deps = self._deps
        attempt = 0
        while not deps.stop.is_set():
            try:
                # The first item comes once LISTEN is active: a commit before it notified
                # no one, so every lane claims then (and on every notification after).
                async for _ in deps.store.notifications():
                    attempt = 0
                    deps.wake_all()
            except StoreError as exc:
                attempt += 1
                m.RETRIES.labels(stage="listen").inc()
                log.warning("LISTEN connection lost: %s", exc, extra={"attempt": attempt})
                await deps.store.aclose()
                await deps.stop.sleep(deps.backoff.delay_s(attempt))
