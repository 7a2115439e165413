"""Helpers shared by the relay's integration and fault tests (not a test module)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import psycopg
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import MessageSizeTooLargeError
from psycopg import sql
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from ledgerbox.outbox import EventEnvelope, OutboxWriter, TopicRouter
from ledgerbox.relay import KafkaPublisher, OutboundRecord, PublishError, RelayConfig
from ledgerbox.relay._pgstore import PENDING_COUNT
from ledgerbox.relay._store import (
    Claim,
    CursorWrite,
    DeadLetter,
    DeadQuery,
    DeadRow,
    HeldKeyRow,
    OpenedShard,
    PersistOutcome,
    RebasedShard,
    RelayStats,
    RelayStore,
    ShardRead,
)
from tests._services import delete_at_session_end

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

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    async def connected(self) -> int:
        return await self.inner.connected()

    async def open_shards(
        self, held: Sequence[tuple[int, int]], *, release_held: bool = False
    ) -> list[OpenedShard]:
        return await self.inner.open_shards(held, release_held=release_held)

    async def range_ids(self, reads: Sequence[ShardRead], cap: int) -> dict[int, Sequence[int]]:
        return await self.inner.range_ids(reads, cap)

    async def persist(
        self,
        cursors: Sequence[CursorWrite],
        dead: Sequence[DeadLetter] = (),
        held: Sequence[tuple[int, int]] = (),
    ) -> dict[int, PersistOutcome]:
        return await self.inner.persist(cursors, dead, held)

    async def claim_batch(self, reads: Sequence[ShardRead], limit: int, *, hold: bool) -> Claim:
        return await self.inner.claim_batch(reads, limit, hold=hold)

    async def record_tick(self, min_gap_s: float, retention_s: float) -> bool:
        return await self.inner.record_tick(min_gap_s, retention_s)

    async def cleanup_published(self, retention_s: float, limit: int) -> int:
        return await self.inner.cleanup_published(retention_s, limit)

    async def cleanup_members(self) -> int:
        return await self.inner.cleanup_members()

    async def stats(self, shard_count: int) -> RelayStats:
        return await self.inner.stats(shard_count)

    async def ping(self) -> None:
        await self.inner.ping()

    async def refused_shards(self) -> list[tuple[int, str]]:
        return await self.inner.refused_shards()

    async def replay_dead_lettered(self, row_id: int) -> int:
        return await self.inner.replay_dead_lettered(row_id)

    async def discard_dead_lettered(self, row_id: int) -> int:
        return await self.inner.discard_dead_lettered(row_id)

    async def dead_lettered(self, query: DeadQuery) -> list[DeadRow]:
        return await self.inner.dead_lettered(query)

    async def held_keys(self, limit: int) -> list[HeldKeyRow]:
        return await self.inner.held_keys(limit)

    async def rebase(self, margin_s: float, *, dry_run: bool) -> list[RebasedShard]:
        return await self.inner.rebase(margin_s, dry_run=dry_run)

    async def notifications(self) -> AsyncIterator[None]:
        async for item in self.inner.notifications():
            yield item

    async def aclose(self) -> None:
        await self.inner.aclose()


async def create_topic(
    bootstrap: str, name: str, configs: dict[str, str], *, partitions: int = 1
) -> None:
    """Create ``name`` with topic-level ``configs`` (``max.message.bytes``, ...); deleted when
    the test session ends. Raises RuntimeError if Kafka refused (e.g. the topic exists: a
    topic this session did not create is never registered for deletion)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        response = await admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1, topic_configs=configs)]
        )
    finally:
        await admin.close()
    for topic_error in response.topic_errors:
        if topic_error[1] != 0:
            raise RuntimeError(f"CreateTopics {name}: {topic_error}")
    delete_at_session_end(bootstrap, name)


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


def stage_stray(engine: Engine, keys: int) -> int:
    """Stage one event for each of ``keys`` keys through writers with
    ``OutboxTable(shard_count=128)``, in ONE transaction; return how many landed in shards
    64-127, which relays with the default 64 shards never claim."""
    from ledgerbox.outbox import OutboxTable, shard_of

    writer = OutboxWriter(
        TopicRouter(default="stray"), source="/stray", table=OutboxTable(shard_count=128)
    )
    names = [f"k{i}" for i in range(keys)]
    stage(engine, writer, [event(writer, name, 1) for name in names])
    return sum(1 for name in names if shard_of(name, 128) >= 64)


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


def pending_count(engine: Engine, shard_count: int = 64) -> int:
    """Committed rows the shards' persisted cursors have not passed (``relay status``'s
    ``pending``: the store's own query), dead-lettered and held ones not counted."""
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    query = sql.SQL(PENDING_COUNT).format(
        outbox=sql.Identifier("outbox"),
        lease=sql.Identifier("outbox_relay_lease"),
        member=sql.Identifier("outbox_relay_member"),
        tick=sql.Identifier("outbox_relay_tick"),
    )
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(query, {"shard_count": shard_count}).fetchone()
    assert row is not None
    return int(row[0])


def published_ids(engine: Engine, topic: str) -> list[int]:
    """Ids of the rows of ``topic`` the persisted cursors passed that are not dead-lettered,
    held or discarded (published under v2, or marked published under v1)."""
    with engine.connect() as conn:
        return [
            int(i)
            for i in conn.execute(
                text(
                    "SELECT o.id FROM outbox o LEFT JOIN outbox_relay_lease l ON l.shard = o.shard"
                    " WHERE o.topic = :t AND (o.status = 1 OR (o.status = 0 AND coalesce("
                    "pg_visible_in_snapshot(o.txid, l.lo) OR (pg_visible_in_snapshot(o.txid,"
                    " l.hi) AND o.id <= l.after_id), false))) ORDER BY o.id"
                ),
                {"t": topic},
            ).scalars()
        ]


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


class RefusingKafka:
    """The real :class:`KafkaPublisher`, except that while ``refuse`` is set its precheck
    refuses records whose payload says ``"bad"`` for good, as a record above the producer's
    ``max_request_size`` is refused before it is sent (tests of dead-lettering and replay)."""

    def __init__(self, inner: KafkaPublisher) -> None:
        self.inner = inner
        self.refuse = True

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self, *, abort: bool = False, timeout_s: float | None = None) -> None:
        await self.inner.stop(abort=abort, timeout_s=timeout_s)

    def precheck(self, record: OutboundRecord) -> PublishError | None:
        if self.refuse and b'"bad"' in record.value:
            return PublishError.translate(MessageSizeTooLargeError(), "send")
        return self.inner.precheck(record)

    async def send_many(self, records: Sequence[OutboundRecord]) -> list[Awaitable[Any]]:
        return await self.inner.send_many(records)

    async def check(self) -> None:
        await self.inner.check()
