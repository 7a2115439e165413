"""The health of one running consumer: ``ok``, ``degraded`` (Redis away) or ``down`` (a fault
of the environment stops progress), with the cause of ``down``.

A step that meets a fault of the environment (docs/guarantees.md, "Whose fault is it")
reports it here under a key of its own (a partition, ``"startup"``, ``"kafka"``) and keeps
retrying; the key is cleared when the step gets past it. The consumer is ``down`` while any
key is reported. Each change of state is logged once (down: with the cause; up again) and
exported as the gauge ``ledgerbox_inbox_health`` (0 ok, 1 degraded, 2 down: the exit codes
of ``ledgerbox consumer check``); retries are never logged one by one.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Literal

from ledgerbox.inbox._gate import RedisGate
from ledgerbox.inbox._metrics import HEALTH

__all__ = ["HEALTH_CODES", "ConsumerHealth", "Health"]

Health = Literal["ok", "degraded", "down"]

#: The gauge's value and ``ledgerbox consumer check``'s exit code for each state.
HEALTH_CODES: dict[Health, int] = {"ok": 0, "degraded": 1, "down": 2}

_log = logging.getLogger("ledgerbox.inbox")


class ConsumerHealth:
    """Health state of one consumer group in one process.

    Parameters
    ----------
    group : str
        The consumer group (log text and metric label).
    gate : RedisGate
        The consumer's Redis circuit: ``degraded`` while it is open. The gate calls
        :meth:`refresh` on each of its changes.

    Not thread-safe: every call comes from the consumer's event loop.
    """

    def __init__(self, group: str, gate: RedisGate) -> None:
        self.group = group
        self.gate = gate
        self._faults: dict[Hashable, str] = {}
        self._state: Health = "ok"
        self._resolved = True
        self._gauge = HEALTH.labels(group)
        self._gauge.set(0)
        gate.on_change = self.refresh

    @property
    def state(self) -> Health:
        """``down`` while a fault of the environment is reported, else ``degraded`` while
        Redis is away, else ``ok``."""
        if self._faults:
            return "down"
        return "degraded" if self.gate.degraded else "ok"

    @property
    def cause(self) -> str | None:
        """One line naming why the consumer is down (the oldest fault still reported), or
        ``None`` when it is not down."""
        for cause in self._faults.values():
            return cause
        return None

    def fault(self, key: Hashable, cause: str) -> None:
        """Report that the step ``key`` is stopped by a fault of the environment, ``cause``
        being one line (no traceback, no SQL, no secrets)."""
        self._faults[key] = cause
        self.refresh()

    def clear(self, key: Hashable, *, resolved: bool = True) -> None:
        """The step ``key`` got past its fault (``resolved``), or gave its work up without
        getting past it (``resolved=False``: its partition was revoked, the consumer stops);
        no-op if ``key`` reported nothing."""
        if self._faults.pop(key, None) is not None:
            self._resolved = resolved
            self.refresh()

    def refresh(self) -> None:
        """Recompute the state; log and export a change."""
        state = self.state
        previous, self._state = self._state, state
        if state == previous:
            return
        self._gauge.set(HEALTH_CODES[state])
        if state == "down":
            _log.error("consumer group %s down: %s", self.group, self.cause)
        elif previous == "down" and self._resolved:
            _log.warning("consumer group %s up again (%s)", self.group, state)
        elif previous == "down":
            _log.warning(
                "consumer group %s no longer down here: the stopped work was given up "
                "(partition revoked or consumer stopping), not fixed",
                self.group,
            )
