"""The relay's span: ONE ``send`` span per batch that sends records, linked to each event's
producer span (a batch whose events were all held or refused before sending sends nothing,
and gets no span).

The relay publishes tens of thousands of events per second: a span per event would cost more
than the publish. Per batch, when an SDK is configured (:func:`ledgerbox._core.tracing.tracer`),
one span of kind PRODUCER covers send + delivery confirmation of the batch's records, with a
link to the ``traceparent`` of each event (at most ``MAX_LINKS``), as the messaging semantic
conventions describe a batch send. Without an SDK nothing is built (:func:`start_batch_span`
returns ``None`` after one global lookup).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ledgerbox._core.tracing import MESSAGING, links_of, tracer
from ledgerbox.relay._store import ClaimedEvent

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = ["end_batch_span", "start_batch_span"]


def start_batch_span(events: Sequence[ClaimedEvent]) -> Span | None:
    """Start the ``send`` span of the records about to be handed to Kafka (``events``: only
    those; not the held ones nor those refused before sending), or ``None`` (spans off, or
    nothing to send). The caller ends it with :func:`end_batch_span`."""
    if not events:
        return None
    found = tracer()
    if found is None:
        return None
    from opentelemetry.trace import SpanKind

    topics = {e.topic for e in events}
    attributes: dict[str, str | int] = {
        MESSAGING.SYSTEM: MESSAGING.KAFKA,
        MESSAGING.OPERATION_TYPE: "send",
        MESSAGING.OPERATION_NAME: "send",
        MESSAGING.BATCH_COUNT: len(events),
    }
    if len(topics) == 1:
        (topic,) = topics
        attributes[MESSAGING.DESTINATION] = topic
        name = f"send {topic}"
    else:
        name = "send"
    return found.start_span(
        name,
        kind=SpanKind.PRODUCER,
        attributes=attributes,
        links=links_of(e.headers for e in events),
    )


def end_batch_span(
    span: Span | None, *, confirmed: int, dead_lettered: int, failure: BaseException | None
) -> None:
    """End a batch span: confirmed and dead-lettered counts, ERROR status on a failure."""
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("ledgerbox.confirmed_count", confirmed)
    span.set_attribute(MESSAGING.DEAD_LETTERED, dead_lettered)
    if failure is not None:
        span.record_exception(failure)
        span.set_status(Status(StatusCode.ERROR, type(failure).__name__))
    span.end()
