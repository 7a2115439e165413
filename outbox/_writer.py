"""The write path: stage events into the caller's transaction.

Guarantee (G1, ``docs/guarantees.md``): an event staged with this module is part of the caller's
transaction. If the transaction commits, the event is in the outbox and the relay will publish
it; if it rolls back, so too is the event, and nothing reaches Kafka. Nothing here commits.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel, ValidationError
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session
from sqlalchemy.orm import Session, SessionTransaction, scoped_session

from ledgerbox._core.errors import ConfigurationError
from ledgerbox._core.faults import Fault, driver_fault
from ledgerbox._core.identifiers import kafka_topic
from ledgerbox._core.names import DEFAULT_MAX_RECORD_BYTES as _DEFAULT_MAX_RECORD_BYTES
from ledgerbox._core.plan import Plan, arun_plan, run_plan
from ledgerbox.outbox._envelope import (
    EventEnvelope,
    check_text,
    dumps_payload,
    one_line,
    to_json_payload,
)
from ledgerbox.outbox._errors import (
    EventIdConflictError,
    EventValidationError,
    FutureEventTimeError,
    NaiveDatetimeError,
    PayloadTooLargeError,
    RecordTooLargeError,
)
from ledgerbox.outbox._routing import TopicRouter
from ledgerbox.outbox._table import OutboxTable, shard_of
from ledgerbox.outbox._trace import producer_trace_headers
from ledgerbox.outbox._wire import envelope_headers

__all__ = [
    "DEFAULT_MAX_FUTURE_S",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "DEFAULT_MAX_RECORD_BYTES",
    "OutboxWriter",
    "Staged",
    "envelope_from_row",
    "record_size",
]

#: Kafka's default ``max.message.bytes`` (1 MiB): a larger payload would be refused by the
#: broker long after the business transaction committed, so it is refused at write time.
DEFAULT_MAX_PAYLOAD_BYTES = 1_048_576

#: Default ``max_record_bytes`` (``ledgerbox._core.names``): the relay's default.
DEFAULT_MAX_RECORD_BYTES = _DEFAULT_MAX_RECORD_BYTES

#: Default ``max_future_s``: 50 minutes, under Kafka's default one-hour limit on future
#: record timestamps (``log.message.timestamp.after.max.ms``, Kafka 4.0, KIP-937).
DEFAULT_MAX_FUTURE_S = 3000.0

_Values = dict[str, Any]

_EVENT_ID_NAMESPACE = uuid.UUID("0b7c6d49-4b0e-4c6a-8f3e-9d2a41c7e0a5")


@dataclass(frozen=True, slots=True)
class Staged:
    """Result of :meth:`OutboxWriter.stage_once`.

    Attributes
    ----------
    created : bool
        ``True`` if this call inserted the event; ``False`` if an event with the same
        idempotency key was already committed (or is being committed by a concurrent
        transaction that then committed), in which case nothing was written.
    event : EventEnvelope
        The event now stored under that key: the one just staged, or the FIRST one written
        (its payload carries the first request's result, e.g. the order id to answer with).
    """

    created: bool
    event: EventEnvelope


#: What :meth:`OutboxWriter.stage` writes through: a session (or a registry of sessions), whose
#: flush writes the rows, or a Core connection, which writes them at once.
_Target = (
    Session
    | AsyncSession
    | scoped_session[Session]
    | async_scoped_session[AsyncSession]
    | Connection
)


class OutboxWriter:
    """Builds events and stages them into the caller's open transaction.

    Parameters
    ----------
    router : TopicRouter
        Chooses the topic of each event.
    source : str
        CloudEvents ``source`` of this service, e.g. ``"/order-service"``.
    table : OutboxTable | None
        The outbox table (default: ``OutboxTable()``, i.e. ``outbox`` on the search path).
    max_payload_bytes : int
        Largest serialized payload accepted (compact UTF-8 JSON), in bytes (default 1 MiB).
    max_record_bytes : int | None
        Largest Kafka record accepted, in bytes (default :data:`DEFAULT_MAX_RECORD_BYTES`,
        1 MiB: the relay's default ``max_request_bytes``): the payload as the relay sends
        it (PostgreSQL's ``jsonb`` text, which puts a space after each ``:`` and ``,`` and
        prints ``1e+300`` as 301 digits), the key and the headers. Sized (a second rendering
        of the payload) only for an event that can come near it: a payload from about two
        thirds of it, long strings in the key or headers, a number in exponent form; a
        small event costs a length sum and a byte search (~1 us). A larger record would be
        dead-lettered by the relay after the commit; refused here instead
        (:class:`RecordTooLargeError`). ``None``: not checked.
    max_future_s : float | None
        Latest event time accepted, in seconds after the writer's clock (default 3000 s =
        50 min). Kafka refuses a record timestamp more than
        ``log.message.timestamp.after.max.ms`` ahead of the broker's clock (1 h by default
        since Kafka 4.0), so an event dated further ahead is refused here, when the caller
        can still act, rather than after its transaction committed. The margin under one
        hour covers clock skew. ``None`` disables the check (the relay then publishes a
        refused timestamp as its send time and keeps the event time in ``ce_time``; see
        docs/outbox.md, "Event time").

    Raises
    ------
    ConfigurationError
        If ``max_payload_bytes`` is not positive, ``max_future_s`` is negative or ``source``
        is empty.
    """

    def __init__(
        self,
        router: TopicRouter,
        *,
        source: str,
        table: OutboxTable | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        max_future_s: float | None = DEFAULT_MAX_FUTURE_S,
        max_record_bytes: int | None = DEFAULT_MAX_RECORD_BYTES,
    ) -> None:
        if max_payload_bytes <= 0:
            raise ConfigurationError(f"max_payload_bytes must be > 0, got {max_payload_bytes}")
        if max_record_bytes is not None and not (
            type(max_record_bytes) is int and max_record_bytes > 0
        ):
            raise ConfigurationError(
                f"max_record_bytes must be a positive int or None, got {max_record_bytes!r}"
            )
        self.max_record_bytes = max_record_bytes
        if max_future_s is not None and not max_future_s >= 0:
            raise ConfigurationError(f"max_future_s must be >= 0 or None, got {max_future_s}")
        self.max_future_s = max_future_s
        if not source:
            raise ConfigurationError("source must not be empty")
        self.router = router
        self.source = source
        self.table = table if table is not None else OutboxTable()
        self.max_payload_bytes = max_payload_bytes
        self._insert_once_sql = _insert_once_statement(self.table.table, self.table.qualified_name)
        self._insert = sa.insert(self.table.table)
        self._insert_sql = _insert_driver_sql(self.table.qualified_name)
        # Session.get_bind() finds binds keyed by the mapped class or by the table; it gets
        # the Mapper, as from the unit of work (a get_bind override may read mapper.class_).
        self._bind_args: dict[str, Any] = {
            "mapper": sa.inspect(self.table.row_class),
            "clause": self.table.table,
        }

    # -- building events ------------------------------------------------------------------

    def event(
        self,
        *,
        event_type: str,
        aggregate_type: str,
        aggregate_id: str | int | uuid.UUID,
        payload: BaseModel | Mapping[str, Any],
        idempotency_key: str,
        aggregate_version: int | None = None,
        partition_key: str | None = None,
        occurred_at: dt.datetime | None = None,
        event_id: uuid.UUID | None = None,
        headers: Mapping[str, str] | None = None,
        topic: str | None = None,
    ) -> EventEnvelope:
        """Build a validated envelope (no I/O).

        Parameters
        ----------
        idempotency_key : str
            From the business identity (see :func:`outbox.idempotency_key`).
        partition_key : str | None
            Kafka key; defaults to ``aggregate_id`` so one aggregate keeps its order.
        occurred_at : datetime | None
            Timezone-aware event time; defaults to now (UTC). At most ``max_future_s``
            after now.
        event_id : uuid.UUID | None
            Defaults to a UUIDv5 of the idempotency key, so a retried request that somehow
            reached a second write carries the same event id and consumers drop it.
        headers : Mapping[str, str] | None
            Extra Kafka headers. Unless they carry a ``traceparent``, the trace context is
            added: with an OpenTelemetry SDK configured, that of a new PRODUCER span
            ``create <topic>`` (child of the active span, ended at once); without one, that
            of the active span, if any (docs/observability.md, "Spans").
        topic : str | None
            Overrides the router; must be a legal Kafka topic name.

        Raises
        ------
        NaiveDatetimeError
            ``occurred_at`` or a datetime in the payload has no timezone.
        FutureEventTimeError
            ``occurred_at`` is more than ``max_future_s`` after now.
        NonFiniteNumberError
            A number in the payload is NaN or +-Infinity.
        UnroutedEventError
            No route for ``event_type`` / ``aggregate_type`` and no ``topic`` given.
        EventValidationError
            Any other invalid field (empty strings, non-JSON payload values).
        """
        if occurred_at is not None and (
            occurred_at.tzinfo is None or occurred_at.tzinfo.utcoffset(occurred_at) is None
        ):
            raise NaiveDatetimeError("occurred_at")
        now = dt.datetime.now(dt.UTC)
        if (
            occurred_at is not None
            and self.max_future_s is not None
            and (occurred_at - now).total_seconds() > self.max_future_s
        ):
            raise FutureEventTimeError(occurred_at, self.max_future_s)
        if not isinstance(idempotency_key, str):
            raise EventValidationError(
                f"invalid event {event_type!r}: idempotency_key must be a str, got "
                f"{type(idempotency_key).__name__} (derive one with idempotency_key(...))"
            )
        if topic is not None:
            try:
                kafka_topic(topic)
            except ConfigurationError as exc:
                raise EventValidationError(f"invalid event {event_type!r}: {exc}") from None
        json_payload = to_json_payload(payload)
        if event_id is None:
            try:  # uuid5 encodes the key: a lone surrogate raised a bare UnicodeEncodeError
                check_text(idempotency_key, "idempotency_key")
            except ValueError as exc:
                raise EventValidationError(f"invalid event {event_type!r}: {exc}") from None
            event_id = uuid.uuid5(_EVENT_ID_NAMESPACE, idempotency_key)
        topic = topic if topic is not None else self.router.route(event_type, aggregate_type)
        partition_key = partition_key if partition_key is not None else str(aggregate_id)
        trace_headers = producer_trace_headers(
            topic=topic,
            event_id=event_id,
            event_type=event_type,
            partition_key=partition_key,
            headers=headers,
        )
        all_headers = {**trace_headers, **(headers or {})}
        try:
            return EventEnvelope(
                event_id=event_id,
                idempotency_key=idempotency_key,
                event_type=event_type,
                topic=topic,
                partition_key=partition_key,
                source=self.source,
                aggregate_type=aggregate_type,
                aggregate_id=str(aggregate_id),
                aggregate_version=aggregate_version,
                occurred_at=occurred_at or now,
                payload=json_payload,
                headers=all_headers,
            )
        except ValidationError as exc:
            raise EventValidationError(f"invalid event {event_type!r}: {one_line(exc)}") from exc

    # -- staging ----------------------------------------------------------------------------

    def stage(self, target: _Target, event: EventEnvelope) -> None:
        """Stage one event in the caller's transaction. Never flushes, never commits.

        With a ``Session`` or ``AsyncSession`` this only calls ``session.add`` (no I/O; the
        row is inserted at the session's next flush, at the latest at commit, by one INSERT
        per outbox table per flush - :func:`_insert_staged` - not by the unit of work, and
        after the flush's own statements: the outbox id, the relay's order, is taken under
        the row locks the flush took, docs/outbox.md). With a Core ``Connection`` the INSERT
        runs now, inside the connection's open transaction.

        Guarantee: the event exists if and only if the caller's transaction commits.

        A second event with an already-written idempotency key fails the flush or commit with
        ``sqlalchemy.exc.IntegrityError``; :meth:`is_duplicate` recognises it (SQLSTATE 23505
        on the idempotency constraint). Use :meth:`stage_once` to learn it before committing.

        Raises
        ------
        PayloadTooLargeError
            The payload exceeds ``max_payload_bytes``; nothing is staged.
        EventValidationError
            The payload is not JSON-ready (an envelope built directly: a ``Decimal``, a
            ``datetime``, NaN, a circular or too deeply nested payload); nothing is staged.
        """
        self.stage_many(target, (event,))

    def stage_many(self, target: _Target, events: Iterable[EventEnvelope]) -> None:
        """Stage several events in order, as :meth:`stage` (one INSERT executemany at the flush,
        or now on a Core ``Connection``).

        Raises
        ------
        PayloadTooLargeError
            Any payload exceeds ``max_payload_bytes``; none of the events is staged.
        EventValidationError
            A payload is not JSON-ready (an envelope built directly: a ``Decimal``, a
            ``datetime``, NaN, a circular or too deeply nested payload); none of the events
            is staged.
        """
        pairs = [self._rows(event) for event in events]
        if not pairs:
            return
        if isinstance(target, Connection):
            self._insert_rows(target, pairs)
            return
        if isinstance(target, scoped_session | async_scoped_session):
            target = target()  # the registry's current session
        session = target.sync_session if isinstance(target, AsyncSession) else target
        objects = [self.table.row_class(**row) for row, _ in pairs]
        for obj, pair in zip(objects, pairs, strict=True):
            obj._ledgerbox_row = pair  # type: ignore[attr-defined]
        _listen_for_flushes()
        staged = session.info.setdefault(_STAGED, [])
        staged.extend((self, obj) for obj in objects)
        session.add_all(objects)

    def stage_once(
        self, target: Session | scoped_session[Session] | Connection, event: EventEnvelope
    ) -> Staged:
        """Insert the event now unless its idempotency key exists; never commits.

        Runs ``INSERT ... ON CONFLICT DO NOTHING`` in the caller's open transaction (one round
        trip; the session is not flushed). If a concurrent transaction holds the same key (or
        event id), this waits for it: if it commits, this returns the duplicate; if it rolls
        back, this inserts. Concurrent twins never see a unique violation.

        Events staged with :meth:`stage` on the same session and not yet flushed are written
        first (their INSERT, as the flush would write them; the session's other pending
        objects are not flushed), so the outbox ids - the relay's order per key - follow the
        order of the calls. Before 2026-12-01 a ``stage`` followed by a ``stage_once`` of the
        same aggregate published the second event first.

        Call it before writing the business rows: when ``created`` is ``False``, roll back
        and answer the retried request from ``Staged.event``.

        Returns
        -------
        Staged
            ``created`` and the event stored under the key.

        Raises
        ------
        PayloadTooLargeError
            The payload exceeds ``max_payload_bytes``; nothing is written.
        EventValidationError
            The payload is not JSON-ready (an envelope built directly: a ``Decimal``, a
            ``datetime``, NaN, a circular or too deeply nested payload); nothing is written.
        EventIdConflictError
            The event id is stored under another idempotency key (a caller-chosen
            ``event_id`` reused); nothing is written.
        sqlalchemy.exc.IntegrityError
            An event staged earlier with :meth:`stage` on this session is a duplicate
            (:meth:`is_duplicate` is true of it: of THAT event, not of this one), as its flush
            would have failed; the session must be rolled back, nothing of it commits.
        """

        if isinstance(target, scoped_session):
            target = target()  # the thread's Session (stage's session.add goes to it too)

        def execute(query: _Query) -> sa.Result[Any]:
            if query.driver is not None:
                conn = (
                    target.connection(bind_arguments=self._bind_args)
                    if isinstance(target, Session)
                    else target
                )
                if _psycopg(conn.dialect):
                    return conn.exec_driver_sql(*query.driver)
            if query.routed and isinstance(target, Session):
                return target.execute(query.statement, query.params, bind_arguments=self._bind_args)
            return target.execute(query.statement, query.params)

        if isinstance(target, Session) and _unwritten(target):
            _insert_staged(target, None, None)  # events staged before this one go first
        return run_plan(self._stage_once_plan(event), execute)

    async def astage_once(
        self,
        target: AsyncSession | async_scoped_session[AsyncSession] | AsyncConnection,
        event: EventEnvelope,
    ) -> Staged:
        """The ``async`` form of :meth:`stage_once` for ``AsyncSession`` / ``AsyncConnection``
        (the same statements, results and errors: both run one plan)."""
        if isinstance(target, async_scoped_session):
            target = target()

        async def execute(query: _Query) -> sa.Result[Any]:
            if query.driver is not None:
                conn = (
                    await target.connection(bind_arguments=self._bind_args)
                    if isinstance(target, AsyncSession)
                    else target
                )
                if _psycopg(conn.dialect):
                    return await conn.exec_driver_sql(*query.driver)
            if query.routed and isinstance(target, AsyncSession):
                return await target.execute(
                    query.statement, query.params, bind_arguments=self._bind_args
                )
            return await target.execute(query.statement, query.params)

        if isinstance(target, AsyncSession) and _unwritten(target.sync_session):
            await target.run_sync(_insert_staged, None, None)  # events staged before go first
        return await arun_plan(self._stage_once_plan(event), execute)

    def stage_once_sql(self, *, prefix: str = "outbox_") -> str:
        """:meth:`stage_once`'s INSERT as SQL text, to put the event into the caller's own
        statement as a data-modifying CTE: the business write and the event in ONE round trip.

        ``INSERT INTO <outbox> (...) VALUES (:<prefix>event_id, ...) ON CONFLICT DO NOTHING
        RETURNING id``, with SQLAlchemy's named binds (``:name``, as in ``sa.text``), the
        JSON columns cast from text. Constant for a writer and prefix: build the statement once
        (a module-level ``sa.text``), bind :meth:`stage_once_params` per call::

            WITH staged AS ({writer.stage_once_sql()}),
                 placed AS (INSERT INTO orders (id, ...) SELECT :id, ... FROM staged RETURNING id)
            SELECT id FROM placed

        ``staged`` has one row when the event is new and none when its idempotency key (or
        event id) is already in the outbox, as :meth:`stage_once` answers ``created``
        (except that an event id stored under another key gives no row rather than
        :class:`EventIdConflictError`); make the business write depend on it (``FROM
        staged``). When the statement returns nothing, call :meth:`stage_once`: it returns
        the stored event to answer the retried request from, raises
        :class:`EventIdConflictError` for a reused event id, and answers ``created=True``
        (the event is now written) if the stored row vanished in between (retention
        cleanup): then do the business write as for a new request. Concurrent twins wait for
        each other as with :meth:`stage_once` (REPEATABLE READ: SQLSTATE 40001).

        Ordering (docs/outbox.md, "Ordering"): the event's outbox id, the relay's order
        within a claim, is taken when the statement runs. If the statement also updates an
        existing aggregate, lock that row in an earlier statement (``SELECT ... FOR
        UPDATE``), or writers of one aggregate may be published in id order, not commit
        order. A session's ``schema_translate_map`` does not apply (the table is named as
        configured in :class:`OutboxTable`).

        Guarantee (G1): the row is part of the caller's transaction, like every staged event;
        the relay publishes it after the commit. Events staged with :meth:`stage` on a session
        and not flushed yet are NOT written first (a plain statement does not flush): flush
        before, or publish order per key follows the statements, not the calls. One round
        trip fewer than :meth:`astage_once` + the business statement (the example order
        service: docs/performance.md, "write_overhead_order_tx").

        Parameters
        ----------
        prefix : str
            Prefix of the bind names (``outbox_event_id`` ...), so they cannot clash with the
            statement's own; letters, digits and ``_``, not starting with a digit.

        Returns
        -------
        str
            The INSERT (no trailing semicolon), the table schema-qualified as configured.

        Raises
        ------
        ConfigurationError
            ``prefix`` is not a valid bind name prefix.
        """
        _check_prefix(prefix)
        insert = _insert_sql(
            self.table.qualified_name,
            lambda c: f"CAST(:{prefix}{c} AS jsonb)" if c in _JSON_COLUMNS else f":{prefix}{c}",
        )
        return insert + _ON_CONFLICT_RETURNING

    def stage_once_params(self, event: EventEnvelope, *, prefix: str = "outbox_") -> dict[str, Any]:
        """The bind values of :meth:`stage_once_sql` for ``event``: ``{prefix + column: value}``,
        the payload and headers as JSON text; no I/O. Merge them with the statement's own
        parameters.

        Raises
        ------
        PayloadTooLargeError
            The payload exceeds ``max_payload_bytes``.
        EventValidationError
            The payload is not JSON-ready (an envelope built directly).
        ConfigurationError
            ``prefix`` is not a valid bind name prefix.
        """
        _check_prefix(prefix)
        _row, params = self._rows(event)
        return {prefix + name: value for name, value in params.items()}

    def is_duplicate(self, exc: BaseException) -> bool:
        """True if ``exc`` (or its cause) says this event was already written.

        That is a unique violation (SQLSTATE 23505) of the idempotency-key constraint or of the
        event-id constraint (event ids derive from idempotency keys, so PostgreSQL may report
        either). Classified by SQLSTATE and constraint name, never by message text.
        """
        found = driver_fault(exc)
        if found is None:
            return False
        fault, _sqlstate, constraint = found
        return fault is Fault.DUPLICATE and constraint in self.table.duplicate_constraints

    # -- internals --------------------------------------------------------------------------

    def _stage_once_plan(self, event: EventEnvelope) -> Plan[_Query, sa.Result[Any], Staged]:
        # The logic of stage_once and astage_once (ledgerbox._core.plan). A text statement
        # names no table: a session routes it like the mapped outbox rows (``routed``), as a
        # Session with per-table binds has no default bind.
        row, params = self._rows(event)
        inserted = yield _Query(
            self._insert_once_sql,
            row,
            routed=True,
            driver=(self._insert_sql + _ON_CONFLICT_RETURNING, params),
        )
        if inserted.first() is not None:
            return Staged(created=True, event=event)
        # No row: SOME unique index held the event (ON CONFLICT without a target). Twins of
        # one request race between the idempotency-key and the event-id index, so either may
        # report it; the stored key decides: a duplicate, or another identity's event id.
        existing = (yield _Query(self._select_by_key(event.idempotency_key))).mappings().first()
        if existing is None:
            raise EventIdConflictError(event.event_id, event.idempotency_key)
        return Staged(created=False, event=envelope_from_row(existing))

    def _insert_rows(self, conn: Connection, pairs: list[tuple[_Values, _Values]]) -> None:
        """INSERT the rows of ``pairs`` (:meth:`_rows`) on ``conn``, in its open transaction:
        one statement in the driver's own SQL (engine events and tracing still see it;
        SQLAlchemy's compilation and type processing of a Core insert were ~100 us of client
        CPU per event), one ``executemany`` for several rows. Another driver than psycopg
        3 (its SQL and its adaptation of UUIDs and datetimes), or a connection with a
        ``schema_translate_map`` (which only compiled statements honour), gets the Core
        insert."""
        if not _psycopg(conn.dialect) or conn.get_execution_options().get("schema_translate_map"):
            conn.execute(self._insert, [row for row, _ in pairs])
            return
        params = [p for _, p in pairs]
        conn.exec_driver_sql(self._insert_sql, params if len(params) > 1 else params[0])

    def _rows(self, event: EventEnvelope) -> tuple[_Values, _Values]:
        """The event's column values (for the mapped row object) and the same as driver
        parameters (JSON columns as their JSON text). Raises PayloadTooLargeError."""
        payload_json = dumps_payload(event.payload)
        if len(payload_json) > self.max_payload_bytes:
            raise PayloadTooLargeError(len(payload_json), self.max_payload_bytes)
        headers_json = json.dumps(event.headers, separators=(",", ":"), ensure_ascii=False)
        limit = self.max_record_bytes
        if limit is not None and _may_exceed(event, payload_json, headers_json, limit):
            size = record_size(event)
            if size > limit:
                raise RecordTooLargeError(size, limit)
        row = self._values(event)
        params = dict(row)
        params["payload"] = payload_json.decode("utf-8")
        params["headers"] = headers_json
        return row, params

    def _values(self, event: EventEnvelope) -> dict[str, Any]:
        return {
            "event_id": event.event_id,
            "idempotency_key": event.idempotency_key,
            "topic": event.topic,
            "partition_key": event.partition_key,
            "shard": shard_of(event.partition_key, self.table.shard_count),
            "event_type": event.event_type,
            "source": event.source,
            "aggregate_type": event.aggregate_type,
            "aggregate_id": event.aggregate_id,
            "aggregate_version": event.aggregate_version,
            "payload": event.payload,
            "headers": event.headers,
            "occurred_at": event.occurred_at,
        }

    def _select_by_key(self, key: str) -> sa.Select[Any]:
        table = self.table.table
        return sa.select(table).where(table.c.idempotency_key == key)


#: ``Session.info`` key: ``(writer, row object)`` of the events staged since the last flush.
_STAGED = "ledgerbox.outbox.staged"
#: ``Session.info`` key: the rows of the flush under way, written after its unit of work.
_DEFERRED = "ledgerbox.outbox.deferred"
#: ``Session.info`` key: the (innermost) transaction those rows were staged in.
_DEFERRED_IN = "ledgerbox.outbox.deferred_in"
_Pending = list[tuple["OutboxWriter", tuple[_Values, _Values]]]
_listening = False


def _listen_for_flushes() -> None:
    """Register the flush listeners on every ``Session`` (once per process)."""
    global _listening
    if not _listening:
        sa.event.listen(Session, "before_flush", _insert_staged)
        sa.event.listen(Session, "after_flush", _insert_after_unit_of_work)
        sa.event.listen(Session, "after_soft_rollback", _forget_deferred)
        sa.event.listen(Session, "after_transaction_end", _forget_deferred)
        sa.event.listen(Session, "before_commit", _insert_left_over)
        _listening = True


def _insert_staged(session: Session, flush_context: object, instances: object) -> None:
    """``before_flush``: take the events staged in ``session`` out of it and write them with
    one INSERT per outbox table, in staging order, after the flush's unit of work
    (:func:`_insert_after_unit_of_work`), or now when the flush has nothing else to write.

    The rows still go in at the flush, as ``session.add`` promises (an explicit flush,
    autoflush, or the commit's flush), in the session's transaction (G1). The unit of work
    never sees them: flushing a second mapper cost ~250 us of client CPU per transaction
    (docs/performance.md, "The write path"). An object that is no longer pending (its
    savepoint rolled back, or the caller expunged it) is not written. Events staged by a
    later ``before_flush`` listener are flushed by the unit of work as before (same rows).

    Why after the unit of work: the outbox id is the relay's order within a claim (G3), and
    it is taken at the INSERT. Written before the flush's UPDATE of the aggregate row, a
    writer took its id, then waited for the row lock of a second writer that committed
    first: commit order [T2, T1], id order [T1, T2], and a claim that saw both published them
    in id order (found by an adversarial review, 2026-12-02). Written after it, the id is
    taken under the row locks the flush took, held to the commit: writers that serialize on
    their aggregate's row get ids in commit order.

    Rows are grouped by outbox table (statement and connection), not by writer: two writers
    sharing a table keep the staging order of their events in the ids. A failing INSERT
    (e.g. a duplicate key) fails the flush as a failing unit of work does: the session's
    transaction (or the innermost savepoint) is rolled back and the session must be rolled
    back before it is used again, so a later ``commit`` raises instead of returning over a
    transaction PostgreSQL already aborted.
    """
    session.info.pop(_DEFERRED_IN, None)
    pending: _Pending = session.info.pop(_DEFERRED, None) or []  # a flush without work
    for writer, obj in session.info.pop(_STAGED, None) or ():
        if not sa.inspect(obj).pending:
            continue
        session.expunge(obj)
        pending.append((writer, obj._ledgerbox_row))
    if not pending:
        return
    if (
        flush_context is not None
        and instances is None
        and _last_before_flush(session)
        and _unit_of_work_runs(session)
    ):
        session.info[_DEFERRED] = pending
        session.info[_DEFERRED_IN] = session.get_nested_transaction() or session.get_transaction()
        return
    _write_now(session, pending)


def _last_before_flush(session: Session) -> bool:
    """Whether :func:`_insert_staged` is the session's last ``before_flush`` listener. Only
    then is what it sees what the unit of work will flush: a listener after it could take
    the rest out or raise, and the flush would end without ``after_flush`` (rows kept for
    it would outlive their transaction: an adversarial review, 2026-12-04). With one, the
    rows are written before the unit of work, as before 2026-12-04."""
    listeners = list(session.dispatch.before_flush)
    return bool(listeners) and listeners[-1] is _insert_staged


def _insert_after_unit_of_work(session: Session, flush_context: object) -> None:
    """``after_flush``: write the rows :func:`_insert_staged` kept for after the unit of
    work, inside the flush's own transaction (an error fails the flush)."""
    session.info.pop(_DEFERRED_IN, None)
    pending = session.info.pop(_DEFERRED, None)
    if pending:
        _write(session, pending)


def _forget_deferred(session: Session, previous_transaction: SessionTransaction) -> None:
    """``after_soft_rollback`` and ``after_transaction_end``: the rows kept for after a unit
    of work go with the transaction they were staged in: when the flush itself fails (its
    subtransaction rolls that transaction back), or that transaction or an enclosing one
    rolls back or ends (``close()``; a commit wrote them first: :func:`_insert_left_over`).
    A savepoint begun after them and ended leaves them be."""
    if _DEFERRED not in session.info:
        return
    owner = session.info.get(_DEFERRED_IN)
    chain = []
    while owner is not None:
        chain.append(owner)
        owner = owner.parent
    rolled_back = previous_transaction
    if not rolled_back.nested and rolled_back.parent is not None:
        rolled_back = rolled_back.parent  # a subtransaction (the flush's) fails its parent
    if not chain or any(t is rolled_back for t in chain):
        session.info.pop(_DEFERRED, None)
        session.info.pop(_DEFERRED_IN, None)


def _insert_left_over(session: Session) -> None:
    """``before_commit``: rows kept for a flush whose unit of work then found nothing to do
    are written now, before the commit, or at the next flush if one comes first
    (:func:`_insert_staged`). Only a SQLAlchemy whose flush no longer decides as
    :func:`_unit_of_work_runs` mirrors gets here (no listener runs after ours:
    :func:`_last_before_flush`; SQLAlchemy is pinned below 2.1); kept as a net so such
    rows are still written. It cannot catch the commit's own flush, which comes after
    ``before_commit``."""
    session.info.pop(_DEFERRED_IN, None)
    pending = session.info.pop(_DEFERRED, None)
    if pending:
        _write_now(session, pending)


def _unwritten(session: Session) -> bool:
    """Events staged in ``session`` and not written yet."""
    return bool(session.info.get(_STAGED) or session.info.get(_DEFERRED))


def _unit_of_work_runs(session: Session) -> bool:
    """Whether the flush under way will run its unit of work (and ``after_flush``), as
    ``Session._flush`` decides after ``before_flush``: a changed or deleted object is always
    flushed; a pending one unless it is an orphan the flush drops (delete-orphan cascade,
    taken from its parent outside the session). When unsure (SQLAlchemy's internals
    changed), ``False``: the rows are then written before the unit of work, as before
    2026-12-04."""
    if session.dirty or session.deleted:
        return True
    for obj in session.new:
        state = sa.inspect(obj)
        try:
            dropped = state._orphaned_outside_of_session and state.mapper._is_orphan(state)
        except AttributeError:  # pragma: no cover - a SQLAlchemy without the check
            return False
        if not dropped:
            return True
    return False


def _write_now(session: Session, pending: _Pending) -> None:
    """:func:`_write` outside a flush, in a subtransaction as ``Session._flush`` opens one
    around its unit of work: its rollback on an error deactivates the session's
    transaction (``PendingRollbackError`` until the caller rolls back)."""
    transaction = session._autobegin_t()._begin()
    try:
        _write(session, pending)
    except BaseException:
        with sa.util.safe_reraise():  # a failing rollback does not hide the INSERT's error
            transaction.rollback(_capture_exception=True)
    transaction.commit()


def _write(session: Session, pending: _Pending) -> None:
    """One INSERT per outbox table (and connection) for ``pending``, in staging order."""
    groups: dict[tuple[Connection, str], tuple[OutboxWriter, list[tuple[_Values, _Values]]]]
    groups = {}
    connections: dict[OutboxWriter, Connection] = {}
    for writer, row in pending:
        conn = connections.get(writer)
        if conn is None:
            conn = connections[writer] = session.connection(bind_arguments=writer._bind_args)
        groups.setdefault((conn, writer._insert_sql), (writer, []))[1].append(row)
    for (conn, _sql), (writer, rows) in groups.items():
        writer._insert_rows(conn, rows)


def _psycopg(dialect: sa.Dialect) -> bool:
    """The connection's driver is psycopg 3: the writer's own SQL (``%(name)s`` parameters,
    psycopg's adaptation of UUIDs, datetimes and text) applies. psycopg2 shares the parameter
    style, not the adaptation."""
    return dialect.driver == "psycopg"


def _insert_driver_sql(qualified_name: str) -> str:
    """The outbox INSERT in psycopg's ``%(name)s`` style, JSON columns cast from text."""
    return _insert_sql(
        qualified_name, lambda c: f"%({c})s::jsonb" if c in _JSON_COLUMNS else f"%({c})s"
    )


def _insert_sql(qualified_name: str, placeholder: Callable[[str], str]) -> str:
    """``INSERT INTO <table> (<staged columns>) VALUES (...)`` with ``placeholder(column)``
    as each value: the one spelling of the outbox INSERT in every bind style."""
    names = ", ".join(_STAGED_COLUMNS)
    values = ", ".join(placeholder(c) for c in _STAGED_COLUMNS)
    # names: a validated identifier (OutboxTable) and fixed column names; the placeholders
    # are bind markers built from those names (and a checked prefix)
    return f"INSERT INTO {qualified_name} ({names}) VALUES ({values})"  # noqa: S608


@dataclass(frozen=True, slots=True)
class _Query:
    """One statement of a plan: ``routed`` ones get the outbox binds when run on a session;
    ``driver``: the same statement in psycopg's SQL and parameters, run with
    ``exec_driver_sql`` where the driver is psycopg (no compilation, no type processing)."""

    statement: sa.Executable
    params: dict[str, Any] | None = None
    routed: bool = False
    driver: tuple[str, dict[str, Any]] | None = None


_ON_CONFLICT_RETURNING = " ON CONFLICT DO NOTHING RETURNING id"

#: The staged columns bound as JSON text and cast to ``jsonb`` in SQL.
_JSON_COLUMNS = ("payload", "headers")


#: The columns a writer fills (the keys of ``OutboxWriter._values``); the others have defaults.
_STAGED_COLUMNS = (
    "event_id",
    "idempotency_key",
    "topic",
    "partition_key",
    "shard",
    "event_type",
    "source",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "payload",
    "headers",
    "occurred_at",
)


_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not _PREFIX.match(prefix):
        raise ConfigurationError(
            f"bind name prefix {prefix!r} is not valid: use letters, digits and _, not"
            " starting with a digit (e.g. 'outbox_')"
        )


def _insert_once_statement(table: sa.Table, qualified_name: str) -> sa.TextClause:
    """``INSERT ... ON CONFLICT DO NOTHING RETURNING id`` as text SQL with typed bind
    parameters (each column's own type, so JSON payloads and datetimes are bound exactly as
    ``session.add`` binds them). No conflict target: a conflict on the idempotency key OR the
    event id is the duplicate answer, as concurrent twins may hit either index first.
    SQLAlchemy never caches the compiled form of ``postgresql.insert(...)
    .on_conflict_do_nothing()`` (no cache key: ~0.2 ms of CPU per call to recompile); a text
    statement is compiled once."""
    columns = [table.c[name] for name in _STAGED_COLUMNS]
    statement = sa.text(_insert_sql(qualified_name, lambda c: f":{c}") + _ON_CONFLICT_RETURNING)
    return statement.bindparams(*(sa.bindparam(c.name, type_=c.type) for c in columns))


def envelope_from_row(row: Mapping[Any, Any]) -> EventEnvelope:
    """Rebuild the envelope from an outbox row mapping (as read with ``select(table)``)."""
    return EventEnvelope(
        event_id=row["event_id"],
        idempotency_key=row["idempotency_key"],
        event_type=row["event_type"],
        topic=row["topic"],
        partition_key=row["partition_key"],
        source=row["source"],
        aggregate_type=row["aggregate_type"],
        aggregate_id=row["aggregate_id"],
        aggregate_version=row["aggregate_version"],
        occurred_at=row["occurred_at"],
        payload=row["payload"],
        headers=row["headers"],
    )


#: A number in exponent form in the compact JSON of ``json.dumps`` (``1e+300``, ``1.5e-07``:
#: a float's repr, always ``e`` and a sign), as a value (after ``:``, ``,`` or ``[``, before
#: ``,``, ``]`` or ``}``): ``jsonb`` prints it in full (301 digits), so the payload's size says
#: nothing about the record's then. Not matched inside an ordinary string (a UUID's "3e4f").
_EXPONENT = re.compile(rb"[:,\[]-?[0-9]+(?:\.[0-9]+)?e[+-][0-9]+[,\]}]")


def _may_exceed(event: EventEnvelope, payload_json: bytes, headers_json: str, limit: int) -> bool:
    """Whether the record of ``event`` can come near ``limit`` (then :func:`record_size`
    sizes it). ``jsonb`` prints the payload at most 1.5 times as long as its compact JSON
    (``", "`` for ``","``) except for numbers in exponent form; each other string becomes a
    header or the key, at most 4 UTF-8 bytes a character; 32 KiB cover the fixed headers and
    Kafka's framing."""
    strings = (
        len(headers_json)
        + len(event.partition_key)
        + len(event.idempotency_key)
        + len(event.aggregate_id)
        + len(event.aggregate_type)
        + len(event.event_type)
        + len(event.source)
    )
    if 3 * len(payload_json) + 8 * strings + 65_536 >= 2 * limit:
        return True
    if b"e+" not in payload_json and b"e-" not in payload_json:  # the common case, fast
        return False
    return _EXPONENT.search(payload_json) is not None


def _jsonb_text_delta(value: Any) -> int:
    """How many bytes longer ``jsonb`` prints the floats in ``value`` than ``json.dumps``
    (``1e+300`` -> ``1`` and 300 zeros: ``numeric`` has no exponent form)."""
    if isinstance(value, float):
        text = repr(value)
        return len(format(Decimal(text), "f")) - len(text)
    if isinstance(value, dict):
        return sum(_jsonb_text_delta(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_jsonb_text_delta(v) for v in value)
    return 0


def record_size(event: EventEnvelope) -> int:
    """Kafka's estimate, in bytes, of the record the relay sends for ``event`` (what the
    producer compares with its ``max_request_size``): the payload as PostgreSQL's ``jsonb``
    prints it (``", "`` and ``": "`` between items, numbers without exponent), the partition
    key and the CloudEvents and extra headers."""
    from aiokafka.record.default_records import DefaultRecordBatchBuilder

    value = json.dumps(event.payload, ensure_ascii=False, separators=(", ", ": ")).encode()
    # The record's value is only sized: padding stands for the longer numbers.
    value += b" " * _jsonb_text_delta(event.payload)
    headers = envelope_headers(event)
    size: int = DefaultRecordBatchBuilder.estimate_size_in_bytes(
        key=event.partition_key.encode(), value=value, headers=headers
    )
    return size
