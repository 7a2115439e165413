"""The wake gate: writers send their ``NOTIFY`` only while a relay waits for one.

PostgreSQL queues a transaction's notifications at commit under one lock of the whole
cluster, held through the commit's WAL flush: every transaction that notifies commits after
the previous one, without group commit (8 concurrent writers: 3,400 instead of 7,600
commits/s on this machine, docs/performance.md). A relay that is busy claims again anyway;
only a relay that waits needs the notification.

The gate is one advisory lock per outbox table (:func:`~ledgerbox._core.identifiers.wake_gate_key`).
The write path's trigger (schema revision 0004) takes it in SHARE mode without waiting, held
to the end of its transaction, and notifies only if that fails. A relay holds it
EXCLUSIVE while it waits for notifications (``GUARDED``):

* A writer that skipped its NOTIFY held the lock in SHARE mode until it committed or
  rolled back, so the relay's ``pg_try_advisory_lock`` succeeds only after every such
  writer ended; the relay then claims once (every lane is woken) and sees their rows. From
  then on, every writer's SHARE attempt fails and it notifies.
* Only one relay can hold the lock. Another relay that finds it held (a SHARE probe fails:
  advisory locks belong to one database) is ``COVERED``: at that moment no writer that
  skipped its NOTIFY was in flight, it claims once, and from then on writers notify while
  the holder holds. A take notifies (payload ``"take"``: every relay's lanes claim once),
  a release too (``"gate"``, in the same statement as the unlock), so a covered relay hears
  that its cover is gone and polls (``OPEN``) before it tries the gate again. Every
  ``CHECK_S`` a guarded relay pings its gate connection and a covered one probes the gate
  again: a holder gone without a release (a crash, a closed connection) costs at most that.
* A relay takes or trusts the gate only while its ``LISTEN`` is active.
* While a relay's rate of events is high (``OPEN_RATE`` events/s) it lets the gate go:
  writers stop notifying and its idle lanes poll every ``OPEN_POLL_S`` (a lane in a stream
  of events claims again at once anyway; the claim pacer spaces the claims). Below
  ``CLOSE_RATE`` it takes the gate again.

A store without the gate (the in-memory store) leaves the gate ``OFF``: lanes wait for
notifications, as before. Against a revision-3 database (the trigger always notifies) the
gate runs as against revision 4: it is harmless there, and an open relay polls besides.

Design rule (../shared/DESIGN.md section 3): NOTIFY stays a hint with a polling fallback;
the gate only decides who waits for it (docs/relay.md, "Wake gate").
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ledgerbox._core.backoff import Backoff
from ledgerbox._core.stop import StopSignal
from ledgerbox.relay import _metrics as m
from ledgerbox.relay._errors import StoreError

__all__ = [
    "CLOSE_RATE",
    "GATE_PAYLOAD",
    "OPEN_POLL_S",
    "OPEN_RATE",
    "TAKE_PAYLOAD",
    "GateState",
    "GateStore",
    "WakeGate",
    "WakeGateDeps",
]

#: Events per second of one relay (its lanes' claim rates summed) from which it releases
#: the gate: writers stop notifying, its lanes poll.
OPEN_RATE = 400.0
#: Events per second below which a relay whose gate is open takes it again.
CLOSE_RATE = 100.0
#: Longest wait of an idle lane while the gate is open, in seconds (its next claim is
#: paced by the claim pacer as in a stream of notifications).
OPEN_POLL_S = 0.005
#: First pause between two attempts to take the gate while writers hold it in SHARE mode,
#: in seconds; it doubles up to ``RETRY_MAX_S`` (a long writer transaction).
RETRY_S = 0.01
RETRY_MAX_S = 0.25
#: How often the gate task looks at the relay's rate and checks the cover (a round trip on
#: the gate connection: a ping while guarded, a try while covered), in seconds.
CHECK_S = 0.05
#: Payload of the notification a relay sends when it releases the gate.
GATE_PAYLOAD = "gate"
#: Payload of the notification a relay sends when it takes the gate.
TAKE_PAYLOAD = "take"

log = logging.getLogger("ledgerbox.relay")


class GateState(enum.Enum):
    """Where a relay stands with the wake gate."""

    OFF = "off"  # the store has no gate: writers always notify
    OPEN = "open"  # not held by this relay and not known held: lanes poll
    GUARDED = "guarded"  # this relay holds it: writers notify
    COVERED = "covered"  # another relay holds it: writers notify


@runtime_checkable
class GateStore(Protocol):
    """The gate's own connection (role ``"gate"``; session advisory lock)."""

    async def gate_try(self) -> tuple[bool, bool]:
        """``(taken, held)``: took the gate EXCLUSIVE without waiting (and then notified the
        channel with payload :data:`TAKE_PAYLOAD`); and whether it is held EXCLUSIVE after
        the attempt (by this session, or by another one of the same database: a SHARE probe
        fails)."""
        ...

    async def gate_release(self) -> None:
        """Release the gate and notify with payload :data:`GATE_PAYLOAD` (one statement)."""
        ...

    async def gate_ping(self) -> None:
        """A round trip: raises :class:`StoreError` if the connection (and its lock) is gone."""
        ...

    async def aclose(self) -> None:
        """Close the connection (which releases the gate)."""
        ...


@dataclass(frozen=True, slots=True)
class WakeGateDeps:
    """What :class:`WakeGate` uses.

    Attributes
    ----------
    store : GateStore | None
        The gate connection; ``None``: no gate (``OFF``).
    rate : Callable[[], float]
        The relay's event rate as its claims see it, in events per second.
    wake_all : Callable[[], None]
        Wakes every lane (it claims once).
    poll_interval_s : float
        The lanes' poll while they wait for notifications.
    backoff : Backoff
    stop : StopSignal
    clock : Callable[[], float]
        Monotonic clock in seconds.
    listening : Callable[[], bool]
        Whether the relay's LISTEN is active: a relay waits for notifications (takes or
        trusts the gate) only then.
    """

    store: GateStore | None
    rate: Callable[[], float]
    wake_all: Callable[[], None]
    poll_interval_s: float
    backoff: Backoff
    stop: StopSignal
    clock: Callable[[], float] = time.monotonic
    listening: Callable[[], bool] = lambda: True


class WakeGate:
    """Holds, releases and watches the wake gate of one relay (module docstring).

    Parameters
    ----------
    deps : WakeGateDeps
    """

    def __init__(self, deps: WakeGateDeps) -> None:
        self._deps = deps
        self._state = GateState.OFF if deps.store is None else GateState.OPEN
        self._holding = False  # this relay's gate connection holds the lock
        self._releases = 0  # release notifications heard (payload "gate")
        self._notice = asyncio.Event()
        self._retry_s = RETRY_S

    @property
    def state(self) -> GateState:
        """The relay's stand with the gate now."""
        return self._state

    def idle_wait_s(self) -> float:
        """How long an idle lane waits for a wake-up before it claims again, in seconds:
        ``poll_interval_s`` while writers notify (the gate is held by someone, or there is
        no gate), :data:`OPEN_POLL_S` while the gate is open."""
        if self._state is GateState.OPEN:
            return min(OPEN_POLL_S, self._deps.poll_interval_s)
        return self._deps.poll_interval_s

    def on_notification(self, payload: str | None) -> None:
        """Called by the listener for every notification, before it wakes the lanes.

        A release (payload :data:`GATE_PAYLOAD`) ends a cover at once, before the lanes woken
        by the same notification go back to waiting; so does ``None`` (LISTEN active again:
        a release may have been missed while it was not). A guarded relay stays guarded:
        the listener wakes its lanes, which claim what was missed."""
        if payload == GATE_PAYLOAD:
            self._releases += 1
        if (payload == GATE_PAYLOAD or payload is None) and self._state is GateState.COVERED:
            self._set(GateState.OPEN)
            self._notice.set()

    def on_listen_lost(self) -> None:
        """Called by the listener when its connection dropped: no notification can reach the
        lanes, so they poll (``OPEN``) at once; a guarded relay then releases the gate (its
        task), and no relay takes it again before LISTEN is back."""
        if self._state in (GateState.GUARDED, GateState.COVERED):
            self._set(GateState.OPEN)
            self._deps.wake_all()
            self._notice.set()

    def _set(self, state: GateState) -> None:
        if state is not self._state:
            log.debug("wake gate %s -> %s", self._state.value, state.value)
            self._state = state
            m.WAKE_GATE.state(state.value)

    async def run(self) -> None:
        """Until stopped (cancelled by the relay); never raises: on a database error (or a
        bug) the gate goes open, the lanes poll, the connection is closed (which releases
        the lock) and the gate is tried again after a backoff
        (``retries_total{stage="gate"}``)."""
        deps = self._deps
        if deps.store is None:
            return
        m.WAKE_GATE.state(self._state.value)
        attempt = 0
        while not deps.stop.is_set():
            try:
                await self._step()
                attempt = 0
            except Exception as exc:
                attempt += 1
                m.RETRIES.labels(stage="gate").inc()
                if isinstance(exc, StoreError):
                    log.debug("wake gate: %s", exc, extra={"attempt": attempt})
                else:
                    log.exception("wake gate: unexpected error (the lanes poll meanwhile)")
                self._open()
                self._holding = False
                with contextlib.suppress(Exception):
                    await deps.store.aclose()
                await deps.stop.sleep(deps.backoff.delay_s(attempt))

    async def aclose(self) -> None:
        """Release the gate if this relay holds it (with the notification that tells the
        covered relays), then close its connection. Never raises on database errors."""
        store = self._deps.store
        if store is None:
            return
        if self._holding:
            try:
                await store.gate_release()
            except Exception as exc:
                log.debug("wake gate release on close: %s", exc)
            self._holding = False
        self._set(GateState.OPEN)
        with contextlib.suppress(Exception):
            await store.aclose()

    def _open(self) -> None:
        if self._state is not GateState.OPEN:
            self._set(GateState.OPEN)
            self._deps.wake_all()

    async def _step(self) -> None:
        deps = self._deps
        store = deps.store
        assert store is not None
        if self._state is GateState.OPEN:
            if self._holding:  # opened by on_listen_lost, or by the rate: let it go
                await store.gate_release()
                self._holding = False
                return
            if deps.rate() >= CLOSE_RATE or not deps.listening():
                self._retry_s = RETRY_S
                await deps.stop.sleep(CHECK_S)
                return
            await self._try(store)
            if self._state is GateState.OPEN:
                # Writers in flight hold it in SHARE mode (a long one keeps it so): back off.
                await deps.stop.sleep(self._retry_s)
                self._retry_s = min(self._retry_s * 2, RETRY_MAX_S)
            else:
                self._retry_s = RETRY_S
            return
        # GUARDED or COVERED: watch the rate; check the cover every CHECK_S (a holder gone
        # without a release, a dropped gate connection: writers stop notifying).
        state = self._state
        self._notice.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._notice.wait(), CHECK_S)
        if self._state is not state:
            return  # on_notification / on_listen_lost opened it
        if deps.rate() >= OPEN_RATE or not deps.listening():
            self._open()  # the lanes poll from now on (the release is the next step's)
        elif state is GateState.GUARDED:
            await store.gate_ping()
        else:
            await self._try(store)

    async def _try(self, store: GateStore) -> None:
        """Try to take the gate (from ``OPEN`` or ``COVERED``) and set the state from the
        answer; wakes the lanes for one claim whenever the state is, or stays, one where
        they wait for notifications."""
        releases, was = self._releases, self._state
        taken, held = await store.gate_try()
        if taken:
            # The statement also notified every relay (payload "take"): a covered relay's
            # lanes claim once after each take, so a probe that finds the cover unchanged
            # needs no claim of its own.
            self._holding = True
            if not self._deps.listening():
                self._open()  # LISTEN dropped meanwhile: released by the next step
                return
            self._set(GateState.GUARDED)
        elif held and self._releases == releases and self._deps.listening():
            # Held by another relay, and no release was heard since before the attempt (a
            # release handled meanwhile would otherwise be lost: a cover that is gone).
            self._set(GateState.COVERED)
            if was is GateState.COVERED:
                return  # the same cover, or a new holder's "take" woke the lanes already
        else:
            self._open()
            return
        # No writer that skipped its NOTIFY is in flight now: claim once to see their rows.
        self._deps.wake_all()
