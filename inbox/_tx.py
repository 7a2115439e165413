"""One transaction of a handler, behind a thin adapter so the consumer has ONE code path.

:class:`AsyncTx` wraps an ``AsyncSession`` (async handlers); :class:`SyncTx` wraps a sync
``Session`` and runs each call in a worker thread (``asyncio.to_thread``) so sync handlers
never block the event loop. The consumer's step sequence (insert inbox row, run handler,
commit) is written once against :class:`Tx`.

This is the inbox's database seam: a driver error (psycopg, SQLAlchemy) raised by a
statement, the handler or the commit leaves it as :class:`ledgerbox.DatabaseError` with the
fault of the one table (:mod:`ledgerbox._core.faults`), the driver's error as its cause.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from ledgerbox._core.errors import DatabaseError
from ledgerbox._core.faults import Fault, sqlstate_fault

__all__ = ["AsyncTx", "Rows", "SyncTx", "Tx", "discard_on_environment_faults", "translate_errors"]


@dataclass(frozen=True, slots=True)
class Rows:
    """The fetched result of one statement (fetched where it ran, so no cursor escapes)."""

    rows: Sequence[sa.Row[Any]]
    rowcount: int


class Tx(Protocol):
    """A session with an open (auto-begun) transaction, driven from async code."""

    @property
    def session(self) -> Session | AsyncSession:
        """The session handed to the handler."""
        ...

    async def execute(
        self, statement: sa.Executable, params: Mapping[str, Any] | None = None
    ) -> Rows:
        """Run one statement (with bound ``params``) inside the transaction."""
        ...

    async def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run the handler (awaited if async, in a worker thread if sync)."""
        ...

    async def commit(self) -> None:
        """Commit the transaction."""
        ...

    async def aclose(self) -> None:
        """Roll back whatever is not committed and release the connection."""
        ...


@contextlib.contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """``with translate_errors("commit"): ...`` re-raises a driver error as
    :class:`ledgerbox.DatabaseError` (any other exception passes unchanged)."""
    try:
        yield
    except DatabaseError:
        raise
    except Exception as exc:
        error = DatabaseError.translate(exc, what)
        if error is None:
            raise
        raise error from exc


def discard_on_environment_faults(engine: Engine) -> None:
    """Make ``engine`` throw away (invalidate) a connection whose statement failed with a
    server error of the environment (``ledgerbox._core.faults``: read-only transaction,
    privilege, schema, feature not supported...), instead of returning it to the pool.

    Why: some of these faults live in the session, not in the database. A connection opened
    while ``default_transaction_read_only`` was on (or on a replica) stays read-only after
    the fix, and a prepared statement may outlive the table it was planned on. Discarding
    the connection lets the next attempt open a fresh one, so the consumer resumes by itself
    once the environment is fixed (C15). Only the failing connection goes (not the whole
    pool); the others are discarded in turn if they fail too. Errors without a SQLSTATE
    (a lost connection) are already treated as disconnects by SQLAlchemy.
    """

    def on_error(context: sa.engine.ExceptionContext) -> None:
        state = getattr(context.original_exception, "sqlstate", None)
        if isinstance(state, str) and state and sqlstate_fault(state) is Fault.ENVIRONMENT:
            context.is_disconnect = True
            context.invalidate_pool_on_disconnect = False

    sa.event.listen(engine, "handle_error", on_error)


def _fetch(result: sa.Result[Any]) -> Rows:
    rows = result.all() if getattr(result, "returns_rows", True) else []
    return Rows(rows, getattr(result, "rowcount", -1))


class AsyncTx:
    """:class:`Tx` over an ``AsyncSession`` bound to ``engine``."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._session = AsyncSession(engine, expire_on_commit=False)

    @property
    def session(self) -> AsyncSession:
        return self._session

    async def execute(
        self, statement: sa.Executable, params: Mapping[str, Any] | None = None
    ) -> Rows:
        with translate_errors("inbox statement"):
            return _fetch(await self._session.execute(statement, params))

    async def call(self, fn: Callable[..., Any], *args: Any) -> None:
        with translate_errors("handler"):
            result = fn(*args)
            if isinstance(result, Awaitable):
                await result

    async def commit(self) -> None:
        with translate_errors("commit"):
            await self._session.commit()

    async def aclose(self) -> None:
        with translate_errors("rollback"):
            await self._session.close()


class SyncTx:
    """:class:`Tx` over a sync ``Session`` bound to ``engine``; every call in a worker thread.

    The session is used by one thread at a time (each call is awaited before the next), which
    is all SQLAlchemy and psycopg require.
    """

    def __init__(self, engine: Engine) -> None:
        self._session = Session(engine, expire_on_commit=False)

    @property
    def session(self) -> Session:
        return self._session

    async def execute(
        self, statement: sa.Executable, params: Mapping[str, Any] | None = None
    ) -> Rows:
        with translate_errors("inbox statement"):
            return await asyncio.to_thread(lambda: _fetch(self._session.execute(statement, params)))

    async def call(self, fn: Callable[..., Any], *args: Any) -> None:
        with translate_errors("handler"):
            await asyncio.to_thread(fn, *args)

    async def commit(self) -> None:
        with translate_errors("commit"):
            await asyncio.to_thread(self._session.commit)

    async def aclose(self) -> None:
        with translate_errors("rollback"):
            await asyncio.to_thread(self._session.close)
