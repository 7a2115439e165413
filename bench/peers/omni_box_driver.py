"""Drain benchmark driver for ``omni-box`` (runs in its own virtual environment, Python >= 3.12).

Backlog: ``OmniBoxDomainService.create_outbox_event`` + ``PostgresOutboxRepository.bulk_create``
(the library's own write API: multi-row ``INSERT ... ON CONFLICT DO NOTHING RETURNING``),
one transaction per ``--insert-batch`` events, ``partition_key = k{i % 1000}``.
Relay: ``--workers`` publisher loops, each the documented cycle: open a session and a
transaction, ``OutboxPublisher(repo, KafkaEventPublisher(...)).publish_batch(batch_size=100)``,
commit; sleep only when a cycle found nothing. One shared ``AIOKafkaProducer`` with
``enable_idempotence=True, acks="all"`` (what the publisher's docstring asks for).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from importlib.metadata import version
from typing import Any

import structlog
from _driver import arguments, note, timed_drain, watch_logs, write_result
from _workload import EVENT_TYPE, key_of, payload_of
from aiokafka import AIOKafkaProducer
from omni_box import OmniBoxDomainService, OutboxPublisher
from omni_box.core.converters.event import RawEventConverter
from omni_box.infra.brokers.kafka import KafkaEventPublisher
from omni_box.infra.storage.postgres import PostgresOutboxRepository
from omni_box.infra.storage.postgres.orm import OutboxEventDBBase
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase

IDLE_SLEEP_S = 0.1


def _record_warnings(logger: object, method: str, event: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: count omni-box's warnings and errors as disturbances."""
    if method in ("warning", "error", "exception", "critical"):
        note(f"omni_box {method}: {event.get('event')} {event.get('error', '')}")
    return event


class Base(DeclarativeBase):
    pass


class OutboxEventDB(OutboxEventDBBase, Base):
    pass


async def main() -> None:
    args = arguments(__doc__ or "")
    # structlog prints every level by default; an application logs at INFO.
    watch_logs()
    structlog.configure(
        processors=[_record_warnings, *structlog.get_config()["processors"]],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
    engine = create_async_engine(args.db_url, pool_size=args.workers + 4, max_overflow=4)
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    domain = OmniBoxDomainService()

    # Backlog, before the clock starts.
    t0 = time.perf_counter()
    for lo in range(0, args.events, args.insert_batch):
        batch = [
            domain.create_outbox_event(
                aggregate_type="order",
                aggregate_id=uuid.uuid4(),
                event_type=EVENT_TYPE,
                topic=args.topic,
                partition_key=key_of(i),
                payload=payload_of(i),
            )
            for i in range(lo, min(lo + args.insert_batch, args.events))
        ]
        async with sessions() as session, session.begin():
            repo = PostgresOutboxRepository(session, model_class=OutboxEventDB)
            await repo.bulk_create(batch)
    backlog_s = time.perf_counter() - t0
    table = OutboxEventDB.__table__
    async with engine.connect() as conn:
        rows = (await conn.execute(select(func.count()).select_from(table))).scalar_one()
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text(f"VACUUM ANALYZE {table.name}"))
    assert rows == args.events, (rows, args.events)

    producer = AIOKafkaProducer(
        bootstrap_servers=args.bootstrap, enable_idempotence=True, acks="all"
    )
    await producer.start()
    broker = KafkaEventPublisher(producer=producer, converter=RawEventConverter())
    stop = asyncio.Event()
    errors: list[str] = []

    async def worker(n: int) -> None:
        while not stop.is_set():
            try:
                async with sessions() as session, session.begin():
                    repo = PostgresOutboxRepository(session, model_class=OutboxEventDB)
                    result = await OutboxPublisher(repo, broker).publish_batch(
                        worker_id=f"bench-{n}", batch_size=args.batch
                    )
            except Exception as exc:  # keep going like a supervised worker; report it
                errors.append(f"worker {n}: {type(exc).__name__}: {exc}"[:500])
                note(errors[-1])
                await asyncio.sleep(1.0)
                continue
            if not result.processed_event_ids:
                await asyncio.sleep(IDLE_SLEEP_S)

    tasks: list[asyncio.Task[None]] = []

    async def start() -> None:
        tasks.extend(asyncio.create_task(worker(n)) for n in range(args.workers))

    try:
        drain = await timed_drain(args.bootstrap, args.topic, args.events, args.timeout, start)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
        await producer.stop()
    async with engine.connect() as conn:
        left = (
            await conn.execute(
                select(func.count()).select_from(table).where(table.c.status != "completed")
            )
        ).scalar_one()
    await engine.dispose()
    write_result(
        args.result,
        {
            "peer": "omni-box",
            "versions": {p: version(p) for p in ("omni-box", "aiokafka", "sqlalchemy", "asyncpg")},
            "python": sys.version.split()[0],
            "config": {
                "publisher_loops": args.workers,
                "batch_size": args.batch,
                "converter": "RawEventConverter",
                "kafka": "AIOKafkaProducer(enable_idempotence=True, acks='all')",
            },
            "backlog": (
                "OmniBoxDomainService.create_outbox_event + PostgresOutboxRepository.bulk_create, "
                f"{args.insert_batch} events per transaction"
            ),
            "backlog_s": backlog_s,
            "rows_left": left,
            "worker_errors": errors[:20],
            **drain,
        },
    )


if __name__ == "__main__":
    asyncio.run(main())
