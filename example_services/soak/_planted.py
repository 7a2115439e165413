"""PLANTED BUG ``ack-before-commit``, for the soak's self-test only: never use it as an example.

``LEDGERBOX_SOAK_PLANT_BUG=ack-before-commit`` makes the soak run this instead of the payment
consumers. It commits the Kafka offsets of a fetched batch BEFORE it writes the effects, then
pays each order in its own transaction (the real handler, so a redelivery still pays once).
When that transaction fails (PostgreSQL restarting, a connection reset, a backend killed) or
the process is killed mid-batch, the record is already acknowledged and never comes back: the
order stays PENDING forever. The soak must fail on ``no_event_lost`` (and ``orders_final``,
``liveness_after_faults``).

Run: ``python -m example_services.soak._planted`` (the payment consumer's environment).
"""

from __future__ import annotations

import asyncio
import logging
import signal

from aiokafka import AIOKafkaConsumer
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from example_services._config import ServiceSettings
from example_services.payments._handlers import pay_order, payment_writer
from ledgerbox.inbox import VersionConflictError
from ledgerbox.outbox import EnvelopeParseError, envelope_from_kafka

_log = logging.getLogger("example_services.soak.planted")


async def main() -> None:
    cfg = ServiceSettings()
    writer = payment_writer(cfg.payments_topic)
    engine = create_async_engine(cfg.payment_db_url(), pool_pre_ping=True)
    kafka = AIOKafkaConsumer(
        cfg.orders_topic,
        bootstrap_servers=cfg.kafka_bootstrap_servers,
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
            if not batch:
                continue
            try:
                await kafka.commit()  # THE BUG: acknowledged before the effects are committed
            except Exception as exc:  # a failed commit is retried by the next batch
                _log.warning("offset commit failed: %r", exc)
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
                    for _ in range(50):
                        try:
                            async with AsyncSession(engine) as session, session.begin():
                                await pay_order(session, event, writer)
                            break
                        except VersionConflictError:
                            await asyncio.sleep(0.01)
                        except Exception as exc:  # the record is already acked: it is lost
                            _log.error("dropping %s: %r", event.event_id, exc)
                            break
    finally:
        await kafka.stop()
        await engine.dispose()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    asyncio.run(main())
