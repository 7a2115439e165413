"""The consumer side of the end-to-end latency benchmark (run by ``python -m inbox run``).

Its handler stamps ``clock_timestamp()`` (the machine's clock, read by PostgreSQL on the same
host) as the last statement of the inbox transaction, just before the runner commits it.
"""

from __future__ import annotations

import os

import sqlalchemy as sa

from inbox import ConsumerConfig, HandlerContext, InboxConsumer
from outbox import EventEnvelope

_APPLIED = sa.text("INSERT INTO e2e_applied (event_id, applied_at) VALUES (:id, clock_timestamp())")


def make_consumer() -> InboxConsumer:
    """Build the consumer from ``E2E_DATABASE_URL``, ``E2E_TOPIC``, ``E2E_GROUP``."""
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=os.environ["E2E_GROUP"],
            topics=[os.environ["E2E_TOPIC"]],
            database_url=os.environ["E2E_DATABASE_URL"],
            kafka_bootstrap_servers=os.environ["KAFKA_BOOTSTRAP_SERVERS"],
            redis_url=os.environ.get("REDIS_URL"),
        )
    )

    @consumer.handler("E2EPing")
    async def applied(ctx: HandlerContext, event: EventEnvelope) -> None:
        await ctx.session.execute(_APPLIED, {"id": event.event_id})  # type: ignore[misc]

    return consumer
