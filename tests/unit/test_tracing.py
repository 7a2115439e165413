"""Spans: nothing is built without an SDK; with one, the relay links at most MAX_LINKS events
(docs/observability.md, "Spans" and "Cost")."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import opentelemetry.trace as ot
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ledgerbox._core import tracing
from ledgerbox.inbox import _spans as inbox_spans
from ledgerbox.inbox.testing import record_for
from ledgerbox.outbox import OutboxWriter, TopicRouter
from ledgerbox.relay import _spans as relay_spans
from ledgerbox.relay._store import ClaimedEvent

WRITER = OutboxWriter(TopicRouter(default="t"), source="/tests")


def _event(**extra: Any) -> Any:
    return WRITER.event(
        event_type="Tested",
        aggregate_type="thing",
        aggregate_id="k",
        payload={"x": 1},
        idempotency_key=f"k:{uuid.uuid4()}",
        **extra,
    )


def _claimed(i: int, headers: str) -> ClaimedEvent:
    return ClaimedEvent(
        id=i, shard=0, topic="t", partition_key="k", payload=b"{}", headers=headers,
        event_id=str(uuid.uuid4()), idempotency_key=f"k{i}", event_type="Tested",
        source="/s", aggregate_type="thing", aggregate_id="k", aggregate_version=None,
        occurred_at_ms=0, occurred_at_iso="1970-01-01T00:00:00+00:00",
    )  # fmt: skip


@pytest.fixture
def sdk() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    once: Any = ot._TRACER_PROVIDER_SET_ONCE
    saved = (ot._TRACER_PROVIDER, once._done)
    once._done = False
    ot.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        provider.shutdown()
        ot._TRACER_PROVIDER, once._done = saved


def test_without_an_sdk_nothing_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(ot.get_tracer_provider(), ot.ProxyTracerProvider)
    assert tracing.tracer() is None

    def boom(*_: Any) -> Any:
        raise AssertionError("links built without an SDK")

    monkeypatch.setattr(relay_spans, "links_of", boom)
    monkeypatch.setattr(inbox_spans, "context_of", boom)
    tp = '{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}'
    assert relay_spans.start_batch_span([_claimed(1, tp)]) is None
    relay_spans.end_batch_span(None, confirmed=1, dead_lettered=0, failure=None)
    event = _event()
    with inbox_spans.consumer_span("g", record_for(event), event) as span:
        assert span is None
    assert "traceparent" not in event.headers, "no span, no active context: no header"


def test_without_an_sdk_the_callers_context_still_propagates() -> None:
    caller = TracerProvider().get_tracer("test")  # not the global provider
    with caller.start_as_current_span("request") as span:
        event = _event()
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert event.headers["traceparent"].split("-")[1] == trace_id


def test_explicit_traceparent_wins_and_builds_no_span(sdk: InMemorySpanExporter) -> None:
    given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    event = _event(headers={"traceparent": given})
    assert event.headers["traceparent"] == given
    assert sdk.get_finished_spans() == ()


def test_producer_span_is_the_context_of_the_header(sdk: InMemorySpanExporter) -> None:
    event = _event()
    (span,) = sdk.get_finished_spans()
    assert span.name == "create t" and span.kind is ot.SpanKind.PRODUCER
    assert span.context is not None and span.parent is None
    version, trace_id, span_id, _flags = event.headers["traceparent"].split("-")
    assert (version, trace_id, span_id) == (
        "00",
        f"{span.context.trace_id:032x}",
        f"{span.context.span_id:016x}",
    )
    assert span.attributes is not None
    assert span.attributes["messaging.message.id"] == str(event.event_id)


def test_batch_span_links_at_most_max_links(sdk: InMemorySpanExporter) -> None:
    rows = [
        _claimed(i, json.dumps({"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"}))
        for i in range(tracing.MAX_LINKS + 50)
    ]
    rows += [_claimed(999, "{}"), _claimed(1000, '{"traceparent": "garbage"}')]
    span = relay_spans.start_batch_span(rows)
    relay_spans.end_batch_span(span, confirmed=len(rows), dead_lettered=0, failure=None)
    (done,) = sdk.get_finished_spans()
    assert len(done.links) == tracing.MAX_LINKS
    assert done.links[0].context.trace_id == 1
    assert done.attributes is not None
    assert done.attributes["messaging.batch.message_count"] == len(rows)
    assert done.attributes["messaging.destination.name"] == "t"


def test_a_dead_lettered_record_ends_its_span_in_error(sdk: InMemorySpanExporter) -> None:
    """docs/observability.md: a record whose processing failed carries an ERROR status. The
    handler's exception is caught by the dead-lettering (it never leaves the span), so the
    outcome sets it; every other outcome leaves the status unset."""
    from ledgerbox.inbox import Outcome

    event = _event()
    for outcome in (Outcome.DEAD_LETTERED, Outcome.APPLIED):
        with inbox_spans.consumer_span("g", record_for(event), event) as span:
            inbox_spans.set_outcome(span, outcome)
    dead, applied = [s for s in sdk.get_finished_spans() if s.name.startswith("process ")]
    assert dead.status.status_code is ot.StatusCode.ERROR
    assert dead.attributes is not None and dead.attributes["ledgerbox.outcome"] == "dead_lettered"
    assert applied.status.status_code is ot.StatusCode.UNSET
