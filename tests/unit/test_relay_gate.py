"""The wake gate's state machine (relay._gate) over a scripted gate store: when a relay holds,
trusts, releases or gives up the gate, and what its lanes wait. The lock protocol itself runs
on a real server in tests/integration/test_relay_store_contract.py and test_relay_wake_gate.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from ledgerbox._core.backoff import Backoff
from ledgerbox._core.faults import Fault
from ledgerbox._core.identifiers import wake_gate_key
from ledgerbox._core.stop import StopSignal
from ledgerbox.outbox import OutboxTable
from ledgerbox.relay._errors import StoreError
from ledgerbox.relay._gate import (
    CLOSE_RATE,
    GATE_PAYLOAD,
    OPEN_POLL_S,
    OPEN_RATE,
    GateState,
    GateStore,
    WakeGate,
    WakeGateDeps,
)


class ScriptedGate:
    """Answers ``gate_try`` from ``answers`` (the last one repeats); records the calls."""

    def __init__(self, *answers: tuple[bool, bool]) -> None:
        self.answers = list(answers)
        self.calls: list[str] = []
        self.fail_next = False

    async def gate_try(self) -> tuple[bool, bool]:
        self.calls.append("try")
        if self.fail_next:
            self.fail_next = False
            raise StoreError("gate: connection lost", fault=Fault.TRANSIENT)
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    async def gate_release(self) -> None:
        self.calls.append("release")

    async def gate_ping(self) -> None:
        self.calls.append("ping")

    async def aclose(self) -> None:
        self.calls.append("close")


class Relay:
    """What the gate sees of a relay: its rate (set by the test) and its wake-ups."""

    def __init__(self, store: GateStore | None, poll_interval_s: float = 30.0) -> None:
        self.rate = 0.0
        self.wakes = 0
        self.stop = StopSignal()
        self.gate = WakeGate(
            WakeGateDeps(
                store=store,
                rate=lambda: self.rate,
                wake_all=self._wake,
                poll_interval_s=poll_interval_s,
                backoff=Backoff(base_s=0.001, max_s=0.001),
                stop=self.stop,
            )
        )
        self.task: asyncio.Task[None] | None = None

    def _wake(self) -> None:
        self.wakes += 1

    def start(self) -> None:
        self.task = asyncio.create_task(self.gate.run())

    async def until(self, check: Callable[[], bool]) -> None:
        for _ in range(2000):
            if check():
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"not reached; gate {self.gate.state}")

    async def aclose(self) -> None:
        self.stop.set()
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def _started(store: ScriptedGate, state: GateState, poll_interval_s: float = 30.0) -> Relay:
    relay = Relay(store, poll_interval_s)
    relay.start()
    await relay.until(lambda: relay.gate.state is state)
    return relay


def _state(relay: Relay) -> GateState:
    return relay.gate.state


async def test_without_a_gate_store_lanes_wait_for_notifications() -> None:
    relay = Relay(None, poll_interval_s=1.0)
    assert relay.gate.state is GateState.OFF
    assert relay.gate.idle_wait_s() == 1.0
    await relay.gate.run()  # returns at once


async def test_a_quiet_relay_takes_the_gate_and_claims_once() -> None:
    store = ScriptedGate((False, False), (False, False), (True, True))
    relay = Relay(store)
    assert relay.gate.idle_wait_s() == OPEN_POLL_S, "open until it holds the gate"
    relay.start()
    await relay.until(lambda: relay.gate.state is GateState.GUARDED)
    assert store.calls[:3] == ["try", "try", "try"], "retried while writers held SHARE"
    assert relay.wakes == 1, "one claim once every writer that skipped its NOTIFY ended"
    assert relay.gate.idle_wait_s() == 30.0
    await relay.aclose()


async def test_a_busy_relay_releases_the_gate_and_its_lanes_poll() -> None:
    store = ScriptedGate((True, True))
    relay = await _started(store, GateState.GUARDED)
    relay.rate = OPEN_RATE
    await relay.until(lambda: relay.gate.state is GateState.OPEN)
    assert "release" in store.calls
    assert relay.wakes == 2, "woken to poll (lanes in a long wait)"
    assert relay.gate.idle_wait_s() == OPEN_POLL_S
    # Still busy just under OPEN_RATE: no attempt to take the gate above CLOSE_RATE.
    relay.rate = (OPEN_RATE + CLOSE_RATE) / 2
    tries = store.calls.count("try")
    await asyncio.sleep(0.2)
    assert store.calls.count("try") == tries
    relay.rate = 0.0
    await relay.until(lambda: relay.gate.state is GateState.GUARDED)
    await relay.aclose()


async def test_a_covered_relay_polls_at_once_on_the_holders_release() -> None:
    store = ScriptedGate((False, True))
    relay = await _started(store, GateState.COVERED)
    assert relay.gate.idle_wait_s() == 30.0
    relay.gate.on_notification("")  # a writer's notification changes nothing
    assert relay.gate.state is GateState.COVERED
    store.answers = [(False, False)]  # writers in flight after the release
    relay.gate.on_notification(GATE_PAYLOAD)
    assert _state(relay) is GateState.OPEN, "synchronously, before the lanes wait again"
    assert relay.gate.idle_wait_s() == OPEN_POLL_S
    await relay.aclose()


async def test_a_covered_relay_finds_out_within_a_check_when_the_holder_died() -> None:
    store = ScriptedGate((False, True), (False, True), (False, False))
    relay = await _started(store, GateState.COVERED)  # polling every 30 s
    # The holder died without a release: a check (every CHECK_S) finds no holder.
    await relay.until(lambda: relay.gate.state is GateState.OPEN)
    await relay.aclose()


async def test_a_release_heard_during_the_attempt_is_not_lost() -> None:
    """OPEN -> try -> "held by another" while that other relay's release notification is
    handled: becoming covered then would trust a cover that is gone."""
    relay_box: list[Relay] = []

    class ReleasedDuringTry(ScriptedGate):
        states: list[GateState] = []

        async def gate_try(self) -> tuple[bool, bool]:
            self.states.append(relay_box[0].gate.state)
            answer = await super().gate_try()
            if len(self.calls) == 1:
                relay_box[0].gate.on_notification(GATE_PAYLOAD)
            return answer

    store = ReleasedDuringTry((False, True), (True, True))
    relay = Relay(store)
    relay_box.append(relay)
    relay.start()
    await relay.until(lambda: relay.gate.state is GateState.GUARDED)
    assert store.states[:2] == [GateState.OPEN, GateState.OPEN], "not covered by a gone cover"
    await relay.aclose()


async def test_losing_listen_opens_the_gate_and_a_guarded_relay_releases_it() -> None:
    store = ScriptedGate((True, True))
    relay = await _started(store, GateState.GUARDED)
    listening = False
    relay.gate._deps = dataclasses.replace(relay.gate._deps, listening=lambda: listening)
    relay.gate.on_listen_lost()
    assert _state(relay) is GateState.OPEN, "at once: the lanes poll"
    await relay.until(lambda: "release" in store.calls)
    tries = store.calls.count("try")
    await asyncio.sleep(0.2)
    assert store.calls.count("try") == tries, "not taken again before LISTEN is back"
    listening = True
    await relay.until(lambda: relay.gate.state is GateState.GUARDED)
    await relay.aclose()


async def test_listen_back_ends_a_cover_a_missed_release_may_have_ended() -> None:
    store = ScriptedGate((False, True))
    relay = await _started(store, GateState.COVERED)
    relay.gate.on_notification(None)
    assert _state(relay) is GateState.OPEN
    await relay.aclose()


async def test_a_gate_connection_error_opens_the_gate_and_reconnects() -> None:
    store = ScriptedGate((True, True))
    store.fail_next = True
    relay = Relay(store)
    relay.start()
    await relay.until(lambda: "close" in store.calls)
    await relay.until(lambda: relay.gate.state is GateState.GUARDED)
    await relay.aclose()


async def test_closing_a_guarded_relay_releases_the_gate_with_its_notification() -> None:
    store = ScriptedGate((True, True))
    relay = await _started(store, GateState.GUARDED)
    await relay.aclose()
    await relay.gate.aclose()
    assert store.calls[-2:] == ["release", "close"]
    assert relay.gate.state is GateState.OPEN


def test_the_wake_gate_key_is_pinned() -> None:
    """The trigger of revision 0004 holds the key as literals: a changed key would leave
    writers and relays on different locks (writers never notify: every event waits for the
    poll)."""
    assert wake_gate_key("outbox_default_ledgerbox") == (
        0x6C656467,
        int.from_bytes(bytes.fromhex("d661fa94"), "big", signed=True),
    )
    table = OutboxTable("outbox")
    assert "pg_try_advisory_xact_lock_shared(1818584167, -698221932)" in table.notify_ddl()[0]


async def test_a_covered_relay_probes_without_waking_its_lanes_each_time() -> None:
    """Each probe costs one round trip; the lanes claim when the cover starts and on every
    take (its notification), not 20 times a second."""
    store = ScriptedGate((False, True))
    relay = await _started(store, GateState.COVERED)
    await relay.until(lambda: store.calls.count("try") >= 4)
    assert relay.wakes == 1
    await relay.aclose()


async def test_listen_lost_while_taking_the_gate_releases_it_instead_of_guarding() -> None:
    relay_box: list[Relay] = []
    listening = True

    class ListenLostDuringTry(ScriptedGate):
        async def gate_try(self) -> tuple[bool, bool]:
            nonlocal listening
            answer = await super().gate_try()
            if len(self.calls) == 1:
                listening = False
                relay_box[0].gate.on_listen_lost()
            return answer

    store = ListenLostDuringTry((True, True))
    relay = Relay(store)
    relay_box.append(relay)
    relay.gate._deps = dataclasses.replace(relay.gate._deps, listening=lambda: listening)
    relay.start()
    await relay.until(lambda: bool(store.calls))
    await asyncio.sleep(0.01)
    assert _state(relay) is GateState.OPEN, "never guarded without LISTEN"
    await relay.until(lambda: "release" in store.calls)
    await relay.aclose()
