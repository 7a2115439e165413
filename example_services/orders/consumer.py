"""The order service's consumer: payment results -> order status.

Run: ``python -m ledgerbox.inbox run --app example_services.orders.consumer:consumer``. The module
attribute ``consumer`` is built on first access from the environment (``ServiceSettings``:
``ORDER_DATABASE_URL`` or ``DATABASE_URL``, ``KAFKA_BOOTSTRAP_SERVERS`` and the Kafka security
variables of docs/security.md, ``REDIS_URL``,
``PAYMENTS_TOPIC``, ``ORDER_CONSUMER_GROUP``), so importing this module needs no environment.
"""

from __future__ import annotations

from typing import Any

from example_services._config import ServiceSettings
from example_services._events import MalformedEventError
from example_services.orders._handlers import PAYMENT_RESULTS, apply_payment_result
from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer, KafkaSettings
from ledgerbox.outbox import EventEnvelope

__all__ = ["create_consumer"]


def create_consumer(settings: ServiceSettings | None = None) -> InboxConsumer:
    """The order service's :class:`inbox.InboxConsumer` (group ``order-service``)."""
    cfg = settings or ServiceSettings()
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=cfg.order_consumer_group,
            topics=[cfg.payments_topic],
            database_url=cfg.order_db_url(),
            # TLS / SASL from the KAFKA_* variables (docs/security.md); PLAINTEXT without them.
            kafka=KafkaSettings.from_env("consumer", bootstrap_servers=cfg.kafka_bootstrap_servers),
            redis_url=cfg.redis_url,
            # A payment result races nothing but a contradictory result for the same order;
            # the order's version settles that, no lock needed.
            lock_aggregates=False,
            max_attempts=20,
            retry_max_s=1.0,
            # A payload that does not fit its contract cannot be fixed by a retry:
            # dead-lettered on the first attempt, nothing written (example_services/_events.py).
            dead_letter_on=(MalformedEventError,),
        )
    )

    async def on_payment_result(ctx: HandlerContext[Any], event: EventEnvelope) -> None:
        await apply_payment_result(ctx.session, event, ctx.batch)

    for event_type in PAYMENT_RESULTS:
        consumer.register(event_type, on_payment_result)
    return consumer


def __getattr__(name: str) -> Any:
    if name == "consumer":
        built = create_consumer()
        globals()["consumer"] = built
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
