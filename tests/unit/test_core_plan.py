"""ledgerbox._core.plan: one generator, driven blocking or awaited, gives the same answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any

import pytest

from ledgerbox._core.plan import Plan, arun_plan, run_plan


class Refused(Exception):
    pass


def plan_doubling(start: int, closed: list[bool]) -> Plan[int, int, list[int]]:
    # Asks io for f(start), then f(f(start)) unless the first answer is odd; refuses 13.
    seen: list[int] = []
    try:
        first = yield start
        seen.append(first)
        if first == 13:
            raise Refused(first)
        if first % 2 == 0:
            seen.append((yield first))
        return seen
    finally:
        closed.append(True)


def double(n: int) -> int:
    return n * 2


async def adouble(n: int) -> int:
    return n * 2


def _both(make: Callable[[list[bool]], Plan[Any, Any, Any]], io: Any, aio: Any) -> Any:
    sync_closed: list[bool] = []
    async_closed: list[bool] = []
    outcomes: list[tuple[str, Any]] = []

    def blocking() -> Any:
        return run_plan(make(sync_closed), io)

    def awaited() -> Any:
        return asyncio.run(arun_plan(make(async_closed), aio))

    for run in (blocking, awaited):
        try:
            outcomes.append(("ok", run()))
        except Exception as exc:
            outcomes.append(("error", repr(exc)))
    assert outcomes[0] == outcomes[1]
    assert sync_closed == async_closed == [True]  # the plan always ends (returned or closed)
    return outcomes[0]


def test_requests_get_their_responses_in_order() -> None:
    assert _both(lambda c: plan_doubling(3, c), double, adouble) == ("ok", [6, 12])
    assert _both(lambda c: plan_doubling(1, c), lambda n: n + 2, _plus_two) == ("ok", [3])


async def _plus_two(n: int) -> int:
    return n + 2


async def _thirteen(n: int) -> int:
    return 13


def test_an_error_of_the_plan_propagates_unchanged() -> None:
    assert _both(lambda c: plan_doubling(3, c), lambda n: 13, _thirteen) == (
        "error",
        "Refused(13)",
    )


def test_an_error_of_io_propagates_and_closes_the_plan() -> None:
    def broken(n: int) -> int:
        raise ConnectionError("gone")

    async def abroken(n: int) -> int:
        raise ConnectionError("gone")

    assert _both(lambda c: plan_doubling(3, c), broken, abroken) == (
        "error",
        "ConnectionError('gone')",
    )


def test_a_plan_without_io_returns_at_once() -> None:
    def nothing(closed: list[bool]) -> Generator[int, int, str]:
        closed.append(True)
        return "done"
        yield 0  # a generator that never yields

    assert _both(nothing, double, adouble) == ("ok", "done")


def test_stop_iteration_from_io_is_not_taken_for_the_plan_ending() -> None:
    def stops(n: int) -> int:
        raise StopIteration

    with pytest.raises(StopIteration):
        run_plan(plan_doubling(3, []), stops)
