"""Guarded writes for handlers: optimistic versions (G5, C06) and fencing tokens (C10).

These run the caller's SQL in the caller's session and transaction; the consumer turns the
typed errors into a rollback and a rerun of the handler in a fresh transaction. Each sync
function and its async twin run ONE plan (:mod:`ledgerbox._core.plan`): the same statement,
the same reading of its result, the same error.

Pattern (both in one statement, when a row has both columns)::

    UPDATE account SET balance = :b, version = version + 1, fence = :token
     WHERE id = :id AND version = :expected AND fence < :token
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ledgerbox._core.plan import Plan, arun_plan, run_plan
from ledgerbox.inbox._errors import FencedWriteError, VersionConflictError

__all__ = ["afenced_update", "aupdate_versioned", "fenced_update", "update_versioned"]


def _table(target: Any) -> sa.Table:
    table = getattr(target, "__table__", target)
    if not isinstance(table, sa.Table):
        raise TypeError(f"expected a Table or a mapped class, got {type(target).__name__}")
    return table


def _where(table: sa.Table, key: Mapping[str, Any]) -> list[sa.ColumnElement[bool]]:
    if not key:
        raise ValueError("key must name at least one column")
    return [table.c[name] == value for name, value in key.items()]


def _versioned_plan(
    target: Any,
    key: Mapping[str, Any],
    expected_version: int,
    values: Mapping[str, Any],
    version_column: str,
) -> Plan[sa.Update, sa.Result[Any], int]:
    table = _table(target)
    version = table.c[version_column]
    statement = (
        sa.update(table)
        .where(*_where(table, key), version == expected_version)
        .values({**values, version_column: version + 1})
        .returning(version)
    )
    new_version = (yield statement).scalar_one_or_none()
    if new_version is None:
        raise VersionConflictError(table.name, key, expected_version)
    return int(new_version)


def _fenced_plan(
    target: Any,
    key: Mapping[str, Any],
    fencing_token: int,
    values: Mapping[str, Any],
    fence_column: str,
) -> Plan[sa.Update, sa.Result[Any], None]:
    table = _table(target)
    fence = table.c[fence_column]
    statement = (
        sa.update(table)
        .where(*_where(table, key), sa.or_(fence.is_(None), fence < fencing_token))
        .values({**values, fence_column: fencing_token})
    )
    if (yield statement).rowcount != 1:  # type: ignore[attr-defined]
        raise FencedWriteError(table.name, key, fencing_token)


def update_versioned(
    session: Session,
    table: Any,
    key: Mapping[str, Any],
    expected_version: int,
    values: Mapping[str, Any],
    *,
    version_column: str = "version",
) -> int:
    """``UPDATE table SET values, version = version + 1 WHERE key AND version = :expected``.

    Parameters
    ----------
    session : Session
        The handler's session (``ctx.session``); the update is part of its transaction.
    table : sqlalchemy.Table or mapped class
        The table to update.
    key : Mapping[str, Any]
        Column values identifying the row, e.g. ``{"id": 17}``.
    expected_version : int
        The version read before deciding the change.
    values : Mapping[str, Any]
        The new column values (``version`` is set by this function).
    version_column : str
        Name of the integer version column.

    Returns
    -------
    int
        The new version (``expected_version + 1``).

    Raises
    ------
    VersionConflictError
        No row matched: it changed or vanished since it was read (never a silent no-op).
        Inside an :class:`inbox.InboxConsumer` handler this reruns the handler (C06).
    """
    plan = _versioned_plan(table, key, expected_version, values, version_column)
    return run_plan(plan, session.execute)


async def aupdate_versioned(
    session: AsyncSession,
    table: Any,
    key: Mapping[str, Any],
    expected_version: int,
    values: Mapping[str, Any],
    *,
    version_column: str = "version",
) -> int:
    """Async :func:`update_versioned` for an ``AsyncSession`` (same statement, same errors)."""
    plan = _versioned_plan(table, key, expected_version, values, version_column)
    return await arun_plan(plan, session.execute)


def fenced_update(
    session: Session,
    table: Any,
    key: Mapping[str, Any],
    fencing_token: int,
    values: Mapping[str, Any],
    *,
    fence_column: str = "fence",
) -> None:
    """``UPDATE table SET values, fence = :token WHERE key AND fence < :token`` (C10).

    The row remembers the highest fencing token that wrote it; a writer whose lock expired
    and was taken over (a smaller token) is refused even if it wakes up later.

    Parameters
    ----------
    session : Session
        The handler's session.
    table : sqlalchemy.Table or mapped class
        The table; ``fence_column`` is a nullable BIGINT (``NULL``: never fenced).
    key : Mapping[str, Any]
        Column values identifying the row.
    fencing_token : int
        ``ctx.fencing_token``.
    values : Mapping[str, Any]
        The new column values.

    Raises
    ------
    FencedWriteError
        No row matched: a newer token wrote the row (or it does not exist). Retried by the
        consumer with a freshly acquired lock.
    """
    run_plan(_fenced_plan(table, key, fencing_token, values, fence_column), session.execute)


async def afenced_update(
    session: AsyncSession,
    table: Any,
    key: Mapping[str, Any],
    fencing_token: int,
    values: Mapping[str, Any],
    *,
    fence_column: str = "fence",
) -> None:
    """Async :func:`fenced_update` for an ``AsyncSession`` (same statement, same errors)."""
    plan = _fenced_plan(table, key, fencing_token, values, fence_column)
    await arun_plan(plan, session.execute)
