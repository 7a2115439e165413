"""PLANTED BUG, for the demo's self-test only: a payment consumer that skips the inbox.

``LEDGERBOX_DEMO_PLANT_BUG=skip-inbox`` makes the demo run this instead of
``example_services.payments.consumer``. It consumes ``OrderPlaced`` with plain aiokafka and
debits the wallet without an inbox row, and it ignores the payment's UNIQUE order id
(``ON CONFLICT DO NOTHING``) after having debited. Any redelivery of an ``OrderPlaced``
therefore charges the customer twice: the demo's checker must catch it
(``wallet_balance_reconciles``). Never use this as an example.

Run: ``python -m example_services.payments.unsafe_consumer`` (same environment as the
real consumer).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from decimal import Decimal

import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from example_services._config import ServiceSettings
from example_services.payments._handlers import payment_writer
from example_services.payments._models import PaymentStatus, payments, wallets
from ledgerbox.inbox import KafkaSettings, VersionConflictError, aupdate_versioned
from ledgerbox.outbox import (
    EnvelopeParseError,
    EventEnvelope,
    OutboxWriter,
    envelope_from_kafka,
    idempotency_key,
)

_log = logging.getLogger("example_services.unsafe_consumer")


async def _pay_without_inbox(
    session: AsyncSession, event: EventEnvelope, writer: OutboxWriter
) -> None:
    order_id = uuid.UUID(str(event.payload["order_id"]))
    customer_id = str(event.payload["customer_id"])
    amount = Decimal(str(event.payload["amount"]))
    wallet = (
        await session.execute(
            sa.select(wallets.c.balance, wallets.c.version).where(
                wallets.c.customer_id == customer_id
            )
        )
    ).first()
    status = PaymentStatus.FAILED
    balance_after = None if wallet is None else Decimal(wallet.balance)
    if wallet is not None and Decimal(wallet.balance) >= amount:
        balance_after = Decimal(wallet.balance) - amount
        await aupdate_versioned(
            session,
            wallets,
            {"customer_id": customer_id},
            int(wallet.version),
            {"balance": balance_after},
        )
        status = PaymentStatus.SUCCEEDED
    payment_id = uuid.uuid4()
    await session.execute(
        pg_insert(payments)
        .values(
            id=payment_id,
            order_id=order_id,
            customer_id=customer_id,
            amount=amount,
            status=status.value,
            balance_after=balance_after,
            event_id=event.event_id,
        )
        .on_conflict_do_nothing(index_elements=[payments.c.order_id])  # THE BUG (with no inbox)
    )
    await writer.astage_once(
        session,
        writer.event(
            event_type="PaymentSucceeded" if status is PaymentStatus.SUCCEEDED else "PaymentFailed",
            aggregate_type="payment",
            aggregate_id=payment_id,
            aggregate_version=1,
            partition_key=str(order_id),
            payload={
                "payment_id": str(payment_id),
                "order_id": str(order_id),
                "customer_id": customer_id,
                "amount": str(amount),
                "status": status.value,
                "reason": None,
            },
            idempotency_key=idempotency_key("payment", order_id),
        ),
    )


async def main() -> None:
    cfg = ServiceSettings()
    writer = payment_writer(cfg.payments_topic)
    engine = create_async_engine(cfg.payment_db_url())
    settings = KafkaSettings.from_env("consumer", bootstrap_servers=cfg.kafka_bootstrap_servers)
    kafka = AIOKafkaConsumer(
        cfg.orders_topic,
        **settings.client_kwargs(),
        group_id=cfg.payment_consumer_group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await kafka.start()
    try:
        while not stop.is_set():
            batch = await kafka.getmany(timeout_ms=500, max_records=200)
            for messages in batch.values():
                for message in messages:
                    try:
                        event = envelope_from_kafka(
                            message.topic, message.key, message.value, list(message.headers)
                        )
                    except EnvelopeParseError:
                        continue
                    if event.event_type != "OrderPlaced":
                        continue
                    while True:
                        try:
                            async with AsyncSession(engine) as session, session.begin():
                                await _pay_without_inbox(session, event, writer)
                            break
                        except VersionConflictError:
                            await asyncio.sleep(0.01)
            if batch:
                await kafka.commit()
    finally:
        await kafka.stop()
        await engine.dispose()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    asyncio.run(main())
