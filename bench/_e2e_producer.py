"""The producer side of the end-to-end latency benchmark.

``python -m bench._e2e_producer URL TOPIC RATE DURATION_S OUT``: commits one event per
transaction at RATE events/s for DURATION_S seconds (Core ``Connection`` + ``OutboxWriter``)
and writes ``[[event_id, commit_epoch_s], ...]`` to OUT, each time read right after COMMIT.
"""

from __future__ import annotations

import json
import sys
import time
import uuid

import sqlalchemy as sa

from ledgerbox.outbox import OutboxWriter, TopicRouter


def main(url: str, topic: str, rate: float, duration_s: float, out: str) -> None:
    engine = sa.create_engine(url, pool_size=1)
    writer = OutboxWriter(TopicRouter(default=topic), source="/bench-e2e")
    committed: list[tuple[str, float]] = []
    total = int(rate * duration_s)
    start = time.perf_counter()
    with engine.connect() as conn:
        for i in range(total):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            event_id = uuid.uuid4()
            event = writer.event(
                event_type="E2EPing",
                aggregate_type="ping",
                aggregate_id=f"k{i % 100}",
                payload={"i": i, "pad": "x" * 200},
                idempotency_key=f"e2e:{event_id}",
                event_id=event_id,
            )
            with conn.begin():
                writer.stage(conn, event)
            committed.append((str(event_id), time.time()))
    engine.dispose()
    with open(out, "w") as f:
        json.dump(committed, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
