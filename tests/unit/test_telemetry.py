"""ledgerbox.telemetry.configure: an SDK from the OTEL_* variables, or nothing
(docs/observability.md, "Export")."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import opentelemetry.trace as ot
import pytest

from ledgerbox import ConfigurationError, telemetry
from ledgerbox._core import tracing
from ledgerbox.outbox import OutboxWriter, TopicRouter


@pytest.fixture(autouse=True)
def _global_provider_restored() -> Iterator[None]:
    once: Any = ot._TRACER_PROVIDER_SET_ONCE
    saved = (ot._TRACER_PROVIDER, once._done)
    try:
        yield
    finally:
        telemetry.shutdown()
        ot._TRACER_PROVIDER, once._done = saved


def test_nothing_is_installed_without_an_exporter_or_endpoint() -> None:
    assert telemetry.configure("svc", environ={}) is False
    assert telemetry.configure("svc", environ={"OTEL_TRACES_EXPORTER": "none"}) is False
    disabled = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}
    assert telemetry.configure("svc", environ=disabled) is False
    assert tracing.tracer() is None


def test_the_file_exporter_writes_one_json_line_per_span(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    env = {"OTEL_TRACES_EXPORTER": telemetry.FILE_EXPORTER, "LEDGERBOX_OTEL_FILE": str(path)}
    assert telemetry.configure("ledgerbox-test", environ=env) is True
    assert tracing.tracer() is not None
    writer = OutboxWriter(TopicRouter(default="orders"), source="/tests")
    event = writer.event(
        event_type="OrderPlaced",
        aggregate_type="order",
        aggregate_id="1",
        payload={},
        idempotency_key="order:1",
    )
    telemetry.shutdown()  # flushes the batch processor
    (line,) = path.read_text().splitlines()
    span = json.loads(line)
    assert span["name"] == "create orders"
    assert span["kind"] == "SpanKind.PRODUCER"
    assert span["attributes"]["messaging.message.id"] == str(event.event_id)
    assert span["resource"]["attributes"]["service.name"] == "ledgerbox-test"
    assert event.headers["traceparent"].split("-")[1] == span["context"]["trace_id"][2:]


def test_an_endpoint_alone_selects_otlp_over_http() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert telemetry.configure("svc", environ=env) is True
    provider: Any = ot.get_tracer_provider()
    exporters = [p.span_exporter for p in provider._active_span_processor._span_processors]
    assert [type(e).__module__ for e in exporters] == [
        "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    ]


def test_an_application_provider_is_left_alone() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    once: Any = ot._TRACER_PROVIDER_SET_ONCE
    once._done = False
    mine = TracerProvider()
    ot.set_tracer_provider(mine)
    assert telemetry.configure("svc", environ={"OTEL_TRACES_EXPORTER": "console"}) is False
    assert ot.get_tracer_provider() is mine


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin-ish"}, "unknown exporter 'zipkin-ish'"),
        ({"OTEL_TRACES_EXPORTER": "ledgerbox_file"}, "needs LEDGERBOX_OTEL_FILE"),
    ],
)
def test_bad_settings_are_one_line_errors(env: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        telemetry.configure("svc", environ=env)
    assert says in str(info.value) and "\n" not in str(info.value)
