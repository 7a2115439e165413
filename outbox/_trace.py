"""The producer span of an event and the W3C trace context it puts into the event's headers.

When an OpenTelemetry SDK is configured, building an event starts and ends a span of kind
PRODUCER (``create <topic>``, the messaging conventions' "create" operation), a child of the
caller's active span; ITS context is what goes into the event's ``traceparent`` header, so the
relay's batch span links to it and the consumer's span is its child (docs/observability.md).
Without an SDK no span is built: the caller's active span context (if any) is propagated as
before.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from ledgerbox._core.tracing import MESSAGING, TRACE_HEADERS, tracer

try:  # optional extra: ledgerbox[otel]
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - exercised only without the extra
    _propagate = None  # type: ignore[assignment]
    _trace = None  # type: ignore[assignment]

__all__ = ["current_trace_headers", "producer_trace_headers"]


def current_trace_headers() -> dict[str, str]:
    """Return ``{"traceparent": ..., "tracestate": ...}`` of the active span, or ``{}``.

    Empty when OpenTelemetry is not installed or no valid span is active.
    """
    if _trace is None or _propagate is None:
        return {}
    if not _trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    _propagate.inject(carrier)
    return {k: v for k, v in carrier.items() if k in TRACE_HEADERS}


def producer_trace_headers(
    *,
    topic: str,
    event_id: uuid.UUID,
    event_type: str,
    partition_key: str,
    headers: Mapping[str, str] | None,
) -> dict[str, str]:
    """The trace headers of a new event, after its producer span (if spans are on).

    Parameters
    ----------
    topic, event_id, event_type, partition_key
        The event's destination and identity (span name and attributes).
    headers : Mapping[str, str] | None
        The caller's explicit headers: if they carry a ``traceparent`` the caller decided
        the trace context, and neither a span nor another context is added (``{}``).

    Returns
    -------
    dict[str, str]
        ``traceparent`` (and ``tracestate``) of the producer span, or of the caller's active
        span when no SDK is configured; ``{}`` when there is neither.
    """
    if headers is not None and "traceparent" in headers:
        return {}
    found = tracer()
    if found is None or _trace is None or _propagate is None:
        return current_trace_headers()
    span = found.start_span(
        f"create {topic}",
        kind=_trace.SpanKind.PRODUCER,
        attributes={
            MESSAGING.SYSTEM: MESSAGING.KAFKA,
            MESSAGING.DESTINATION: topic,
            MESSAGING.OPERATION_TYPE: "create",
            MESSAGING.OPERATION_NAME: "create",
            MESSAGING.MESSAGE_ID: str(event_id),
            MESSAGING.KAFKA_KEY: partition_key,
            MESSAGING.EVENT_TYPE: event_type,
        },
    )
    try:
        carrier: dict[str, str] = {}
        _propagate.inject(carrier, context=_trace.set_span_in_context(span))
        return {k: v for k, v in carrier.items() if k in TRACE_HEADERS}
    finally:
        span.end()
