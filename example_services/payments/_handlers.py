"""The payment service's reaction to ``OrderPlaced`` (runs inside the inbox transaction).

The wallet is the hot aggregate: many orders of one customer, on different partitions, race on
one row. The debit is an optimistic ``UPDATE ... WHERE version = :read`` (G5); the loser gets
``inbox.VersionConflictError`` and the consumer reruns it with the new balance. The payment
row and the ``PaymentSucceeded`` / ``PaymentFailed`` event commit with the inbox row (G1, G4).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from example_services._events import MalformedEventError, OrderPlacedPayload, parse_payload
from example_services._read_ahead import cached, keep
from example_services.payments._models import PaymentStatus, wallets
from ledgerbox.inbox import VersionConflictError
from ledgerbox.outbox import EventEnvelope, OutboxWriter, TopicRouter, idempotency_key

__all__ = [
    "DEBIT_AND_RECORD",
    "FAIL_AND_RECORD",
    "READ_AHEAD",
    "SOURCE",
    "decide",
    "pay_order",
    "payment_writer",
]

SOURCE = "/payment-service"

#: For every order of a batch its payment, if any, and for every customer its wallet, in ONE
#: round trip (read ahead, docs/inbox.md "Reading ahead for a batch"). Parameters:
#: ``order_ids`` (uuids), ``customer_ids`` (texts). Rows: ``('payment', order id, NULL,
#: NULL)`` per order already paid, ``('wallet', customer id, balance, version)`` per wallet.
READ_AHEAD = sa.text(
    """
    SELECT 'payment' AS kind, p.order_id::text AS key, NULL::numeric AS balance,
           NULL::integer AS version
      FROM payments AS p WHERE p.order_id = ANY(:order_ids)
    UNION ALL
    SELECT 'wallet', w.customer_id, w.balance, w.version
      FROM wallets AS w WHERE w.customer_id = ANY(:customer_ids)
    """
)

#: A failed payment (nothing debited), recorded only while the wallet is as it was read:
#: at the version read (``:version``), or still absent when none was read (``:version``
#: NULL). No row back: the wallet changed since the read (a top-up, a new wallet): the caller
#: raises ``VersionConflictError`` and the consumer reruns with a fresh read, so "insufficient
#: funds" / "no wallet" is never decided on a stale balance. Parameters: ``id``,
#: ``order_id``, ``customer_id``, ``amount``, ``status``, ``reason``, ``balance_after``
#: (NULL without a wallet), ``event_id``, ``version``.
FAIL_AND_RECORD = sa.text(
    """
    INSERT INTO payments (id, order_id, customer_id, amount, status, reason, balance_after,
                          event_id)
    SELECT :id, :order_id, :customer_id, :amount, :status, CAST(:reason AS text),
           CAST(:balance_after AS numeric), :event_id
     WHERE CASE WHEN CAST(:version AS integer) IS NULL
                THEN NOT EXISTS (SELECT 1 FROM wallets WHERE customer_id = :customer_id)
                ELSE EXISTS (SELECT 1 FROM wallets
                              WHERE customer_id = :customer_id
                                AND version = CAST(:version AS integer))
           END
    RETURNING id
    """
)

#: The versioned debit (G5: ``WHERE version = :version``, the version read with the balance)
#: and the payment row in ONE statement: a data-modifying CTE, one round trip instead of two
#: (``aupdate_versioned`` then an INSERT). No row back means the version check failed (a
#: top-up or another order moved the wallet): the caller raises ``VersionConflictError``,
#: exactly what ``aupdate_versioned`` raises, and the consumer reruns with the new balance.
#: Parameters: ``customer_id``, ``version``, ``balance_after``, ``id``, ``order_id``,
#: ``amount``, ``status``, ``event_id``. Row back: the wallet's balance and version as stored
#: (what the transaction's read-ahead keeps for the customer's next order in the batch).
DEBIT_AND_RECORD = sa.text(
    """
    WITH debited AS (
        UPDATE wallets
           SET balance = :balance_after, version = version + 1, updated_at = now()
         WHERE customer_id = :customer_id AND version = :version
        RETURNING customer_id, balance, version
    ), recorded AS (
        INSERT INTO payments (id, order_id, customer_id, amount, status, reason,
                              balance_after, event_id)
        SELECT :id, :order_id, debited.customer_id, :amount, :status, NULL, :balance_after,
               :event_id
          FROM debited
        RETURNING id
    )
    SELECT recorded.id, debited.balance, debited.version FROM recorded CROSS JOIN debited
    """
)


@dataclass
class _ReadAhead:
    """What this transaction knows: orders read (and which of them are paid), wallets read
    (customer -> (balance, version), ``None``: no wallet), kept up to date by its writes."""

    orders: set[uuid.UUID] = field(default_factory=set)
    paid: set[uuid.UUID] = field(default_factory=set)
    wallets: dict[str, tuple[Decimal, int] | None] = field(default_factory=dict)


#: ``session.info`` key of (the transaction, its :class:`_ReadAhead`).
_READ = "example_services.payments.read_ahead"


async def _read_ahead(
    session: AsyncSession, order_id: uuid.UUID, customer_id: str, batch: Sequence[EventEnvelope]
) -> _ReadAhead:
    # Kept with the transaction it belongs to: a session used for another transaction (a
    # retry after a rollback) reads again.
    read = cached(session, _READ, _ReadAhead)
    if order_id in read.orders and customer_id in read.wallets:
        return read
    order_ids, customer_ids = {order_id}, {customer_id}
    for event in batch:
        if event.event_type == "OrderPlaced":
            try:
                other = parse_payload(OrderPlacedPayload, event)
            except MalformedEventError:
                continue  # its own handler call reports it
            order_ids.add(other.order_id)
            customer_ids.add(other.customer_id)
    order_ids -= read.orders
    customer_ids -= read.wallets.keys()
    rows = (
        await session.execute(
            READ_AHEAD, {"order_ids": list(order_ids), "customer_ids": list(customer_ids)}
        )
    ).all()
    read.orders |= order_ids
    read.wallets.update(dict.fromkeys(customer_ids))
    for row in rows:
        if row.kind == "payment":
            read.paid.add(uuid.UUID(row.key))
        else:
            read.wallets[row.key] = (Decimal(row.balance), int(row.version))
    keep(session, _READ, read)
    return read


def payment_writer(payments_topic: str) -> OutboxWriter:
    """The payment service's outbox writer (payment results -> ``payments_topic``)."""
    return OutboxWriter(
        TopicRouter(
            by_event_type={"PaymentSucceeded": payments_topic, "PaymentFailed": payments_topic}
        ),
        source=SOURCE,
    )


def decide(balance: Decimal | None, amount: Decimal) -> tuple[PaymentStatus, str | None]:
    """Pure decision: pay if the wallet exists and covers ``amount``; else why not."""
    if balance is None:
        return PaymentStatus.FAILED, "no wallet"
    if balance < amount:
        return PaymentStatus.FAILED, "insufficient funds"
    return PaymentStatus.SUCCEEDED, None


async def pay_order(
    session: AsyncSession,
    event: EventEnvelope,
    writer: OutboxWriter,
    batch: Sequence[EventEnvelope] = (),
) -> PaymentStatus | None:
    """Debit the wallet for one ``OrderPlaced``, record the payment, stage its result event.

    ``batch``: the events whose handlers run in this transaction (``HandlerContext.batch``):
    the payments and wallets of all of them are read in one statement at the first call;
    later calls use what this transaction read and wrote (several orders of one customer
    debit the wallet one after another, each with the version the previous one left).

    Returns
    -------
    PaymentStatus | None
        The outcome, or ``None`` if the order already has a payment (nothing written).

    Raises
    ------
    inbox.VersionConflictError
        The wallet changed (or appeared) since it was read, before a debit or a failed
        payment: the consumer reruns with the new balance.
    MalformedEventError
        The payload is not an ``OrderPlacedPayload`` (an amount that is not a positive
        decimal with at most two places, an order id that is not a UUID, ...); raised before
        anything is read or written (example_services/_events.py).
    """
    placed = parse_payload(OrderPlacedPayload, event)
    order_id, customer_id, amount = placed.order_id, placed.customer_id, placed.amount
    read = await _read_ahead(session, order_id, customer_id, batch)
    if order_id in read.paid:
        return None
    wallet = read.wallets[customer_id]
    balance = None if wallet is None else wallet[0]
    status, reason = decide(balance, amount)
    payment_id = uuid.uuid4()
    row = {
        "id": payment_id,
        "order_id": order_id,
        "customer_id": customer_id,
        "amount": amount,
        "status": status.value,
        "event_id": event.event_id,
    }
    if status is PaymentStatus.SUCCEEDED and wallet is not None:
        version = wallet[1]
        debited = (
            await session.execute(
                DEBIT_AND_RECORD, {**row, "version": version, "balance_after": wallet[0] - amount}
            )
        ).first()
        if debited is None:
            raise VersionConflictError(wallets.name, {"customer_id": customer_id}, version)
        read.wallets[customer_id] = (Decimal(debited.balance), int(debited.version))
    else:
        known = None if wallet is None else wallet[1]
        recorded = (
            await session.execute(
                FAIL_AND_RECORD,
                {**row, "reason": reason, "balance_after": balance, "version": known},
            )
        ).first()
        if recorded is None:
            # expected_version 0: no wallet was read (a wallet's first version is 1).
            raise VersionConflictError(wallets.name, {"customer_id": customer_id}, known or 0)
    read.paid.add(order_id)
    # ``stage`` only adds the outbox row to the session (no I/O); it is inserted at the
    # commit's flush. The statements above are Core and text, which never autoflush, so the
    # rows staged by a whole batch of events go out in ONE multi-row INSERT at commit. (An
    # ORM-enabled query, ``select(SomeMappedClass)``, would flush them one by one.)
    writer.stage(
        session,
        writer.event(
            event_type="PaymentSucceeded" if status is PaymentStatus.SUCCEEDED else "PaymentFailed",
            aggregate_type="payment",
            aggregate_id=payment_id,
            aggregate_version=1,
            # Keyed by order: the order service sees the results of one order in order.
            partition_key=str(order_id),
            payload={
                "payment_id": str(payment_id),
                "order_id": str(order_id),
                "customer_id": customer_id,
                "amount": str(amount),
                "status": status.value,
                "reason": reason,
            },
            idempotency_key=idempotency_key("payment", order_id),
        ),
    )
    return status
