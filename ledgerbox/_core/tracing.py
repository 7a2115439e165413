"""OpenTelemetry spans of ledgerbox: the tracer, the W3C context of a message, attribute names.

The extra ``ledgerbox[otel]`` is optional. :func:`tracer` returns ``None`` when it is not
installed OR when no SDK tracer provider is set (the API's default proxy / no-op provider):
callers then build no span, no attribute and no link, so tracing costs one global lookup per
batch (relay) or per record (inbox) when nobody collects spans (docs/observability.md,
"Cost").

Attribute names follow the OpenTelemetry semantic conventions for messaging (1.27+:
``messaging.operation.type`` ``create`` / ``send`` / ``process``; spec:
https://opentelemetry.io/docs/specs/semconv/messaging/messaging-spans/ and
.../messaging/kafka/).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

try:  # optional extra: ledgerbox[otel]
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
    from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider
except ImportError:  # pragma: no cover - exercised only without the extra
    _propagate = None  # type: ignore[assignment]
    _trace = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, Tracer

__all__ = [
    "MAX_LINKS",
    "MESSAGING",
    "TRACE_HEADERS",
    "context_of",
    "links_of",
    "tracer",
    "wire_trace_headers",
]

#: Instrumentation scope name of every ledgerbox span.
SCOPE = "ledgerbox"

#: The W3C trace-context headers (https://www.w3.org/TR/trace-context/) ledgerbox carries.
TRACE_HEADERS = ("traceparent", "tracestate")

#: Links per relay batch span at most: the SDK's default ``OTEL_SPAN_LINK_COUNT_LIMIT``
#: (128); links past it would be built and then dropped by the SDK.
MAX_LINKS = 128


class MESSAGING:
    """Attribute names of the messaging semantic conventions (and ledgerbox's own)."""

    SYSTEM = "messaging.system"
    DESTINATION = "messaging.destination.name"
    MESSAGE_ID = "messaging.message.id"
    OPERATION_TYPE = "messaging.operation.type"
    OPERATION_NAME = "messaging.operation.name"
    BATCH_COUNT = "messaging.batch.message_count"
    CONSUMER_GROUP = "messaging.consumer.group.name"
    PARTITION = "messaging.destination.partition.id"
    KAFKA_KEY = "messaging.kafka.message.key"
    KAFKA_OFFSET = "messaging.kafka.offset"
    EVENT_TYPE = "ledgerbox.event_type"
    OUTCOME = "ledgerbox.outcome"
    DEAD_LETTERED = "ledgerbox.dead_lettered_count"
    KAFKA = "kafka"


_cache: tuple[object, Tracer] | None = None

#: The global provider can be read directly (the API keeps it in ``_TRACER_PROVIDER``, None
#: until set) unless a provider class is to be loaded from the environment, or a future API
#: renamed the attribute (then the public getter is used).
_FAST_CHECK = (
    _trace is not None
    and hasattr(_trace, "_TRACER_PROVIDER")
    and "OTEL_PYTHON_TRACER_PROVIDER" not in os.environ
)


def tracer() -> Tracer | None:
    """The ledgerbox tracer of the global tracer provider, or ``None`` if spans are off.

    Returns
    -------
    opentelemetry.trace.Tracer | None
        ``None`` when OpenTelemetry is not installed or the global provider is the API's
        proxy/no-op one (no SDK configured): then build nothing. The tracer is cached per
        provider (``get_tracer`` builds a new object per call in the SDK).
    """
    global _cache
    if _trace is None:
        return None
    if _FAST_CHECK:
        # The API's global without its getter (~0.5 us: an os.environ lookup per call); the
        # getter is needed only to load OTEL_PYTHON_TRACER_PROVIDER, checked at import.
        provider: object = getattr(_trace, "_TRACER_PROVIDER", None)
        if provider is None:
            return None
    else:
        provider = _trace.get_tracer_provider()
    if isinstance(provider, ProxyTracerProvider | NoOpTracerProvider):
        return None
    assert isinstance(provider, _trace.TracerProvider)
    cached = _cache
    if cached is not None and cached[0] is provider:
        return cached[1]
    found = provider.get_tracer(SCOPE, _version())
    _cache = (provider, found)
    return found


def _version() -> str | None:
    # The distribution's version (the root package may not be imported from _core).
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ledgerbox")
    except PackageNotFoundError:
        return None


def context_of(headers: Mapping[str, str]) -> Context:
    """The OpenTelemetry context carried by W3C ``traceparent``/``tracestate`` headers
    (an empty context when they are absent or invalid). Requires the ``otel`` extra."""
    assert _propagate is not None
    return _propagate.extract(headers)


def wire_trace_headers(headers: Sequence[tuple[str, bytes]]) -> dict[str, str]:
    """The trace headers among Kafka record headers, decoded (undecodable ones left out)."""
    found: dict[str, str] = {}
    for name, value in headers:
        if name in TRACE_HEADERS and value is not None:
            try:
                found[name] = value.decode()
            except UnicodeDecodeError:
                continue
    return found


def links_of(header_texts: Iterable[str]) -> list[Link]:
    """One span link per valid ``traceparent`` in the JSON ``headers`` columns of outbox
    rows, at most :data:`MAX_LINKS`. Only call it with a tracer (:func:`tracer`)."""
    assert _trace is not None
    links: list[Link] = []
    for text in header_texts:
        if text == "{}" or "traceparent" not in text:
            continue
        try:
            carried: dict[str, Any] = json.loads(text)
        except ValueError:
            continue
        carrier = {k: v for k in TRACE_HEADERS if isinstance(v := carried.get(k), str)}
        parent = _trace.get_current_span(context_of(carrier)).get_span_context()
        if parent.is_valid:
            links.append(_trace.Link(parent))
            if len(links) >= MAX_LINKS:
                break
    return links
