"""Helpers shared by the peer drivers (run with a peer's interpreter; needs ``aiokafka``).

A driver fills its peer's outbox with the backlog, then calls :func:`timed_drain`, which
starts the peer's relay workers and polls the topic's end offsets until every event is on
Kafka or the time limit passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

POLL_S = 0.1
#: Loggers whose warnings mean the run was disturbed (a broker or database outage: the
#: services are shared, and other people's tests stop and start them).
WATCHED = ("aiokafka", "kafka", "asyncpg", "sqlalchemy", "faststream", "omni_box")

#: Warnings and errors logged during the timed drain (see :func:`watch_logs`).
disturbances: list[str] = []
_recording = False


class _Recorder(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if _recording and record.name.split(".")[0] in WATCHED:
            note(f"{record.name}: {record.getMessage()}")


def note(message: str) -> None:
    """Record a disturbance while the drain is timed (distinct messages, 20 at most)."""
    message = message[:300]
    if _recording and len(disturbances) < 20 and message not in disturbances:
        disturbances.append(message)


def watch_logs() -> None:
    """Record WARNING+ log records of the watched loggers while the drain is timed."""
    logging.basicConfig(level=logging.WARNING)
    handler = _Recorder(level=logging.WARNING)
    logging.getLogger().addHandler(handler)
    # FastStream's own loggers do not propagate to the root logger.
    for name in ("faststream", "faststream.access.outbox", "faststream.access.kafka"):
        logging.getLogger(name).addHandler(handler)


def arguments(description: str) -> argparse.Namespace:
    """The command line every driver takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--db-url", required=True, help="SQLAlchemy URL, postgresql+asyncpg://")
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True, help="drain time limit, s")
    parser.add_argument("--result", required=True, help="where to write the result JSON")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--insert-batch", type=int, default=1_000)
    parser.add_argument("--flush-batch", type=int, default=1)
    return parser.parse_args()


async def end_offsets_total(consumer: AIOKafkaConsumer, partitions: list[TopicPartition]) -> int:
    """The sum of the topic's end offsets (records written, duplicates included)."""
    offsets = await consumer.end_offsets(partitions)
    return sum(offsets.values())


async def timed_drain(
    bootstrap: str,
    topic: str,
    events: int,
    timeout_s: float,
    start: Callable[[], Awaitable[None]],
) -> dict[str, Any]:
    """Call ``start()`` (launches the relay workers), then wait until ``events`` records are
    on ``topic`` or ``timeout_s`` passes; the clock runs from just before ``start()``.
    """
    global _recording
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        parts = consumer.partitions_for_topic(topic)
        if not parts:
            await consumer._client.force_metadata_update()  # a topic made just before
            parts = consumer.partitions_for_topic(topic) or set()
        partitions = [TopicPartition(topic, p) for p in sorted(parts)]
        before = await end_offsets_total(consumer, partitions)
        if before:
            raise RuntimeError(f"topic {topic} is not empty ({before} records)")
        disturbances.clear()
        _recording = True
        cpu0 = _cpu_s()
        t0 = time.perf_counter()
        await start()
        started_s = time.perf_counter() - t0
        published = 0
        progress: list[tuple[float, int]] = []
        while True:
            published = await end_offsets_total(consumer, partitions)
            elapsed = time.perf_counter() - t0
            if not progress or elapsed - progress[-1][0] >= 10.0:
                progress.append((round(elapsed, 1), published))
            if published >= events or elapsed >= timeout_s:
                break
            await asyncio.sleep(POLL_S)
        elapsed = time.perf_counter() - t0
        cpu = _cpu_s() - cpu0
        _recording = False
        progress.append((round(elapsed, 3), published))
        completed = published >= events
        return {
            "completed": completed,
            "drain_s": elapsed,
            "start_call_s": started_s,
            "published": published,
            "events_per_s": (events if completed else published) / elapsed,
            "progress": progress,
            # CPU time of this process (the peer's relay, plus the offset polling) while timed
            "relay_cpu_s": cpu,
            "relay_cpu_ms_per_event": 1000 * cpu / max(1, min(published, events)),
            "disturbances": list(disturbances),
        }
    finally:
        _recording = False
        await consumer.stop()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write the driver's result for the parent process."""
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
