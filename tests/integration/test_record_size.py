"""The writer's record-size check agrees with what the relay sends (real PostgreSQL; the
last test also real Kafka): an event the writer accepts is published, one the relay would
dead-letter for its size is refused at write time, nothing staged."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
import sqlalchemy as sa
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ledgerbox.outbox import (
    DEFAULT_MAX_RECORD_BYTES,
    OutboxWriter,
    PayloadTooLargeError,
    RecordTooLargeError,
    TopicRouter,
)
from ledgerbox.outbox._writer import record_size
from ledgerbox.relay import Relay
from ledgerbox.relay.testing import InMemoryPublisher
from tests import _relay_support as rs

MIB = 1_048_576


def writer(topic: str, **settings: Any) -> OutboxWriter:
    return OutboxWriter(TopicRouter(default=topic), source="/size-test", **settings)


def rows_of(engine: Engine, topic: str) -> int:
    with engine.connect() as conn:
        query = sa.text("SELECT count(*) FROM outbox WHERE topic = :t")
        return int(conn.execute(query, {"t": topic}).scalar_one())


async def test_record_size_is_the_size_of_the_record_the_relay_sends(
    engine: Engine, database_url: str
) -> None:
    """``record_size`` (the writer's estimate) equals Kafka's estimate of the record the
    relay builds from the stored row: the payload in jsonb's text form, key, headers."""
    rs.reset_relay_tables(engine)
    w = writer("size-agree")
    payloads: list[dict[str, Any]] = [
        {"a": 1},
        {"nested": {"list": [1, 2, [3, {"b": None}]], "t": True, "f": False}, "x": 1.5},
        {
            "unicode": "Z\u00fcrich \u2013 \u6771\u4eac \u2713",
            "quote": 'a"b\\c\n',
            "n": -42,
            "big": 10**30,
        },
        {"many": list(range(2000)), "dicts": [{"k": i} for i in range(200)]},
        {},
        # jsonb prints numbers without exponent: 1e+300 is 301 digits on the wire (review).
        {"exp": [1e300, 1e-05, 1.5e-07, 1e16, -2.5e-10, 123.456, 0.1, 100.0, 2.0**70]},
    ]
    events = [
        w.event(
            event_type="Sized",
            aggregate_type="thing",
            aggregate_id=f"t{i}",
            aggregate_version=i + 1,
            payload=payload,
            idempotency_key=f"size:{i}",
            headers={"x-tenant": "acme", "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
            occurred_at=dt.datetime(2026, 12, 5, 9, 0, 0, 123456, tzinfo=dt.UTC),
        )
        for i, payload in enumerate(payloads)
    ]
    rs.stage(engine, w, events)
    publisher = InMemoryPublisher()
    relay = Relay(rs.config(database_url, "unused:9092", lanes=1), publisher=publisher)
    try:
        await relay.run_once()
    finally:
        await relay.aclose()
    sent = {r.key: r for r in publisher.records}
    assert len(sent) == len(events)
    for event in events:
        record = sent[event.partition_key.encode()]
        expected = DefaultRecordBatchBuilder.estimate_size_in_bytes(
            key=record.key, value=record.value, headers=record.headers
        )
        assert record_size(event) == expected, event.payload


def test_an_event_the_relay_would_refuse_for_its_size_is_refused_at_write_time(
    engine: Engine,
) -> None:
    """Before: a payload of exactly max_payload_bytes (1 MiB of compact JSON) was accepted,
    then dead-lettered by the relay ("record of 1048953 bytes is above max_request_size
    1048576") and its key held. Also a payload whose compact JSON is far below the limit
    but whose jsonb text (", " between items) is above it."""
    rs.reset_relay_tables(engine)
    w = writer("size-refused")
    at_limit = {"blob": "x" * (MIB - len('{"blob":""}'))}
    spread = {"zeros": [0] * 360_000}  # compact 720 KB, jsonb text ~1.08 MB
    exponents = {"v": [1e300] * 5000}  # compact 35 KB, jsonb text 1.5 MB (review)
    cases: list[tuple[dict[str, Any], dict[str, str]]] = [
        (at_limit, {}),
        (spread, {}),
        (exponents, {}),
        ({"a": 1}, {"x-big": "h" * 1_100_000}),  # a small payload, a huge header (review)
    ]
    for i, (payload, headers) in enumerate(cases):
        event = w.event(
            event_type="Sized",
            aggregate_type="thing",
            aggregate_id=f"r{i}",
            payload=payload,
            idempotency_key=f"refused:{i}",
            headers=headers,
        )
        with (
            pytest.raises(RecordTooLargeError) as raised,
            Session(engine) as session,
            session.begin(),
        ):
            w.stage(session, event)
        assert isinstance(raised.value, PayloadTooLargeError)  # caught where that is caught
        assert raised.value.max_bytes == DEFAULT_MAX_RECORD_BYTES
        message = str(raised.value)
        assert "\n" not in message and "--max-request-bytes" in message
    assert rows_of(engine, "size-refused") == 0
    # The check can be turned off, or raised with the relays' limit.
    roomy = writer("size-refused", max_record_bytes=2 * MIB, max_payload_bytes=2 * MIB)
    rs.stage(
        engine,
        roomy,
        [
            roomy.event(
                event_type="Sized",
                aggregate_type="thing",
                aggregate_id="ok",
                payload=at_limit,
                idempotency_key="refused:ok",
            )
        ],
    )
    assert rows_of(engine, "size-refused") == 1


async def test_the_largest_event_the_writer_accepts_is_published_to_kafka(
    engine: Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """A payload just under the record limit: accepted, and the relay publishes it to a
    topic with the brokers' default max.message.bytes (not dead-lettered)."""
    rs.reset_relay_tables(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox"))  # only this test's event goes to Kafka
    topic = f"size-max-{dt.datetime.now(dt.UTC):%H%M%S%f}"
    await rs.create_topic(kafka_bootstrap, topic, {})
    w = writer(topic)
    event = w.event(
        event_type="Sized",
        aggregate_type="thing",
        aggregate_id="max",
        payload={"blob": "y" * (MIB - 1024)},
        idempotency_key="size:max",
    )
    assert record_size(event) <= DEFAULT_MAX_RECORD_BYTES
    rs.stage(engine, w, [event])
    relay = Relay(rs.config(database_url, kafka_bootstrap, lanes=1))
    try:
        await relay.run_once()
    finally:
        await relay.aclose()
    with engine.connect() as conn:
        query = sa.text("SELECT status FROM outbox WHERE topic = :t")
        status = conn.execute(query, {"t": topic}).scalar_one()
    assert status != 2, "dead-lettered"
    records = await rs.consume(kafka_bootstrap, topic, until=lambda got: len(got) >= 1)
    assert len(records[0].value) > MIB - 1024
