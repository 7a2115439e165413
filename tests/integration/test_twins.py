"""Sync/async twins behave as one (STYLE rule 5), against a real PostgreSQL.

For each twin, ``update_versioned`` / ``aupdate_versioned``, ``fenced_update`` /
``afenced_update``, ``OutboxWriter.stage_once`` / ``astage_once`` and ``SyncTx`` / ``AsyncTx``:
the same SQL reaches the driver (captured with SQLAlchemy's ``before_cursor_execute`` event,
with the bound parameters), the same results come back, the same typed errors are raised
(``VersionConflictError``, ``FencedWriteError``, the translated ``DatabaseError``) and the
signatures match apart from the session or engine type. Each case runs the sync twin in one
transaction and the async twin in another, both rolled back, on the same rows.
"""

from __future__ import annotations

import contextlib
import inspect
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from ledgerbox import DatabaseError
from ledgerbox._core.faults import Fault
from ledgerbox.inbox import (
    FencedWriteError,
    VersionConflictError,
    afenced_update,
    aupdate_versioned,
    fenced_update,
    update_versioned,
)
from ledgerbox.inbox._tx import AsyncTx, Rows, SyncTx, Tx
from ledgerbox.outbox import (
    EventEnvelope,
    OutboxTable,
    OutboxWriter,
    PayloadTooLargeError,
    Staged,
    TopicRouter,
)

metadata = sa.MetaData()
accounts = sa.Table(
    "twin_accounts",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("balance", sa.Numeric(12, 2), nullable=False),
    sa.Column("note", sa.Text, nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=True),
)
# A deferred unique constraint fails at COMMIT, not at the statement: the commit's translation.
DEFERRED_DDL = """
CREATE TABLE twin_deferred (
    k integer NOT NULL,
    CONSTRAINT twin_deferred_k_key UNIQUE (k) DEFERRABLE INITIALLY DEFERRED
)
"""
WRITER = OutboxWriter(
    TopicRouter(default="twins.events"), source="/twin-service", table=OutboxTable()
)


@pytest.fixture(scope="module", autouse=True)
def _tables(engine: Engine) -> None:
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.text(DEFERRED_DDL))
        conn.execute(
            sa.insert(accounts),
            [
                {"id": 1, "balance": Decimal("10.00"), "note": "a", "version": 1, "fence": None},
                {"id": 2, "balance": Decimal("20.00"), "note": "b", "version": 7, "fence": 40},
            ],
        )


# -- running a twin pair ---------------------------------------------------------------------

Statement = tuple[str, Any]


@dataclass
class Run:
    """What one twin did: its result or error, and every statement it sent, with parameters."""

    result: Any = None
    error: BaseException | None = None
    sql: list[Statement] = field(default_factory=list)


def _plain(value: Any) -> Any:
    # psycopg wraps JSON parameters (Jsonb(obj)), which compare by identity: compare the obj.
    wrapped = getattr(value, "obj", None)
    return ("json", wrapped) if wrapped is not None and hasattr(value, "dumps") else value


@contextlib.contextmanager
def capture(engine: Engine) -> Iterator[list[Statement]]:
    """Every statement ``engine`` sends to the driver while the block runs."""
    seen: list[Statement] = []

    def listener(
        _conn: Any, _cursor: Any, statement: str, params: Any, _ctx: Any, _many: bool
    ) -> None:
        if isinstance(params, dict):
            params = {k: _plain(v) for k, v in params.items()}
        seen.append((statement, params))

    sa.event.listen(engine, "before_cursor_execute", listener)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", listener)


def run_sync(engine: Engine, fn: Callable[[Session], Any], binds: Any = None) -> Run:
    run = Run()
    session = Session(engine) if binds is None else Session(binds=binds)
    with session, capture(engine) as seen:
        try:
            run.result = fn(session)
        except Exception as exc:
            run.error = exc
        finally:
            session.rollback()
    run.sql = [s for s in seen if s[0] != "ROLLBACK"]
    return run


async def run_async(
    async_engine: AsyncEngine,
    fn: Callable[[AsyncSession], Awaitable[Any]],
    binds: Any = None,
) -> Run:
    run = Run()
    session = AsyncSession(async_engine) if binds is None else AsyncSession(binds=binds)
    async with session:
        with capture(async_engine.sync_engine) as seen:
            try:
                run.result = await fn(session)
            except Exception as exc:
                run.error = exc
            finally:
                await session.rollback()
    run.sql = [s for s in seen if s[0] != "ROLLBACK"]
    return run


def same_error(a: BaseException | None, b: BaseException | None) -> None:
    assert type(a) is type(b), (a, b)
    if a is None or b is None:
        return
    assert str(a) == str(b)
    if isinstance(a, sa.exc.DBAPIError):
        assert isinstance(b, sa.exc.DBAPIError)
        assert a.orig.sqlstate == b.orig.sqlstate  # type: ignore[union-attr]
    else:
        assert vars(a) == vars(b)  # the typed attributes: table, key, fault, sqlstate, ...


def same_run(sync: Run, asyn: Run) -> None:
    """The async twin sent the same statements with the same parameters, and answered alike."""
    assert sync.sql == asyn.sql
    same_error(sync.error, asyn.error)
    assert sync.result == asyn.result


@pytest.fixture
async def warm(engine: Engine, async_engine: AsyncEngine) -> None:
    # A pool's first connection runs the dialect's own queries; keep them out of the capture.
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT 1"))
    async with async_engine.connect() as conn:
        await conn.execute(sa.text("SELECT 1"))


# -- signatures ----------------------------------------------------------------------------

ASYNC_TYPES = {
    "async_scoped_session": "scoped_session",
    "AsyncSession": "Session",
    "AsyncConnection": "Connection",
    "AsyncEngine": "Engine",
}


def _as_sync(annotation: Any) -> Any:
    if not isinstance(annotation, str):
        return annotation
    for name, sync_name in ASYNC_TYPES.items():
        annotation = annotation.replace(name, sync_name)
    return annotation


def _shape(fn: Callable[..., Any]) -> list[tuple[str, Any, Any, Any]]:
    signature = inspect.signature(fn)
    params = [
        (p.name, p.kind, p.default, _as_sync(p.annotation)) for p in signature.parameters.values()
    ]
    return [*params, ("return", None, None, signature.return_annotation)]


@pytest.mark.parametrize(
    ("sync", "asyn"),
    [
        (update_versioned, aupdate_versioned),
        (fenced_update, afenced_update),
        (OutboxWriter.stage_once, OutboxWriter.astage_once),
        (SyncTx.__init__, AsyncTx.__init__),
        (SyncTx.execute, AsyncTx.execute),
        (SyncTx.call, AsyncTx.call),
        (SyncTx.commit, AsyncTx.commit),
        (SyncTx.aclose, AsyncTx.aclose),
    ],
    ids=lambda fn: fn.__qualname__,
)
def test_twin_signatures_match_apart_from_the_session_type(
    sync: Callable[..., Any], asyn: Callable[..., Any]
) -> None:
    assert _shape(sync) == _shape(asyn)
    if sync.__name__ in ("update_versioned", "fenced_update", "stage_once"):
        assert not inspect.iscoroutinefunction(sync)
        assert inspect.iscoroutinefunction(asyn)
    elif sync.__name__ != "__init__":  # the Tx adapters: both driven from async code
        assert inspect.iscoroutinefunction(sync) and inspect.iscoroutinefunction(asyn)


def test_tx_adapters_have_the_same_members() -> None:
    def members(cls: type) -> set[str]:
        return {name for name in vars(cls) if not name.startswith("_")}

    assert members(SyncTx) == members(AsyncTx) == {"session", "execute", "call", "commit", "aclose"}
    for cls in (SyncTx, AsyncTx):
        assert isinstance(vars(cls)["session"], property)


# -- update_versioned / aupdate_versioned --------------------------------------------------


def _versioned(
    key: dict[str, Any], expected: int, values: dict[str, Any], **options: Any
) -> tuple[Callable[[Session], Any], Callable[[AsyncSession], Awaitable[Any]]]:
    def sync(session: Session) -> Any:
        new = update_versioned(session, accounts, key, expected, values, **options)
        return new, session.execute(sa.select(accounts).order_by(accounts.c.id)).all()

    async def asyn(session: AsyncSession) -> Any:
        new = await aupdate_versioned(session, accounts, key, expected, values, **options)
        return new, (await session.execute(sa.select(accounts).order_by(accounts.c.id))).all()

    return sync, asyn


@pytest.mark.parametrize(
    ("key", "expected", "values", "outcome"),
    [
        ({"id": 1}, 1, {"balance": Decimal("11.50")}, 2),
        ({"id": 2}, 7, {"balance": Decimal("0"), "note": "z"}, 8),
        ({"id": 1}, 3, {"balance": Decimal("1")}, VersionConflictError),  # stale version
        ({"id": 99}, 1, {"balance": Decimal("1")}, VersionConflictError),  # no such row
        ({"id": 1, "note": "b"}, 1, {"balance": Decimal("1")}, VersionConflictError),
        ({"id": 1}, 1, {"note": None}, IntegrityError),  # NOT NULL violation, 23502
    ],
    ids=["applied", "applied-two-columns", "stale", "missing", "key-mismatch", "db-error"],
)
async def test_update_versioned_twins(
    warm: None,
    engine: Engine,
    async_engine: AsyncEngine,
    key: dict[str, Any],
    expected: int,
    values: dict[str, Any],
    outcome: int | type[Exception],
) -> None:
    sync_fn, async_fn = _versioned(key, expected, values)
    sync = run_sync(engine, sync_fn)
    asyn = await run_async(async_engine, async_fn)
    same_run(sync, asyn)
    assert sync.sql and sync.sql[0][0].startswith("UPDATE twin_accounts SET")
    if isinstance(outcome, int):
        assert sync.error is None and sync.result[0] == outcome
    else:
        assert isinstance(sync.error, outcome)
    if isinstance(sync.error, VersionConflictError):
        assert (sync.error.table, sync.error.key, sync.error.expected_version) == (
            "twin_accounts",
            key,
            expected,
        )


async def test_update_versioned_twins_refuse_bad_arguments_before_any_sql(
    warm: None, engine: Engine, async_engine: AsyncEngine
) -> None:
    for key, target, version_column in [
        ({}, accounts, "version"),
        ({"id": 1}, "twin_accounts", "version"),
        ({"id": 1}, accounts, "no_such_column"),
    ]:

        def sync_fn(s: Session, key: Any = key, t: Any = target, c: str = version_column) -> Any:
            return update_versioned(s, t, key, 1, {"balance": 1}, version_column=c)

        async def async_fn(
            s: AsyncSession, key: Any = key, t: Any = target, c: str = version_column
        ) -> Any:
            return await aupdate_versioned(s, t, key, 1, {"balance": 1}, version_column=c)

        sync = run_sync(engine, sync_fn)
        asyn = await run_async(async_engine, async_fn)
        same_run(sync, asyn)
        assert sync.sql == [] and isinstance(sync.error, ValueError | TypeError | KeyError)


# -- fenced_update / afenced_update --------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "token", "outcome"),
    [
        ({"id": 1}, 5, None),  # never fenced (NULL)
        ({"id": 2}, 41, None),  # newer than the stored 40
        ({"id": 2}, 40, FencedWriteError),  # not newer
        ({"id": 2}, 3, FencedWriteError),  # older
        ({"id": 99}, 50, FencedWriteError),  # no such row
    ],
    ids=["null-fence", "newer", "equal", "older", "missing"],
)
async def test_fenced_update_twins(
    warm: None,
    engine: Engine,
    async_engine: AsyncEngine,
    key: dict[str, Any],
    token: int,
    outcome: type[Exception] | None,
) -> None:
    values = {"note": "fenced"}

    def sync_fn(session: Session) -> Any:
        fenced_update(session, accounts, key, token, values)
        return session.execute(sa.select(accounts).order_by(accounts.c.id)).all()

    async def async_fn(session: AsyncSession) -> Any:
        await afenced_update(session, accounts, key, token, values)
        return (await session.execute(sa.select(accounts).order_by(accounts.c.id))).all()

    sync = run_sync(engine, sync_fn)
    asyn = await run_async(async_engine, async_fn)
    same_run(sync, asyn)
    assert sync.sql and sync.sql[0][0].startswith("UPDATE twin_accounts SET")
    if outcome is None:
        assert sync.error is None
        row = next(r for r in sync.result if r.id == key["id"])
        assert (row.note, row.fence) == ("fenced", token)
    else:
        assert isinstance(sync.error, FencedWriteError)
        assert (sync.error.table, sync.error.key, sync.error.fencing_token) == (
            "twin_accounts",
            key,
            token,
        )


async def test_fenced_update_twins_translate_alike_inside_a_handler(
    warm: None, engine: Engine, async_engine: AsyncEngine
) -> None:
    """Run by the consumer (``Tx.call``), a driver error of either twin is the same
    ``DatabaseError``; a typed error passes unchanged."""

    def sync_bad(ctx_session: Session) -> None:
        fenced_update(ctx_session, accounts, {"id": 1}, 5, {"note": None})

    async def async_bad(ctx_session: AsyncSession) -> None:
        await afenced_update(ctx_session, accounts, {"id": 1}, 5, {"note": None})

    def sync_stale(ctx_session: Session) -> None:
        fenced_update(ctx_session, accounts, {"id": 2}, 1, {"note": "x"})

    async def async_stale(ctx_session: AsyncSession) -> None:
        await afenced_update(ctx_session, accounts, {"id": 2}, 1, {"note": "x"})

    for sync_fn, async_fn, expected in [
        (sync_bad, async_bad, DatabaseError),
        (sync_stale, async_stale, FencedWriteError),
    ]:
        errors: list[BaseException] = []
        pairs: list[tuple[Tx, Callable[..., Any]]] = [
            (SyncTx(engine), sync_fn),
            (AsyncTx(async_engine), async_fn),
        ]
        for tx, fn in pairs:
            with pytest.raises(expected) as caught:
                await tx.call(fn, tx.session)
            await tx.aclose()
            errors.append(caught.value)
        same_error(*errors)
        if isinstance(errors[0], DatabaseError):
            assert (errors[0].fault, errors[0].sqlstate) == (Fault.MESSAGE, "23502")
            assert str(errors[0]).startswith("handler failed: ")


# -- OutboxWriter.stage_once / astage_once -------------------------------------------------


def _event(key: str, payload: dict[str, Any] | None = None) -> EventEnvelope:
    return WRITER.event(
        event_type="TwinHappened",
        aggregate_type="twin",
        aggregate_id="t-1",
        payload=payload if payload is not None else {"amount": Decimal("1.10"), "n": 1},
        idempotency_key=key,
    )


# Names the table, so that a session with per-table binds can route it.
COUNT = sa.select(sa.func.count()).select_from(WRITER.table.table)


def _stage_sync(event: EventEnvelope) -> Callable[[Session], Any]:
    def fn(session: Session) -> Any:
        staged = WRITER.stage_once(session, event)
        return staged, session.execute(COUNT).scalar_one()

    return fn


def _stage_async(event: EventEnvelope) -> Callable[[AsyncSession], Awaitable[Any]]:
    async def fn(session: AsyncSession) -> Any:
        staged = await WRITER.astage_once(session, event)
        return staged, (await session.execute(COUNT)).scalar_one()

    return fn


@pytest.mark.parametrize("binds", [False, True], ids=["engine-bound", "per-table-binds"])
async def test_stage_once_twins_on_sessions(
    warm: None, engine: Engine, async_engine: AsyncEngine, binds: bool
) -> None:
    first = _event(f"twin:{uuid.uuid4()}")
    with Session(engine) as session, session.begin():
        WRITER.stage(session, first)  # committed: the key exists
    again = _event(first.idempotency_key, {"amount": Decimal("9.99"), "n": 2})
    fresh = _event(f"twin:{uuid.uuid4()}")
    table = WRITER.table.table
    sync_binds = {table: engine} if binds else None
    async_binds = {table: async_engine} if binds else None
    for event, created, statements in [(fresh, True, 1), (again, False, 2)]:
        sync = run_sync(engine, _stage_sync(event), sync_binds)
        asyn = await run_async(async_engine, _stage_async(event), async_binds)
        same_run(sync, asyn)
        assert sync.error is None
        staged, _count = sync.result
        assert staged == Staged(created=created, event=event if created else first)
        assert [s[0].split()[0] for s in sync.sql][:statements] == ["INSERT", "SELECT"][:statements]
        assert len(sync.sql) == statements + 1  # and the count(*)


async def test_stage_once_twins_on_connections(
    warm: None, engine: Engine, async_engine: AsyncEngine
) -> None:
    first = _event(f"twin:{uuid.uuid4()}")
    with engine.begin() as conn:
        WRITER.stage(conn, first)
    for event in [_event(f"twin:{uuid.uuid4()}"), _event(first.idempotency_key)]:
        with capture(engine) as sync_sql, engine.connect() as conn:
            sync_result = WRITER.stage_once(conn, event)
            conn.rollback()
        async with async_engine.connect() as aconn:
            with capture(async_engine.sync_engine) as async_sql:
                async_result = await WRITER.astage_once(aconn, event)
                await aconn.rollback()
        assert [s for s in sync_sql if s[0] != "ROLLBACK"] == [
            s for s in async_sql if s[0] != "ROLLBACK"
        ]
        assert sync_result == async_result
        assert sync_result.event == (event if sync_result.created else first)


async def test_stage_once_twins_refuse_a_large_payload_before_any_sql(
    warm: None, engine: Engine, async_engine: AsyncEngine
) -> None:
    small = OutboxWriter(TopicRouter(default="twins.events"), source="/t", max_payload_bytes=8)
    event = _event(f"twin:{uuid.uuid4()}", {"text": "x" * 64})
    sync = run_sync(engine, lambda s: small.stage_once(s, event))
    asyn = await run_async(async_engine, lambda s: small.astage_once(s, event))
    same_run(sync, asyn)
    assert sync.sql == [] and isinstance(sync.error, PayloadTooLargeError)


# -- SyncTx / AsyncTx ----------------------------------------------------------------------


async def _drive(tx: Tx, engine: Engine, steps: Callable[[Tx], Awaitable[Any]]) -> Run:
    run = Run()
    with capture(engine) as seen:
        try:
            run.result = await steps(tx)
        except Exception as exc:
            run.error = exc
        finally:
            await tx.aclose()
    run.sql = seen
    return run


async def _both(
    engine: Engine, async_engine: AsyncEngine, steps: Callable[[Tx], Awaitable[Any]]
) -> tuple[Run, Run]:
    sync = await _drive(SyncTx(engine), engine, steps)
    asyn = await _drive(AsyncTx(async_engine), async_engine.sync_engine, steps)
    same_run(sync, asyn)
    return sync, asyn


def _deferred_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM twin_deferred")).scalar_one())


async def test_tx_twins_execute_and_commit_alike(
    warm: None, engine: Engine, async_engine: AsyncEngine
) -> None:
    clear = sa.text("DELETE FROM twin_deferred")
    select = sa.text("SELECT id, balance FROM twin_accounts WHERE id >= :low ORDER BY id")
    insert = sa.text("INSERT INTO twin_deferred (k) VALUES (:k)")

    async def steps(tx: Tx) -> Any:
        await tx.execute(clear)
        rows = await tx.execute(select, {"low": 1})
        inserted = await tx.execute(insert, {"k": 1})
        await tx.commit()
        return rows, inserted.rowcount, list(inserted.rows)

    sync, _asyn = await _both(engine, async_engine, steps)
    rows, rowcount, returned = sync.result
    assert isinstance(rows, Rows)
    assert [tuple(r) for r in rows.rows] == [(1, Decimal("10.00")), (2, Decimal("20.00"))]
    assert (rowcount, returned) == (1, [])
    assert sync.sql == [
        ("DELETE FROM twin_deferred", {}),
        ("SELECT id, balance FROM twin_accounts WHERE id >= %(low)s ORDER BY id", {"low": 1}),
        ("INSERT INTO twin_deferred (k) VALUES (%(k)s)", {"k": 1}),
    ]
    assert _deferred_count(engine) == 1  # each run committed its row (the second replaced it)
    with engine.begin() as conn:
        conn.execute(clear)


async def test_tx_twins_roll_back_what_is_not_committed(
    warm: None, engine: Engine, async_engine: AsyncEngine
) -> None:
    async def steps(tx: Tx) -> Any:
        return (await tx.execute(sa.text("INSERT INTO twin_deferred (k) VALUES (7)"))).rowcount

    before = _deferred_count(engine)
    sync, _asyn = await _both(engine, async_engine, steps)
    assert sync.result == 1
    assert _deferred_count(engine) == before


@pytest.mark.parametrize(
    ("steps_name", "prefix", "fault", "sqlstate"),
    [
        ("statement", "inbox statement failed: ", Fault.MESSAGE, "22012"),
        ("handler", "handler failed: ", Fault.MESSAGE, "22012"),
        ("commit", "commit failed: ", Fault.DUPLICATE, "23505"),
        ("missing-table", "inbox statement failed: ", Fault.ENVIRONMENT, "42P01"),
    ],
)
async def test_tx_twins_translate_driver_errors_alike(
    warm: None,
    engine: Engine,
    async_engine: AsyncEngine,
    steps_name: str,
    prefix: str,
    fault: Fault,
    sqlstate: str,
) -> None:
    zero = sa.text("SELECT 1 / 0")

    def sync_handler(session: Session) -> None:
        session.execute(zero)

    async def async_handler(session: AsyncSession) -> None:
        await session.execute(zero)

    async def steps(tx: Tx) -> Any:
        if steps_name == "statement":
            await tx.execute(zero)
        elif steps_name == "missing-table":
            await tx.execute(sa.text("SELECT * FROM twin_no_such_table"))
        elif steps_name == "handler":
            handler: Any = sync_handler if isinstance(tx, SyncTx) else async_handler
            await tx.call(handler, tx.session)
        else:
            await tx.execute(sa.text("INSERT INTO twin_deferred (k) VALUES (3), (3)"))
            await tx.commit()

    sync, asyn = await _both(engine, async_engine, steps)
    error = sync.error
    assert isinstance(error, DatabaseError) and asyn.error is not None
    assert str(error).startswith(prefix)
    assert (error.fault, error.sqlstate) == (fault, sqlstate)
    assert isinstance(error.__cause__, sa.exc.DBAPIError)  # the driver's error, kept
    assert type(error.__cause__) is type(asyn.error.__cause__)
    if steps_name == "commit":
        assert error.constraint == "twin_deferred_k_key"


async def test_tx_twins_let_other_errors_pass_unchanged(
    warm: None, engine: Engine, async_engine: AsyncEngine
) -> None:
    def sync_handler(session: Session) -> None:
        raise ValueError("business rule")

    async def async_handler(session: AsyncSession) -> None:
        raise ValueError("business rule")

    async def steps(tx: Tx) -> Any:
        handler: Any = sync_handler if isinstance(tx, SyncTx) else async_handler
        await tx.call(handler, tx.session)

    sync, _asyn = await _both(engine, async_engine, steps)
    assert isinstance(sync.error, ValueError) and sync.error.__cause__ is None
