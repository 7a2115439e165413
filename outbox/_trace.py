"""W3C trace context from OpenTelemetry, when it is installed and a span is active."""

from __future__ import annotations

try:  # optional extra: ledgerbox[otel]
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - exercised only without the extra
    _propagate = None  # type: ignore[assignment]
    _trace = None  # type: ignore[assignment]

__all__ = ["current_trace_headers"]

_TRACE_HEADERS = ("traceparent", "tracestate")


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
    return {k: v for k, v in carrier.items() if k in _TRACE_HEADERS}
