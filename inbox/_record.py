"""A Kafka record as the consumer sees it: its fields, its parse, and giving up on it.

A record's processing may be *abandoned* (its partition was revoked or the consumer stops
while it waits to retry): :class:`Abandon` unwinds the pipeline and the record's offset is not
committed, so the partition's next owner reads it again.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

from ledgerbox._core.stop import cancel_unawaited
from ledgerbox.outbox import EnvelopeParseError, EventEnvelope, envelope_from_kafka

__all__ = [
    "Abandon",
    "Parsed",
    "Record",
    "await_unless_abandoned",
    "never",
    "parse_record",
    "record_identity",
    "record_timestamp_ms",
    "sleep_unless_abandoned",
]

_T = TypeVar("_T")

#: A parsed record: its envelope, or why it could not be parsed (it is then dead-lettered).
Parsed = EventEnvelope | EnvelopeParseError


class Record(Protocol):
    """What the consumer reads from a Kafka record (``aiokafka.ConsumerRecord`` fits)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes]]: ...


def record_timestamp_ms(record: Record) -> int | None:
    """The record's Kafka timestamp in ms, or ``None`` when it has none (Kafka uses -1)."""
    stamp = getattr(record, "timestamp", None)
    return stamp if isinstance(stamp, int) and stamp >= 0 else None


def parse_record(record: Record) -> Parsed:
    """The record's envelope, or the :class:`outbox.EnvelopeParseError` saying why not.

    Parsed once per record; the error is returned rather than raised so that a batch can
    be parsed up front and each failure handled in offset order.
    """
    try:
        return envelope_from_kafka(
            record.topic, record.key, record.value, list(record.headers or ())
        )
    except EnvelopeParseError as exc:
        return exc


def record_identity(
    record: Record, event: EventEnvelope | None
) -> tuple[uuid.UUID | None, str | None]:
    """The event id and type of a record, read from the CloudEvents headers if unparsed.

    An unparseable record may still carry a readable ``ce_id``: its failure is then recorded
    in the inbox. ``(None, None)`` when there is no readable id. Undecodable bytes of an
    unparsed record's type become U+FFFD (a NUL stays: the store makes what it writes
    storable, :meth:`InboxStore.record_failure`).
    """
    if event is not None:
        return event.event_id, event.event_type
    found = dict(record.headers or ())
    try:
        event_id = uuid.UUID(found["ce_id"].decode())
    except (KeyError, ValueError, UnicodeDecodeError):
        return None, None
    event_type = found.get("ce_type")
    return event_id, event_type.decode("utf-8", "replace") if event_type else None


class Abandon(Exception):
    """The partition was revoked or the consumer stopped while a record waited to retry."""


def never() -> bool:
    """An ``abandon`` predicate that never gives up."""
    return False


async def sleep_unless_abandoned(delay_s: float, abandon: Callable[[], bool]) -> None:
    """Sleep ``delay_s`` seconds, polling ``abandon`` every 50 ms.

    Raises
    ------
    Abandon
        As soon as ``abandon()`` returns True.
    """
    deadline = time.monotonic() + delay_s
    while True:
        if abandon():
            raise Abandon()
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(left, 0.05))


async def await_unless_abandoned(
    awaitable: Awaitable[_T], abandon: Callable[[], bool], grace_s: float
) -> _T:
    """Await ``awaitable`` (a call to Kafka: a dead-letter send), polling ``abandon`` every
    50 ms; once ``abandon()`` returned True it may take at most ``grace_s`` seconds more.

    With Kafka up a send finishes within the grace and nothing is cut short; with the broker
    away it would wait out its request timeout (30 s by default) and hold a stop past the
    bound of ``ConsumerConfig.stop_timeout_s`` (docs/operations.md, "Stopping a daemon").

    Raises
    ------
    Abandon
        ``grace_s`` passed after ``abandon()`` turned True; ``awaitable`` is then cancelled
        (the record was perhaps stored anyway: it is delivered and dead-lettered again after
        the restart, as after a crash at that point).
    """
    task = asyncio.ensure_future(awaitable)
    give_up_at: float | None = None
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.05)
            if done:
                return task.result()
            if give_up_at is None:
                if abandon():
                    give_up_at = time.monotonic() + grace_s
            elif time.monotonic() >= give_up_at:
                raise Abandon()
    finally:
        cancel_unawaited(task)
