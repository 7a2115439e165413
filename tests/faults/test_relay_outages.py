"""Relay outages: Kafka stopped mid-stream, a relay killed while two others run.

Both keep writing while the fault lasts; at the end every event is on Kafka once or more and
for every key the first occurrences are in commit order (per-key sequence numbers).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from typing import Any

import pytest
from aiokafka import ConsumerRecord
from sqlalchemy import Engine, text

from ledgerbox.relay import Relay
from tests import _relay_support as rs
from tests._services import TopicFactory

Records = list[ConsumerRecord[bytes, bytes]]


class _Writer(threading.Thread):
    """Commits one event per transaction for ``keys`` round robin, ``rate`` tx/s."""

    def __init__(self, engine: Engine, topic: str, keys: int, rate: float) -> None:
        super().__init__(daemon=True)
        self.engine, self.keys, self.rate = engine, keys, rate
        self.writer = rs.writer_for(topic)
        self.next_seq = [0] * keys
        self.stop_flag = threading.Event()
        self.errors: list[BaseException] = []

    def run(self) -> None:
        start = time.monotonic()
        n = 0
        while not self.stop_flag.is_set():
            k = n % self.keys
            try:
                rs.stage(
                    self.engine, self.writer, [rs.event(self.writer, f"k{k}", self.next_seq[k])]
                )
            except Exception as exc:  # the database stays up in these tests
                self.errors.append(exc)
                return
            self.next_seq[k] += 1
            n += 1
            pause = start + n / self.rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)

    def finish(self) -> int:
        self.stop_flag.set()
        self.join(30)
        assert not self.errors, self.errors
        return sum(self.next_seq)


def _check_complete_and_ordered(records: Records, writer: _Writer) -> None:
    by_key: dict[str, list[int]] = {}
    for r in records:
        by_key.setdefault((r.key or b"").decode(), []).append(json.loads(r.value or b"")["seq"])
    for k in range(writer.keys):
        seqs = by_key.get(f"k{k}", [])
        firsts = list(dict.fromkeys(seqs))
        assert firsts == list(range(writer.next_seq[k])), f"key k{k}: {firsts[:20]}..."


async def _wait_pending_zero(engine: Engine, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while rs.pending_count(engine) != 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rs.pending_count(engine)} events still pending")
        await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_kafka_stopped_20s_mid_stream_loses_nothing_keeps_key_order(
    engine: Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: TopicFactory,
    services_script: str,
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("outage", partitions=3)
    writer = _Writer(engine, topic, keys=10, rate=20)
    relay = Relay(
        rs.config(database_url, kafka_bootstrap, request_timeout_ms=5000, backoff_max_s=2.0)
    )
    task = asyncio.create_task(relay.run())
    writer.start()
    stopped = False
    try:
        await asyncio.sleep(3)
        published_before = await asyncio.to_thread(_published, engine, topic)
        assert published_before > 0
        await asyncio.to_thread(
            subprocess.run, ["bash", services_script, "stop-kafka"], check=True, capture_output=True
        )
        stopped = True
        most_pending = 0
        for _ in range(40):  # 20 s outage
            await asyncio.sleep(0.5)
            most_pending = max(most_pending, rs.pending_count(engine))
        assert most_pending > 0, (
            "events wait in the outbox during the outage",
            _status_counts(engine, topic),
            writer.is_alive(),
            writer.errors,
        )
    finally:
        if stopped:
            await asyncio.to_thread(
                subprocess.run,
                ["bash", services_script, "start-kafka"],
                check=True,
                capture_output=True,
            )
    try:
        await asyncio.sleep(2)
        total = writer.finish()
        await _wait_pending_zero(engine, 120)
        assert not task.done(), "the relay survived the outage without a restart"
    finally:
        relay.stop()
        await asyncio.wait_for(task, 60)
    records = await rs.consume(
        kafka_bootstrap, topic, until=lambda r: len({rs.header(x, "ce_id") for x in r}) >= total
    )
    _check_complete_and_ordered(records, writer)
    print(f"outage: {total} events, {len(records)} records ({len(records) - total} duplicates)")


def _status_counts(engine: Engine, topic: str) -> dict[int, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT status, count(*) FROM outbox WHERE topic = :t GROUP BY status"),
            {"t": topic},
        ).all()
    return {int(s): int(n) for s, n in rows}


def _published(engine: Engine, topic: str) -> int:
    return len(rs.published_ids(engine, topic))


def _owners(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT owner, count(*) FROM outbox_relay_lease WHERE shard >= 0 AND owner IS NOT "
                "NULL AND expires_at > now() GROUP BY owner"
            )
        ).all()
    return {str(o): int(n) for o, n in rows}


@pytest.mark.slow
async def test_relay_killed_while_two_others_run_shards_move_no_loss(
    engine: Engine, database_url: str, kafka_bootstrap: str, new_topic: TopicFactory
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("kill3", partitions=3)
    procs: dict[str, Any] = {
        name: rs.relay_process(database_url, kafka_bootstrap, "--relay-id", name)
        for name in ("r1", "r2", "r3")
    }
    writer = _Writer(engine, topic, keys=20, rate=40)
    try:
        deadline = time.monotonic() + 60
        while True:  # fair share ceil(64 / 3) = 22: every relay owns some, none more
            owners = _owners(engine)
            if len(owners) == 3 and sum(owners.values()) == 64 and max(owners.values()) <= 22:
                break
            assert time.monotonic() < deadline, owners
            await asyncio.sleep(0.2)
        writer.start()
        await asyncio.sleep(2)
        rs.stop_process(procs["r1"], kill=True)
        killed_at = time.monotonic()
        while True:
            owners = _owners(engine)
            if set(owners) == {"r2", "r3"} and sum(owners.values()) == 64:
                break
            assert time.monotonic() - killed_at < 30, owners
            await asyncio.sleep(0.1)
        moved_s = time.monotonic() - killed_at
        await asyncio.sleep(2)
        total = writer.finish()
        await _wait_pending_zero(engine, 60)
    finally:
        writer.finish() if writer.is_alive() else None
        codes = {name: rs.stop_process(p) for name, p in procs.items()}
    assert codes["r2"] == 0 and codes["r3"] == 0
    records = await rs.consume(
        kafka_bootstrap, topic, until=lambda r: len({rs.header(x, "ce_id") for x in r}) >= total
    )
    _check_complete_and_ordered(records, writer)
    print(f"kill -9: shards moved in {moved_s:.1f} s (lease ttl 3 s); {total} events, no loss")


async def test_a_producer_recreated_after_failures_fails_its_undelivered_records_at_once(
    kafka_bootstrap: str, services_script: str, new_topic: TopicFactory
) -> None:
    """Soak finding: after a whole-cluster restart the relay recreated its producer, the old
    one's stop() waited for batches it could never deliver (then leaked its sender task), and
    the lanes waited up to 2 x request_timeout + 5 s for their futures. Aborting the producer
    fails every record it has not delivered yet at once; the rows are simply sent again."""
    from ledgerbox.relay import KafkaPublisher, OutboundRecord, PublishError

    topic = new_topic("abort", partitions=1)
    publisher = KafkaPublisher(kafka_bootstrap, request_timeout_ms=30_000)
    await publisher.start()
    record = OutboundRecord(topic=topic, key=b"k", value=b"{}", timestamp_ms=1, headers=[])
    (warm,) = await publisher.send_many([record])
    await warm  # metadata known, a connection open
    await asyncio.to_thread(
        subprocess.run, ["bash", services_script, "stop-kafka"], check=True, capture_output=True
    )
    try:
        futures = await publisher.send_many([record] * 5)
        await asyncio.sleep(1.0)
        assert not any(asyncio.ensure_future(f).done() for f in futures), "undeliverable"
        started = time.monotonic()
        await publisher.stop(abort=True)
        results = await asyncio.wait_for(
            asyncio.gather(*futures, return_exceptions=True), timeout=10
        )
        assert time.monotonic() - started < 10, "not the 30 s request timeout"
        assert all(isinstance(r, PublishError) for r in results), results
    finally:
        await asyncio.to_thread(
            subprocess.run, ["bash", services_script, "start-kafka"], check=True,
            capture_output=True,
        )  # fmt: skip
    tasks = [t for t in asyncio.all_tasks() if "sender" in repr(t).lower()]
    assert not [t for t in tasks if not t.done()], "no sender task of the old producer left"
