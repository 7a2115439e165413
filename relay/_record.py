"""The Kafka record of a claimed outbox row (no I/O)."""

from __future__ import annotations

import dataclasses
import json

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
from ledgerbox.relay._publisher import OutboundRecord
from ledgerbox.relay._store import ClaimedEvent

__all__ = ["restamped", "to_record"]

_SPEC = (H_SPEC, b"1.0")
_CONTENT_TYPE = (H_CONTENT_TYPE, CONTENT_TYPE.encode())

# Header tuples of the few values that repeat across rows (event type, source, aggregate
# type): one object each instead of one per record in flight (peak RSS with 8 lanes).
_REPEATED: dict[tuple[str, str], tuple[str, bytes]] = {}
_REPEATED_MAX = 4096


def _repeated(name: str, value: str) -> tuple[str, bytes]:
    found = _REPEATED.get((name, value))
    if found is None:
        if len(_REPEATED) >= _REPEATED_MAX:
            _REPEATED.clear()
        found = _REPEATED[(name, value)] = (name, value.encode())
    return found


def to_record(event: ClaimedEvent) -> OutboundRecord:
    """The Kafka record of a claimed row: key, payload JSON as stored, event time, headers.

    The headers are those of :func:`ledgerbox.outbox.kafka_headers` (same names, order and
    bytes), built from the text columns the claim pre-formats: only what varies per row is
    encoded. A test pins that both forms are byte-identical (docs/relay.md, "Per batch").

    Raises
    ------
    json.JSONDecodeError
        If the row's ``headers`` column is not JSON (the write path always writes JSON).
    """
    headers = [
        _SPEC,
        (H_ID, event.event_id.encode()),
        _repeated(H_TYPE, event.event_type),
        _repeated(H_SOURCE, event.source),
        (H_TIME, event.occurred_at_iso.encode()),
        _CONTENT_TYPE,
        (H_KEY, event.idempotency_key.encode()),
        _repeated(H_AGG_TYPE, event.aggregate_type),
        (H_AGG_ID, event.aggregate_id.encode()),
    ]
    if event.aggregate_version is not None:
        headers.append((H_AGG_VERSION, event.aggregate_version.encode()))
    if event.headers != "{}":
        extra: dict[str, str] = json.loads(event.headers)
        headers.extend((k, v.encode()) for k, v in extra.items() if k not in KNOWN_HEADERS)
    return OutboundRecord(
        topic=event.topic,
        key=event.partition_key.encode(),
        value=event.payload,
        timestamp_ms=event.occurred_at_ms,
        headers=headers,
    )


def restamped(record: OutboundRecord, now_s: float) -> OutboundRecord:
    """``record`` with the send time ``now_s`` (seconds since the epoch) as its timestamp,
    in whole ms; headers (``ce_time`` = the event time) unchanged. For a record the broker
    refused for its timestamp alone (C19)."""
    return dataclasses.replace(record, timestamp_ms=int(now_s * 1000))
