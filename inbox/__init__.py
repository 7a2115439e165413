"""ledgerbox ``inbox``: apply each Kafka event's effect at most once per consumer group.

Example
-------
>>> consumer = InboxConsumer(ConsumerConfig(                     # doctest: +SKIP
...     group_id="payment-service", topics=["orders.events"],
...     database_url="postgresql+psycopg://...", kafka_bootstrap_servers="127.0.0.1:9092",
...     redis_url="redis://127.0.0.1:6379/0"))
>>> @consumer.handler("OrderPlaced")                            # doctest: +SKIP
... async def on_order_placed(ctx: HandlerContext, event: EventEnvelope) -> None:
...     row = (await ctx.session.execute(select(account).where(...))).one()
...     await aupdate_versioned(ctx.session, account, {"id": row.id}, row.version, {...})
>>> await consumer.run()                                        # doctest: +SKIP

Against a secured cluster, give ``ConsumerConfig(kafka=KafkaSettings.from_env("consumer"),
...)``: the ``KAFKA_*`` variables of docs/security.md (TLS, SASL, secrets from files).

The handler's writes commit in one transaction with the event's inbox row: a redelivered
event finds the row and is acknowledged without running the handler (G4). Redis only speeds
this up (G6). The guarantees: ``docs/guarantees.md``.
"""

if __name__ != "ledgerbox.inbox":  # the repository folder is importable from its root too
    raise ImportError(f"import ledgerbox.inbox, not {__name__} (one import package: ledgerbox)")


from ledgerbox._core.kafka import KafkaSettings
from ledgerbox._core.redaction import Secret
from ledgerbox.inbox._config import ConsumerConfig
from ledgerbox.inbox._consumer import InboxConsumer
from ledgerbox.inbox._context import HandlerContext
from ledgerbox.inbox._errors import (
    FencedWriteError,
    InboxError,
    LockBusyError,
    RedisUnavailableError,
    StartupError,
    UnhandledEventError,
    VersionConflictError,
)
from ledgerbox.inbox._policy import Outcome
from ledgerbox.inbox._redis import AggregateLock, DedupStore, RedisAggregateLock, RedisDedupStore
from ledgerbox.inbox._table import InboxStatus, InboxTable
from ledgerbox.inbox._versioned import (
    afenced_update,
    aupdate_versioned,
    fenced_update,
    update_versioned,
)

__all__ = [
    "AggregateLock",
    "ConsumerConfig",
    "DedupStore",
    "FencedWriteError",
    "HandlerContext",
    "InboxConsumer",
    "InboxError",
    "InboxStatus",
    "InboxTable",
    "KafkaSettings",
    "LockBusyError",
    "Outcome",
    "RedisAggregateLock",
    "RedisDedupStore",
    "RedisUnavailableError",
    "Secret",
    "StartupError",
    "UnhandledEventError",
    "VersionConflictError",
    "afenced_update",
    "aupdate_versioned",
    "fenced_update",
    "update_versioned",
]
