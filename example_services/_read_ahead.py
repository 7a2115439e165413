"""What a transaction read ahead for its batch (docs/inbox.md, "Reading ahead for a batch"),
kept in ``session.info`` together with the transaction it belongs to.

A session can outlive a transaction (a caller that retries in the same session after a
rollback): what the rolled-back transaction read or wrote must not steer the next one, so a
value kept for another transaction is not returned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.ext.asyncio import AsyncSession

__all__ = ["cached", "keep"]

T = TypeVar("T")


def cached(session: AsyncSession, key: str, new: Callable[[], T]) -> T:
    """The value kept under ``key`` for the transaction ``session`` is in now, or ``new()``
    when none was kept for it (nothing kept yet, or kept for another transaction)."""
    held = session.info.get(key)
    transaction = session.sync_session.get_transaction()
    if held is not None and transaction is not None and held[0] is transaction:
        value: T = held[1]
        return value
    return new()


def keep(session: AsyncSession, key: str, value: object) -> None:
    """Keep ``value`` under ``key`` for the transaction ``session`` is in (call it after a
    statement: the session's transaction begins with its first one)."""
    session.info[key] = (session.sync_session.get_transaction(), value)
