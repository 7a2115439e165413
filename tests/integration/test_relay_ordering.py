"""End to end: 50 keys x 200 events from 8 concurrent producers, two relay processes, one
consumer. For every key the first occurrences on Kafka are exactly the commit order."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from tests import _relay_support as rs
from tests._services import TopicFactory

KEYS = 50
PER_KEY = 200
PRODUCERS = 8


def _produce(
    database_url: str, topic: str, seed: int, quota: list[int], lock: threading.Lock
) -> None:
    engine = create_engine(database_url, pool_size=2)
    writer = rs.writer_for(topic)
    rng = random.Random(seed)
    try:
        while True:
            with lock:
                open_keys = [k for k in range(KEYS) if quota[k] > 0]
                if not open_keys:
                    return
                key = rng.choice(open_keys)
                quota[key] -= 1
            with Session(engine) as session, session.begin():
                # The row lock serializes the producers of one key: commit order = seq order.
                seq = session.execute(
                    text("UPDATE e2e_seq SET seq = seq + 1 WHERE key = :k RETURNING seq"),
                    {"k": f"key-{key}"},
                ).scalar_one()
                writer.stage(session, rs.event(writer, f"key-{key}", seq))
    finally:
        engine.dispose()


@pytest.mark.slow
async def test_fifty_keys_eight_producers_two_relays_commit_order(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("e2e-order", partitions=6)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE e2e_seq (key text PRIMARY KEY, seq int NOT NULL)"))
        conn.execute(
            text("INSERT INTO e2e_seq SELECT 'key-' || g, 0 FROM generate_series(0, :n - 1) g"),
            {"n": KEYS},
        )
    relays = [
        rs.relay_process(database_url, kafka_bootstrap, "--relay-id", f"e2e-{i}") for i in (1, 2)
    ]
    try:
        quota = [PER_KEY] * KEYS
        lock = threading.Lock()
        await asyncio.gather(
            *(
                asyncio.to_thread(_produce, database_url, topic, seed, quota, lock)
                for seed in range(PRODUCERS)
            )
        )
        total = KEYS * PER_KEY
        records = await rs.consume(
            kafka_bootstrap,
            topic,
            until=lambda r: len({rs.header(x, "ce_id") for x in r}) >= total,
            within_s=180,
        )
    finally:
        codes = [rs.stop_process(p) for p in relays]
    assert codes == [0, 0]
    by_key: dict[bytes, list[int]] = {}
    for r in records:
        by_key.setdefault(r.key or b"", []).append(json.loads(r.value or b"")["seq"])
    assert len(by_key) == KEYS
    for key, seqs in by_key.items():
        assert list(dict.fromkeys(seqs)) == list(range(1, PER_KEY + 1)), key
    print(f"e2e: {total} events, {len(records)} records, {len(records) - total} duplicates")
