"""The order service's reaction to payment results (runs inside the inbox transaction).

Legal transitions: PENDING -> PAID (``PaymentSucceeded``) and PENDING -> CANCELLED
(``PaymentFailed``). A result for an order that is no longer PENDING (late, duplicate under a
new event id, contradictory) is acknowledged as a no-op and recorded as ``ignored``: an order
never moves backwards. Every decision is written to ``order_events_applied``.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from example_services._events import MalformedEventError, PaymentResultPayload, parse_payload
from example_services._read_ahead import cached, keep
from example_services.orders._models import OrderStatus, order_events_applied, orders
from ledgerbox.inbox import VersionConflictError
from ledgerbox.outbox import EventEnvelope

__all__ = [
    "INSERT_APPLIED",
    "MOVE_ORDER",
    "PAYMENT_RESULTS",
    "SELECT_ORDER_STATES",
    "Applied",
    "apply_payment_result",
    "next_status",
]

#: Event type -> the status it moves a PENDING order to.
PAYMENT_RESULTS = {
    "PaymentSucceeded": OrderStatus.PAID,
    "PaymentFailed": OrderStatus.CANCELLED,
}


#: Statements built once, executed with parameter dicts: their compiled form and cache key
#: are reused (building ``select(...).where(...)`` / ``insert(...).values(...)`` per event
#: costs ~100 us of CPU each in SQLAlchemy).
#: The status and version of the orders of a whole batch in ONE round trip (read ahead,
#: docs/inbox.md "Reading ahead for a batch"). Parameter: ``ids``, a list of order ids.
SELECT_ORDER_STATES = sa.text("SELECT id, status, version FROM orders WHERE id = ANY(:ids)")
INSERT_APPLIED = sa.insert(order_events_applied)

#: ``session.info`` key of (the transaction, the states it read ahead or wrote: order id ->
#: (status, version), or ``None`` for an order that does not exist).
_STATES = "example_services.orders.states"
_States = dict[uuid.UUID, tuple[OrderStatus, int] | None]

#: The versioned status change (G5: ``WHERE version = :version_before``, the version read
#: just before) and its history entry in ONE statement: a data-modifying CTE, one round trip
#: instead of two (``aupdate_versioned`` then an INSERT). No row back means the version
#: check failed: the caller raises ``VersionConflictError``, exactly what
#: ``aupdate_versioned`` raises. Parameters: ``order_id``, ``event_id``, ``event_type``,
#: ``from_status``, ``to_status``, ``version_before``, ``outcome``.
MOVE_ORDER = sa.text(
    """
    WITH moved AS (
        UPDATE orders
           SET status = :to_status, version = version + 1, closed_at = clock_timestamp()
         WHERE id = :order_id AND version = :version_before
        RETURNING version
    )
    INSERT INTO order_events_applied (order_id, event_id, event_type, from_status, to_status,
                                      version_before, version_after, outcome)
    SELECT :order_id, :event_id, :event_type, :from_status, :to_status, :version_before,
           moved.version, :outcome
      FROM moved
    RETURNING version_after
    """
)


class Applied(enum.Enum):
    """What :func:`apply_payment_result` did."""

    APPLIED = "applied"
    IGNORED = "ignored"
    UNKNOWN_ORDER = "unknown_order"


def next_status(current: OrderStatus, event_type: str) -> OrderStatus | None:
    """The status after ``event_type``, or ``None`` if the event must not change the order.

    Pure: the whole state machine of an order's payment. Only PENDING moves.
    """
    target = PAYMENT_RESULTS.get(event_type)
    if target is None or current is not OrderStatus.PENDING:
        return None
    return target


def _order_ids(events: Sequence[EventEnvelope]) -> set[uuid.UUID]:
    ids = set()
    for event in events:
        try:
            ids.add(parse_payload(PaymentResultPayload, event).order_id)
        except MalformedEventError:
            continue  # its own handler call reports it
    return ids


async def order_state(
    session: AsyncSession, order_id: uuid.UUID, batch: Sequence[EventEnvelope] = ()
) -> tuple[OrderStatus, int] | None:
    """The order's (status, version) as this transaction last read or wrote it; ``None``: no
    such order. The first call of a transaction reads the orders of every payment result
    of ``batch`` (``HandlerContext.batch``) in one statement; a later call for an order not
    read yet reads it (and the rest of its batch) then. Kept with the transaction it belongs
    to: a session used for another transaction (a retry after a rollback) reads again."""
    states: _States = cached(session, _STATES, dict)
    if order_id not in states:
        ids = {order_id} | _order_ids([e for e in batch if e.event_type in PAYMENT_RESULTS])
        ids -= states.keys()
        rows = (await session.execute(SELECT_ORDER_STATES, {"ids": list(ids)})).all()
        states.update(dict.fromkeys(ids))
        states.update({row.id: (OrderStatus(row.status), int(row.version)) for row in rows})
        keep(session, _STATES, states)
    return states[order_id]


async def apply_payment_result(
    session: AsyncSession, event: EventEnvelope, batch: Sequence[EventEnvelope] = ()
) -> Applied:
    """Apply ``PaymentSucceeded`` / ``PaymentFailed`` to its order in the caller's transaction.

    ``batch``: the events whose handlers run in this transaction (``HandlerContext.batch``):
    their orders are read in one statement, at the first call (:func:`order_state`).

    Raises
    ------
    inbox.VersionConflictError
        The order changed since it was read (another result raced this one, or a writer
        outside this transaction moved it since the batch's read): the consumer rolls back
        and reruns, and the rerun sees the order no longer PENDING.
    MalformedEventError
        The payload has no order id that is a UUID; raised before anything is read or
        written (example_services/_events.py).
    """
    order_id = parse_payload(PaymentResultPayload, event).order_id
    state = await order_state(session, order_id, batch)
    if state is None:
        # The order committed before its OrderPlaced was published (G1), so a payment result
        # for an unknown order is not ours (another deployment, hand-made record): ack it.
        return Applied.UNKNOWN_ORDER
    current, version = state
    target = next_status(current, event.event_type)
    if target is None:
        await session.execute(
            INSERT_APPLIED,
            {
                "order_id": order_id,
                "event_id": event.event_id,
                "event_type": event.event_type,
                "from_status": current.value,
                "to_status": current.value,
                "version_before": version,
                "version_after": version,
                "outcome": Applied.IGNORED.value,
            },
        )
        return Applied.IGNORED
    moved = (
        await session.execute(
            MOVE_ORDER,
            {
                "order_id": order_id,
                "event_id": event.event_id,
                "event_type": event.event_type,
                "from_status": current.value,
                "to_status": target.value,
                "version_before": version,
                "outcome": Applied.APPLIED.value,
            },
        )
    ).first()
    if moved is None:
        raise VersionConflictError(orders.name, {"id": order_id}, version)
    states: _States = cached(session, _STATES, dict)
    states[order_id] = (target, int(moved.version_after))
    return Applied.APPLIED
