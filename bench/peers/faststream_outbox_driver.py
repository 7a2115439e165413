"""Drain benchmark driver for ``faststream-outbox`` (runs in its own virtual environment).

Backlog: ``OutboxBroker.publish_batch`` (the library's own write API: one multi-row INSERT
per call, plus one NOTIFY) in transactions of ``--insert-batch`` events.
Relay: the documented Kafka relay, a ``KafkaBroker`` publisher stacked on an outbox
subscriber (``max_workers=--workers``, ``fetch_batch_size=--batch``); the handler returns a
``KafkaResponse`` carrying the event's key, so Kafka partitions by key like the other peers.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from importlib.metadata import version

from _driver import arguments, timed_drain, watch_logs, write_result
from _workload import key_of, payload_of
from faststream.kafka import KafkaBroker, KafkaResponse
from faststream_outbox import OutboxBroker, make_outbox_table
from sqlalchemy import MetaData, func, select, text
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

QUEUE = "bench_outbox"


async def main() -> None:
    args = arguments(__doc__ or "")
    # FastStream logs every message it handles at INFO ("Received"/"Processed"); demote those
    # access logs to DEBUG (not shown), as a throughput deployment would.
    watch_logs()
    metadata = MetaData()
    table = make_outbox_table(metadata, table_name="outbox")
    pool = args.workers + 4
    engine = create_async_engine(args.db_url, pool_size=pool, max_overflow=4)
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    broker_outbox = OutboxBroker(engine, outbox_table=table, log_level=logging.DEBUG)
    broker_kafka = KafkaBroker(
        args.bootstrap, acks="all", enable_idempotence=True, log_level=logging.DEBUG
    )
    publisher_kafka = broker_kafka.publisher(args.topic)

    @publisher_kafka
    @broker_outbox.subscriber(
        QUEUE,
        max_workers=args.workers,
        fetch_batch_size=args.batch,
        terminal_flush_batch_size=args.flush_batch,
    )
    async def relay(body: dict) -> KafkaResponse:  # type: ignore[type-arg]
        return KafkaResponse(body, key=str(body["key"]).encode())

    # Backlog, before the clock starts.
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    t0 = time.perf_counter()
    for lo in range(0, args.events, args.insert_batch):
        bodies = [payload_of(i) for i in range(lo, min(lo + args.insert_batch, args.events))]
        async with sessions() as session, session.begin():
            await broker_outbox.publish_batch(*bodies, queue=QUEUE, session=session)
    backlog_s = time.perf_counter() - t0
    async with engine.connect() as conn:
        rows = (await conn.execute(select(func.count()).select_from(table))).scalar_one()
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("VACUUM ANALYZE outbox"))
    assert rows == args.events, (rows, args.events)
    assert key_of(1) == payload_of(1)["key"]

    await broker_kafka.connect()

    async def start() -> None:
        await broker_outbox.start()

    try:
        drain = await timed_drain(args.bootstrap, args.topic, args.events, args.timeout, start)
    finally:
        await asyncio.wait_for(broker_outbox.stop(), 60)
        await asyncio.wait_for(broker_kafka.stop(), 60)
    async with engine.connect() as conn:
        left = (await conn.execute(select(func.count()).select_from(table))).scalar_one()
    await engine.dispose()
    write_result(
        args.result,
        {
            "peer": "faststream-outbox",
            "versions": {
                p: version(p)
                for p in ("faststream-outbox", "faststream", "aiokafka", "sqlalchemy", "asyncpg")
            },
            "python": sys.version.split()[0],
            "config": {
                "max_workers": args.workers,
                "fetch_batch_size": args.batch,
                "terminal_flush_batch_size": args.flush_batch,
                "kafka": "KafkaBroker(acks='all', enable_idempotence=True), otherwise defaults",
            },
            "backlog": f"OutboxBroker.publish_batch, {args.insert_batch} events per transaction",
            "backlog_s": backlog_s,
            "rows_left": left,
            **drain,
        },
    )


if __name__ == "__main__":
    asyncio.run(main())
