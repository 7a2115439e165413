"""The consumer side of the end-to-end latency benchmark (run by ``python -m ledgerbox.inbox run``).

Its handler writes, in the inbox transaction, the record's broker append time (the topic uses
``LogAppendTime``), the time the handler started, and ``clock_timestamp()`` as the last
statement before the runner commits. All three come from this machine's clock.
"""

from __future__ import annotations

import os
import time

import sqlalchemy as sa

from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer
from ledgerbox.outbox import EventEnvelope

_APPLIED = sa.text(
    "INSERT INTO e2e_applied (event_id, appended_at, handled_at, applied_at)"
    " VALUES (:id, to_timestamp(:appended), to_timestamp(:handled), clock_timestamp())"
)


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
    async def applied(ctx: HandlerContext, event: EventEnvelope) -> None:  # type: ignore[type-arg]
        handled = time.time()
        appended = None if ctx.timestamp_ms is None else ctx.timestamp_ms / 1000
        await ctx.session.execute(
            _APPLIED, {"id": event.event_id, "appended": appended, "handled": handled}
        )

    return consumer
