"""The Kafka record form of an event: CloudEvents Kafka protocol binding, binary content mode.

Record key = partition key (UTF-8), value = payload JSON, timestamp = event time in ms, and
headers ``ce_specversion``, ``ce_id``, ``ce_type``, ``ce_source``, ``ce_time``,
``content-type`` plus the extension attributes ``ce_idempotencykey``, ``ce_aggregatetype``,
``ce_aggregateid``, ``ce_aggregateversion`` and the event's own headers (``traceparent``).
Source: CloudEvents Kafka Protocol Binding 1.0, section 3.2 (binary content mode).
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from ledgerbox._core.names import (
    CONTENT_TYPE,
    H_AGG_ID,
    H_AGG_TYPE,
    H_AGG_VERSION,
    H_CONTENT_TYPE,
    H_ID,
    H_KEY,
    H_SOURCE,
    H_SPEC,
    H_TIME,
    H_TYPE,
    KNOWN_HEADERS,
)
from ledgerbox.outbox._envelope import EventEnvelope, one_line
from ledgerbox.outbox._errors import EnvelopeParseError

__all__ = [
    "CONTENT_TYPE",
    "envelope_from_kafka",
    "envelope_headers",
    "kafka_headers",
    "timestamp_ms",
]

_SPEC_VERSION = b"1.0"
_CONTENT_TYPE_BYTES = CONTENT_TYPE.encode()


def kafka_headers(
    *,
    event_id: uuid.UUID | str,
    event_type: str,
    source: str,
    occurred_at: dt.datetime,
    idempotency_key: str,
    aggregate_type: str,
    aggregate_id: str,
    aggregate_version: int | None,
    extra: Mapping[str, str] | None = None,
) -> list[tuple[str, bytes]]:
    """Kafka headers (``str`` keys, ``bytes`` values) for one event."""
    headers = [
        (H_SPEC, _SPEC_VERSION),
        (H_ID, str(event_id).encode()),
        (H_TYPE, event_type.encode()),
        (H_SOURCE, source.encode()),
        (H_TIME, occurred_at.isoformat().encode()),
        (H_CONTENT_TYPE, _CONTENT_TYPE_BYTES),
        (H_KEY, idempotency_key.encode()),
        (H_AGG_TYPE, aggregate_type.encode()),
        (H_AGG_ID, aggregate_id.encode()),
    ]
    if aggregate_version is not None:
        headers.append((H_AGG_VERSION, str(aggregate_version).encode()))
    if extra:
        headers.extend((k, v.encode()) for k, v in extra.items() if k not in KNOWN_HEADERS)
    return headers


def envelope_headers(event: EventEnvelope) -> list[tuple[str, bytes]]:
    """:func:`kafka_headers` of ``event``: the headers the relay writes for it."""
    return kafka_headers(
        event_id=event.event_id,
        event_type=event.event_type,
        source=event.source,
        occurred_at=event.occurred_at,
        idempotency_key=event.idempotency_key,
        aggregate_type=event.aggregate_type,
        aggregate_id=event.aggregate_id,
        aggregate_version=event.aggregate_version,
        extra=event.headers,
    )


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_ONE_MS = dt.timedelta(milliseconds=1)


def timestamp_ms(occurred_at: dt.datetime) -> int:
    """Kafka record timestamp of an aware event time: whole milliseconds since the Unix epoch,
    rounded toward the past (sub-millisecond digits dropped).

    Integer arithmetic on the ``timedelta``, exact over the whole ``datetime`` range; a float
    multiply (``timestamp() * 1000``) is 1 ms early for exact-millisecond times outside
    roughly 2004-2038. The relay computes the same value in SQL.
    """
    return (occurred_at - _EPOCH) // _ONE_MS


def envelope_from_kafka(
    topic: str,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[tuple[str, bytes]],
) -> EventEnvelope:
    """Parse a Kafka record written by the relay back into an :class:`EventEnvelope`.

    Raises
    ------
    EnvelopeParseError
        The value is not a JSON object, a required CloudEvents header is missing, or a
        field is invalid. The message says which.
    """
    try:
        found: dict[str, str] = {k: v.decode("utf-8") for k, v in headers}
    except (UnicodeDecodeError, AttributeError) as exc:
        raise EnvelopeParseError(f"headers are not UTF-8 text: {exc}") from exc
    if value is None:
        raise EnvelopeParseError("record has no value (tombstone)")
    try:
        payload: Any = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EnvelopeParseError(f"value is not JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise EnvelopeParseError(f"value is JSON {type(payload).__name__}, expected an object")
    missing = [h for h in (H_ID, H_TYPE, H_SOURCE, H_TIME, H_KEY) if h not in found]
    if missing:
        raise EnvelopeParseError(f"missing CloudEvents headers: {', '.join(missing)}")
    if found.get(H_SPEC, "1.0") != "1.0":
        raise EnvelopeParseError(f"unsupported ce_specversion {found[H_SPEC]!r}")
    try:
        partition_key = key.decode("utf-8") if key is not None else found.get(H_AGG_ID, "")
        version = found.get(H_AGG_VERSION)
        return EventEnvelope(
            event_id=uuid.UUID(found[H_ID]),
            idempotency_key=found[H_KEY],
            event_type=found[H_TYPE],
            topic=topic,
            partition_key=partition_key,
            source=found[H_SOURCE],
            aggregate_type=found.get(H_AGG_TYPE, "unknown"),
            aggregate_id=found.get(H_AGG_ID, partition_key),
            aggregate_version=int(version) if version is not None else None,
            occurred_at=dt.datetime.fromisoformat(found[H_TIME]),
            payload=payload,
            headers={k: v for k, v in found.items() if k not in KNOWN_HEADERS},
        )
    except (ValueError, ValidationError, UnicodeDecodeError) as exc:
        detail = one_line(exc) if isinstance(exc, ValidationError) else str(exc)
        raise EnvelopeParseError(f"invalid event fields: {detail}") from exc
