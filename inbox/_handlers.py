"""Handlers as the consumer registers them, and the test-only hooks around them."""

from __future__ import annotations

import uuid
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
    after_db_commit : Callable[[list[uuid.UUID]], Awaitable[None]] | None
        Called with the ids of the events whose effects a transaction just committed (the
        message's, or a batch's applied ones in offset order; never an empty list), right
        after that commit and before anything else: :attr:`after_commit`, "done" in Redis,
        the offset.
        A hook that never returns leaves the process exactly between the database commit
        and the offset commit (the kill -9 test of G4).
    after_commit : Callable[[Record, Outcome], Awaitable[None]] | None
        Called after the database transaction and before Redis and the offset.
    """

    after_begin: Callable[[HandlerContext[Any]], Awaitable[None]] | None = None
    after_commit: Callable[[Any, Outcome], Awaitable[None]] | None = None
    after_db_commit: Callable[[list[uuid.UUID]], Awaitable[None]] | None = None


@dataclass(frozen=True, slots=True)
class Registered:
    """A registered handler and whether it is a coroutine function (``AsyncSession``) or a
    plain one (sync ``Session``, run in a worker thread)."""

    fn: Handler
    is_async: bool
