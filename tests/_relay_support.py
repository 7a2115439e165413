"""Helpers shared by the relay's integration and fault tests (not a test module)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from ledgerbox.outbox import EventEnvelope, OutboxWriter, TopicRouter
from ledgerbox.relay import RelayConfig
from ledgerbox.relay._store import ClaimedEvent, RelayStats, RelayStore

REPO_ROOT = Path(__file__).resolve().parent.parent


class DelegatingStore:
    """A :class:`RelayStore` that hands every call to ``inner`` (a real store): tests
    subclass it and override the one method whose fault they inject."""

    def __init__(self, inner: RelayStore) -> None:
        self.inner = inner

    async def ensure_leases(self, shard_count: int) -> None:
        await self.inner.ensure_leases(shard_count)

    async def heartbeat(self, ttl_s: float) -> int:
        return await self.inner.heartbeat(ttl_s)

    async def renew_shards(
        self, held: Sequence[tuple[int, int]], ttl_s: float
    ) -> list[tuple[int, int]]:
        return await self.inner.renew_shards(held, ttl_s)

    async def acquire_shards(
        self, want: int, ttl_s: float, *, lo: int, hi: int
    ) -> list[tuple[int, int]]:
        return await self.inner.acquire_shards(want, ttl_s, lo=lo, hi=hi)

    async def release_shards(self, held: Sequence[tuple[int, int]]) -> int:
        return await self.inner.release_shards(held)

    async def leave(self) -> None:
        await self.inner.leave()

    async def claim_batch(
        self, shards: Sequence[int], limit: int, *, hold: bool, exclude: Sequence[int] = ()
    ) -> list[ClaimedEvent]:
        return await self.inner.claim_batch(shards, limit, hold=hold, exclude=exclude)

    async def mark_published(self, ids: Sequence[int], fences: Sequence[tuple[int, int]]) -> int:
        return await self.inner.mark_published(ids, fences)

    async def mark_dead_lettered(self, event_id: int, shard_fence: int, error: str) -> int:
        return await self.inner.mark_dead_lettered(event_id, shard_fence, error)

    async def cleanup_published(self, retention_s: float, limit: int) -> int:
        return await self.inner.cleanup_published(retention_s, limit)

    async def cleanup_members(self) -> int:
        return await self.inner.cleanup_members()

    async def stats(self, shard_count: int) -> RelayStats:
        return await self.inner.stats(shard_count)

    async def ping(self) -> None:
        await self.inner.ping()

    async def notifications(self) -> AsyncIterator[None]:
        async for item in self.inner.notifications():
            yield item

    async def aclose(self) -> None:
        await self.inner.aclose()


def writer_for(topic: str, source: str = "/relay-tests") -> OutboxWriter:
    return OutboxWriter(TopicRouter(default=topic), source=source)


def event(
    writer: OutboxWriter,
    key: str,
    seq: int,
    *,
    payload: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> EventEnvelope:
    return writer.event(
        event_type="Tested",
        aggregate_type="thing",
        aggregate_id=key,
        aggregate_version=seq,
        payload=payload if payload is not None else {"key": key, "seq": seq},
        idempotency_key=f"{key}:{seq}:{uuid.uuid4().hex}",
        headers=headers,
    )


def stage(engine: Engine, writer: OutboxWriter, events: Iterable[EventEnvelope]) -> None:
    """Stage events in ONE committed transaction (sync Session, as users do)."""
    with Session(engine) as session, session.begin():
        for ev in events:
            writer.stage(session, ev)


def config(database_url: str, kafka: str, **overrides: Any) -> RelayConfig:
    values: dict[str, Any] = {
        "database_url": database_url,
        "kafka_bootstrap_servers": kafka,
        "lease_ttl_s": 3.0,
        "heartbeat_interval_s": 0.5,
        "compression": "lz4",
    }
    values.update(overrides)
    return RelayConfig(**values)


def pending_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM outbox WHERE status = 0")).scalar_one())


def reset_relay_tables(engine: Engine) -> None:
    """Forget leases and members left by earlier tests of the module (same database)."""
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox_relay_lease SET owner = NULL, expires_at = NULL"))
        conn.execute(text("DELETE FROM outbox_relay_member"))


async def consume(
    bootstrap: str,
    topic: str,
    *,
    until: Callable[[list[ConsumerRecord[bytes, bytes]]], bool],
    within_s: float = 60.0,
) -> list[ConsumerRecord[bytes, bytes]]:
    """Read the topic from the beginning (no group) until ``until(records)`` or the deadline."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    records: list[ConsumerRecord[bytes, bytes]] = []
    try:
        partitions = None
        deadline = time.monotonic() + within_s
        while partitions is None:
            partitions = consumer.partitions_for_topic(topic)
            if partitions is None:
                await consumer._client.force_metadata_update()
                partitions = consumer.partitions_for_topic(topic)
            if partitions is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"topic {topic} has no metadata")
                await asyncio.sleep(0.2)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while not until(records):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(records)} records read from {topic}, condition not met")
            batch = await consumer.getmany(timeout_ms=500)
            for recs in batch.values():
                records.extend(recs)
    finally:
        await consumer.stop()
    return records


def relay_process(
    database_url: str,
    kafka: str,
    *args: str,
    env: dict[str, str] | None = None,
    hooks: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    """Start ``python -m ledgerbox.relay run`` (the real CLI) in a subprocess.

    ``hooks``: options of the TEST-ONLY entry point ``tests.relay_entry`` (e.g.
    ``("--mark-delay-ms", "10000")``); given, the relay CLI runs through it with those
    :class:`ledgerbox.relay.RelayHooks`.
    """
    entry = ["tests.relay_entry", *hooks, "--"] if hooks else ["ledgerbox.relay"]
    full_env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "KAFKA_BOOTSTRAP_SERVERS": kafka,
        "LEDGERBOX_RELAY_LEASE_TTL_S": "3",
        "LEDGERBOX_RELAY_HEARTBEAT_INTERVAL_S": "0.5",
        "LEDGERBOX_RELAY_POLL_INTERVAL_S": "0.2",
        **(env or {}),
    }
    return subprocess.Popen(
        [sys.executable, "-m", *entry, "run", *args],
        cwd=REPO_ROOT,
        env=full_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def stop_process(proc: subprocess.Popen[bytes], *, kill: bool = False) -> int:
    if proc.poll() is None:
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


def header(record: ConsumerRecord[bytes, bytes], name: str) -> str:
    for key, value in record.headers:
        if key == name:
            return bytes(value).decode()
    raise KeyError(name)
