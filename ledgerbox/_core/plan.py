"""Sync and async twins from ONE plan (the house style's rule 5: no duplicated sync/async logic).

A *plan* is a generator that yields each request for I/O it needs (for the twins of
``ledgerbox``: a statement to execute), receives the result of that request, and returns the
answer. The logic (which statements, in which order, how a result is read, which error is
raised) lives in the plan only; :func:`run_plan` drives it with a blocking ``io``,
:func:`arun_plan` with an awaited one, so a sync function and its ``a``-prefixed twin differ
in how they wait and nothing else. The pattern is that of "sans-I/O" protocol libraries
(https://sans-io.readthedocs.io/, "Writing I/O-Free Protocol Implementations").

Example::

    def _plan(key):
        row = (yield select_by(key)).one()
        return row.id

    def get_id(session, key):  return run_plan(_plan(key), session.execute)
    async def aget_id(session, key):  return await arun_plan(_plan(key), session.execute)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import TypeVar

__all__ = ["Plan", "arun_plan", "run_plan"]

Request = TypeVar("Request")
Response = TypeVar("Response")
Answer = TypeVar("Answer")

#: ``Plan[Request, Response, Answer]``: yields requests, is sent their responses, returns.
Plan = Generator[Request, Response, Answer]


def run_plan(plan: Plan[Request, Response, Answer], io: Callable[[Request], Response]) -> Answer:
    """Drive ``plan`` to its end, answering each request with ``io(request)``.

    Returns
    -------
    Answer
        What the plan returns.

    Raises
    ------
    Exception
        Whatever ``io`` or the plan raises, unchanged (the plan is closed first).
    """
    try:
        request = next(plan)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    try:
        while True:
            response = io(request)  # outside the try below: io's own StopIteration escapes
            try:
                request = plan.send(response)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
    finally:
        plan.close()


async def arun_plan(
    plan: Plan[Request, Response, Answer], io: Callable[[Request], Awaitable[Response]]
) -> Answer:
    """:func:`run_plan` with an awaited ``io``: each request is answered by ``await io(request)``.

    Returns and raises as :func:`run_plan`.
    """
    try:
        request = next(plan)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    try:
        while True:
            response = await io(request)
            try:
                request = plan.send(response)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
    finally:
        plan.close()
