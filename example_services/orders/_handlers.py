"""The order service's reaction to payment results (runs inside the inbox transaction).

Legal transitions: PENDING -> PAID (``PaymentSucceeded``) and PENDING -> CANCELLED
(``PaymentFailed``). A result for an order that is no longer PENDING (late, duplicate under a
new event id, contradictory) is acknowledged as a no-op and recorded as ``ignored``: an order
never moves backwards. Every decision is written to ``order_events_applied``.
"""

from __future__ import annotations

import enum
import uuid

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from example_services.orders._models import OrderStatus, order_events_applied, orders
from ledgerbox.inbox import VersionConflictError
from ledgerbox.outbox import EventEnvelope

__all__ = [
    "INSERT_APPLIED",
    "MOVE_ORDER",
    "PAYMENT_RESULTS",
    "SELECT_ORDER_STATE",
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
#: costs ~100 us of CPU each in SQLAlchemy). Parameter of the select: ``id``.
SELECT_ORDER_STATE = sa.select(orders.c.status, orders.c.version).where(
    orders.c.id == sa.bindparam("id")
)
INSERT_APPLIED = sa.insert(order_events_applied)

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


async def apply_payment_result(session: AsyncSession, event: EventEnvelope) -> Applied:
    """Apply ``PaymentSucceeded`` / ``PaymentFailed`` to its order in the caller's transaction.

    Raises
    ------
    inbox.VersionConflictError
        The order changed since it was read (another result raced this one): the consumer
        rolls back and reruns, and the rerun sees the order no longer PENDING.
    """
    order_id = uuid.UUID(str(event.payload["order_id"]))
    row = (await session.execute(SELECT_ORDER_STATE, {"id": order_id})).first()
    if row is None:
        # The order committed before its OrderPlaced was published (G1), so a payment result
        # for an unknown order is not ours (another deployment, hand-made record): ack it.
        return Applied.UNKNOWN_ORDER
    current, version = OrderStatus(row.status), int(row.version)
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
    return Applied.APPLIED
