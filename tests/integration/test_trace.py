"""One trace from the writer to the handler, on real PostgreSQL and Kafka (docs/observability.md).

A caller's span stages an event (producer span ``create <topic>``, its child), the relay
publishes it in a batch (``send <topic>``, linked to the producer span), a real consumer
applies it (``process <topic>``, child of the producer span, active while the handler runs).
The SDK's in-memory exporter collects the spans.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import opentelemetry.trace as ot
import pytest
import sqlalchemy as sa
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncSession

from ledgerbox import admin
from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer
from ledgerbox.inbox._metrics import EVENT_LATENCY, LAG
from ledgerbox.outbox import EventEnvelope
from ledgerbox.relay import KafkaPublisher, Relay
from ledgerbox.relay._metrics import EVENT_AGE_AT_PUBLISH
from tests import _relay_support as rs
from tests._inbox_support import poll
from tests._services import TopicFactory


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """A global SDK tracer provider for this test only (the API sets it once per process:
    its once-flag is reset and restored, as OpenTelemetry's own test helpers do)."""
    found = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(found))
    once: Any = ot._TRACER_PROVIDER_SET_ONCE
    saved = (ot._TRACER_PROVIDER, once._done)
    once._done = False
    ot.set_tracer_provider(provider)
    try:
        yield found
    finally:
        provider.shutdown()
        ot._TRACER_PROVIDER, once._done = saved


def _one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


async def test_writer_relay_and_consumer_spans_form_one_trace(
    exporter: InMemorySpanExporter,
    engine: Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: TopicFactory,
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("trace", partitions=1)
    group = f"g-trace-{uuid.uuid4().hex[:8]}"
    writer = rs.writer_for(topic)
    caller = ot.get_tracer("test").start_span("place-order")
    with ot.use_span(caller, end_on_exit=True):
        event = rs.event(writer, "order-1", 1)
        rs.stage(engine, writer, [event])

    age_before = _histogram_count(EVENT_AGE_AT_PUBLISH)
    relay = Relay(rs.config(database_url, kafka_bootstrap, lanes=1))
    try:
        assert await relay.run_once() == 1
    finally:
        await relay.aclose()

    consumer = InboxConsumer(
        ConsumerConfig(
            group_id=group,
            topics=[topic],
            database_url=database_url,
            kafka_bootstrap_servers=kafka_bootstrap,
            commit_interval_ms=20,
        )
    )
    active: list[ot.SpanContext] = []

    @consumer.handler("Tested")
    async def handle(ctx: HandlerContext[AsyncSession], ev: EventEnvelope) -> None:
        await ctx.session.execute(sa.text("SELECT 1"))
        active.append(ot.get_current_span().get_span_context())

    task = asyncio.create_task(consumer.run())
    try:

        async def processed() -> bool:
            return any(s.name == f"process {topic}" for s in exporter.get_finished_spans())

        await poll(processed, "the consumer span")
        lag = LAG.labels(group, topic, "0")

        async def caught_up() -> bool:
            return lag._value.get() == 0 and bool(active)

        await poll(caught_up, "the lag gauge at 0 after the record was applied", within_s=10)
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 60)

    spans = list(exporter.get_finished_spans())
    create = _one(spans, f"create {topic}")
    send = _one(spans, f"send {topic}")
    process = _one(spans, f"process {topic}")
    root = _one(spans, "place-order")
    assert create.context is not None and send.context is not None
    assert process.context is not None and root.context is not None

    trace_id = root.context.trace_id
    assert {create.context.trace_id, process.context.trace_id} == {trace_id}
    assert create.kind is SpanKind.PRODUCER
    assert create.parent is not None and create.parent.span_id == root.context.span_id
    assert event.headers["traceparent"].split("-")[2] == format(create.context.span_id, "016x")

    assert send.kind is SpanKind.PRODUCER
    linked = [(link.context.trace_id, link.context.span_id) for link in send.links]
    assert (trace_id, create.context.span_id) in linked
    assert send.attributes is not None
    assert send.attributes["messaging.batch.message_count"] == 1
    assert send.attributes["messaging.destination.name"] == topic
    assert send.attributes["messaging.operation.type"] == "send"

    assert process.kind is SpanKind.CONSUMER
    assert process.parent is not None and process.parent.span_id == create.context.span_id
    assert active == [process.context], "the handler ran with the consumer span active"
    for span in (create, process):
        assert span.attributes is not None
        assert span.attributes["messaging.system"] == "kafka"
        assert span.attributes["messaging.destination.name"] == topic
        assert span.attributes["messaging.message.id"] == str(event.event_id)
    assert process.attributes is not None
    assert process.attributes["messaging.consumer.group.name"] == group
    assert process.attributes["messaging.destination.partition.id"] == "0"
    assert process.attributes["ledgerbox.outcome"] == "applied"

    # The end-to-end latency histogram and the relay's age-at-publish histogram moved.
    latency = EVENT_LATENCY.labels(group)
    assert _histogram_count(latency) == 1
    assert _histogram_count(EVENT_AGE_AT_PUBLISH) == age_before + 1


def _histogram_count(histogram: Any) -> float:
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                return float(sample.value)
    raise AssertionError("no _count sample")


async def test_a_send_span_only_for_a_batch_that_sent_records(
    exporter: InMemorySpanExporter,
    engine: Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: TopicFactory,
) -> None:
    """Reviewer finding: after an operator replay of an event Kafka still refuses, the relay
    emitted a ``send`` span although nothing was handed to Kafka (the event refused before
    sending, the one behind it held). A ``send`` span covers records sent, and counts them."""
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("trace-dead", partitions=1)
    writer = rs.writer_for(topic)
    bad = rs.event(writer, "K", 1, payload={"key": "K", "seq": 1, "bad": True})
    rs.stage(engine, writer, [bad, rs.event(writer, "K", 2)])
    publisher = rs.RefusingKafka(KafkaPublisher(kafka_bootstrap, compression="none"))
    relay = Relay(rs.config(database_url, kafka_bootstrap, lanes=1), publisher=publisher)
    db = admin.Database(url=database_url)

    def sends() -> list[ReadableSpan]:
        return [s for s in exporter.get_finished_spans() if s.name.startswith("send")]

    async def drain() -> None:
        while await relay.run_once():
            pass

    try:
        await drain()
        (dead,) = await admin.list_dead_events(db, admin.DeadFilter(topic=topic))
        assert dead.held_behind == 1
        assert sends() == [], "nothing was sent: K1 refused before sending, K2 held behind it"
        # The operator replays it while Kafka still refuses it: dead again, still no send.
        await admin.replay_dead_events(db, [dead.id], actor="trace-test")
        await drain()
        (again,) = await admin.list_dead_events(db, admin.DeadFilter(topic=topic))
        assert sends() == [], [dict(s.attributes or {}) for s in sends()]
        # Fixed: the replay sends both, in one batch, and its span counts them.
        publisher.refuse = False
        await admin.replay_dead_events(db, [again.id], actor="trace-test")
        await drain()
    finally:
        await relay.aclose()
    (send,) = sends()
    assert send.attributes is not None
    assert send.attributes["messaging.batch.message_count"] == 2
    assert send.attributes["ledgerbox.confirmed_count"] == 2
    assert await admin.list_dead_events(db, admin.DeadFilter(topic=topic)) == []
