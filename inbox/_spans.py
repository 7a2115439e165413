"""The consumer's span: one ``process <topic>`` span per record, child of its ``traceparent``.

When an SDK is configured (:func:`ledgerbox._core.tracing.tracer`), each record with a parsed
envelope runs inside a span of kind CONSUMER whose parent is the context the record carries
(the producer span of the event, docs/observability.md): the span is ACTIVE while the inbox
transaction and the handler run, so spans the handler starts (HTTP calls, SQL
instrumentation) are its children, also in sync handlers (``asyncio.to_thread`` copies the
context). Without an SDK nothing is built and no header is read.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ledgerbox._core.tracing import MESSAGING, context_of, tracer, wire_trace_headers
from ledgerbox.inbox._policy import Outcome
from ledgerbox.inbox._record import Record
from ledgerbox.outbox import EventEnvelope

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = ["consumer_span", "set_outcome"]


_OFF: contextlib.nullcontext[None] = contextlib.nullcontext()


def consumer_span(
    group: str, record: Record, event: EventEnvelope
) -> contextlib.AbstractContextManager[Span | None]:
    """The record's ``process`` span as a context manager that makes it current (it yields
    the span), or a shared no-op context yielding ``None`` when spans are off.

    An exception leaving the body is recorded on the span with an ERROR status and
    re-raised unchanged.
    """
    found = tracer()
    if found is None:
        return _OFF
    from opentelemetry.trace import SpanKind

    parent = context_of(wire_trace_headers(record.headers))
    return found.start_as_current_span(
        f"process {record.topic}",
        context=parent,
        kind=SpanKind.CONSUMER,
        attributes={
            MESSAGING.SYSTEM: MESSAGING.KAFKA,
            MESSAGING.DESTINATION: record.topic,
            MESSAGING.OPERATION_TYPE: "process",
            MESSAGING.OPERATION_NAME: "process",
            MESSAGING.MESSAGE_ID: str(event.event_id),
            MESSAGING.CONSUMER_GROUP: group,
            MESSAGING.PARTITION: str(record.partition),
            MESSAGING.KAFKA_OFFSET: record.offset,
            MESSAGING.KAFKA_KEY: event.partition_key,
            MESSAGING.EVENT_TYPE: event.event_type,
        },
    )


def set_outcome(span: Span | None, outcome: Outcome) -> None:
    """Record the record's :class:`inbox.Outcome` value on its span (if any); a
    dead-lettered record's span ends in ERROR (its handler's exception was caught by the
    dead-lettering, so it never left the span; docs/observability.md)."""
    if span is not None:
        span.set_attribute(MESSAGING.OUTCOME, outcome.value)
        if outcome.value == "dead_lettered":
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, "dead-lettered"))
