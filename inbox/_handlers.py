"""Handlers as the consumer registers them, and the test-only hooks around them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ledgerbox.inbox._context import HandlerContext
from ledgerbox.inbox._policy import Outcome
from ledgerbox.outbox import EventEnvelope

__all__ = ["ConsumerHooks", "Handler", "Registered"]

Handler = Callable[[HandlerContext[Any], EventEnvelope], Awaitable[None] | None]


@dataclass
class ConsumerHooks:
    """Test-only hooks (fault injection). Production code leaves them unset.

    Attributes
    ----------
    after_begin : Callable[[HandlerContext], Awaitable[None]] | None
        Called with the open transaction before the inbox row is inserted (e.g. a barrier
        between two workers, C05).
    after_commit : Callable[[Record, Outcome], Awaitable[None]] | None
        Called after the database transaction and before Redis and the offset.
    """

    after_begin: Callable[[HandlerContext[Any]], Awaitable[None]] | None = None
    after_commit: Callable[[Any, Outcome], Awaitable[None]] | None = None


@dataclass(frozen=True, slots=True)
class Registered:
    """A registered handler and whether it is a coroutine function (``AsyncSession``) or a
    plain one (sync ``Session``, run in a worker thread)."""

    fn: Handler
    is_async: bool
