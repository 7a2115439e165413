"""The payment service's consumer: ``OrderPlaced`` -> debit, payment row, payment event.

Run: ``python -m ledgerbox.inbox run --app example_services.payments.consumer:consumer``. The module
attribute ``consumer`` is built on first access from the environment (``ServiceSettings``:
``PAYMENT_DATABASE_URL`` or ``DATABASE_URL``, ``KAFKA_BOOTSTRAP_SERVERS``, ``REDIS_URL``,
``ORDERS_TOPIC``, ``PAYMENTS_TOPIC``, ``PAYMENT_CONSUMER_GROUP``).
"""

from __future__ import annotations

from typing import Any

from example_services._config import ServiceSettings
from example_services._events import MalformedEventError
from example_services.payments._handlers import pay_order, payment_writer
from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer, KafkaSettings
from ledgerbox.outbox import EventEnvelope

__all__ = ["create_consumer"]


def create_consumer(settings: ServiceSettings | None = None) -> InboxConsumer:
    """The payment service's :class:`inbox.InboxConsumer` (group ``payment-service``)."""
    cfg = settings or ServiceSettings()
    writer = payment_writer(cfg.payments_topic)
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=cfg.payment_consumer_group,
            topics=[cfg.orders_topic],
            database_url=cfg.payment_db_url(),
            # TLS / SASL from the KAFKA_* variables (docs/security.md); PLAINTEXT without them.
            kafka=KafkaSettings.from_env("consumer", bootstrap_servers=cfg.kafka_bootstrap_servers),
            redis_url=cfg.redis_url,
            # The inbox's aggregate lock is keyed by the event's aggregate (the order), but the
            # contended row is the customer's wallet: its version guards it, and the lock's
            # Redis round trips cost ~25% throughput here for no benefit (measured in the demo).
            lock_aggregates=False,
            # The wallet is a hot aggregate: orders of one customer on other partitions race
            # on its version; each conflict is a rerun, so allow many before dead-lettering.
            max_attempts=30,
            retry_max_s=0.5,
            # A payload that does not fit its contract cannot be fixed by a retry:
            # dead-lettered on the first attempt, nothing written (example_services/_events.py).
            dead_letter_on=(MalformedEventError,),
        )
    )

    @consumer.handler("OrderPlaced")
    async def on_order_placed(ctx: HandlerContext[Any], event: EventEnvelope) -> None:
        await pay_order(ctx.session, event, writer, ctx.batch)

    return consumer


def __getattr__(name: str) -> Any:
    if name == "consumer":
        built = create_consumer()
        globals()["consumer"] = built
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
