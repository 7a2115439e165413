"""The payment service's reaction to ``OrderPlaced`` (runs inside the inbox transaction).

The wallet is the hot aggregate: many orders of one customer, on different partitions, race on
one row. The debit is an optimistic ``UPDATE ... WHERE version = :read`` (G5); the loser gets
``inbox.VersionConflictError`` and the consumer reruns it with the new balance. The payment
row and the ``PaymentSucceeded`` / ``PaymentFailed`` event commit with the inbox row (G1, G4).
"""

from __future__ import annotations

import uuid
from decimal import Decimal

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from example_services.payments._models import PaymentStatus, payments, wallets
from ledgerbox.inbox import aupdate_versioned
from ledgerbox.outbox import EventEnvelope, OutboxWriter, TopicRouter, idempotency_key

__all__ = ["SOURCE", "decide", "pay_order", "payment_writer"]

SOURCE = "/payment-service"


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
    session: AsyncSession, event: EventEnvelope, writer: OutboxWriter
) -> PaymentStatus | None:
    """Debit the wallet for one ``OrderPlaced``, record the payment, stage its result event.

    Returns
    -------
    PaymentStatus | None
        The outcome, or ``None`` if the order already has a payment (nothing written).

    Raises
    ------
    inbox.VersionConflictError
        The wallet changed since it was read: the consumer reruns with the new balance.
    """
    order_id = uuid.UUID(str(event.payload["order_id"]))
    customer_id = str(event.payload["customer_id"])
    amount = Decimal(str(event.payload["amount"]))
    already = (
        await session.execute(sa.select(payments.c.id).where(payments.c.order_id == order_id))
    ).first()
    if already is not None:
        return None
    wallet = (
        await session.execute(
            sa.select(wallets.c.balance, wallets.c.version).where(
                wallets.c.customer_id == customer_id
            )
        )
    ).first()
    balance = None if wallet is None else Decimal(wallet.balance)
    status, reason = decide(balance, amount)
    balance_after = balance
    if status is PaymentStatus.SUCCEEDED and wallet is not None and balance is not None:
        balance_after = balance - amount
        await aupdate_versioned(
            session,
            wallets,
            {"customer_id": customer_id},
            int(wallet.version),
            {"balance": balance_after, "updated_at": sa.func.now()},
        )
    payment_id = uuid.uuid4()
    await session.execute(
        sa.insert(payments).values(
            id=payment_id,
            order_id=order_id,
            customer_id=customer_id,
            amount=amount,
            status=status.value,
            reason=reason,
            balance_after=balance_after,
            event_id=event.event_id,
        )
    )
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
