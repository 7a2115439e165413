"""The soak's invariants beyond the demo's (``example_services.demo.checker``).

Pure checks over rows (unit-tested with planted violations), and the readers that fetch the
rows: both outboxes, the payments with their database timestamps, and every record of both
topics read back from the brokers' own listener.

Invariants (names as reported):

``no_event_lost``                   every outbox event is on its topic (neither dead-lettered,
                                    held nor discarded: under the relay's snapshot cursor a
                                    published row keeps ``status = 0``), and its
                                    effect is in the consuming service (``OrderPlaced`` -> a
                                    payment made for that event id; a payment result -> an
                                    ``order_events_applied`` row for that event id)
``one_effect_per_event``            per ``OrderPlaced`` exactly one payment, per order exactly
                                    one payment-result event, per result at most one applied row
``kafka_order_matches_commit_order``  per customer (the partition key of ``OrderPlaced``): an
                                    order whose HTTP 2xx came back before another order was
                                    first sent (so it committed before the other began) is
                                    earlier in the partition (G3)
``applied_in_kafka_order``          per customer, the payment consumer applied ``OrderPlaced``
                                    in partition order (payments by database commit-time stamp
                                    follow the records' first offsets)
``liveness_after_faults``           faults are merged into storms (overlapping, or closer than
                                    the bound); ``bound_s`` after a storm ended every order
                                    created before its end is closed (PAID/CANCELLED)
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from example_services.demo.checker import InvariantResult, OrderRow
from ledgerbox.outbox import EventStatus

__all__ = [
    "FaultSpan",
    "KafkaRecord",
    "OutboxRow",
    "PaymentEffect",
    "check_applied_in_kafka_order",
    "check_kafka_order_matches_commit_order",
    "check_liveness_after_faults",
    "check_no_event_lost",
    "check_one_effect_per_event",
    "read_applied_event_ids",
    "read_outbox",
    "read_payment_effects",
    "read_topic",
    "recovery_s",
    "storms",
]

#: Outbox statuses of a row the relay sends (EventStatus.PENDING under the snapshot cursor,
#: PUBLISHED as schema v1 marked it); DEAD_LETTERED, HELD and DISCARDED rows are not sent.
SENDABLE = frozenset({EventStatus.PENDING, EventStatus.PUBLISHED})


@dataclass(frozen=True)
class OutboxRow:
    event_id: uuid.UUID
    event_type: str
    status: int
    partition_key: str
    order_id: uuid.UUID | None


@dataclass(frozen=True)
class KafkaRecord:
    partition: int
    offset: int
    event_id: uuid.UUID
    event_type: str
    key: str
    order_id: uuid.UUID | None


@dataclass(frozen=True)
class PaymentEffect:
    """A payment row: the ``OrderPlaced`` it answered and when it was written (DB clock)."""

    order_id: uuid.UUID
    customer_id: str
    event_id: uuid.UUID
    created_at: dt.datetime


@dataclass(frozen=True)
class FaultSpan:
    """When a fault disturbed the system (wall-clock epoch seconds)."""

    index: int
    kind: str
    started: float
    ended: float


@dataclass(frozen=True)
class Timing:
    """What the load generator saw for one order key (epoch seconds)."""

    order_id: uuid.UUID
    sent: float
    acked: float


# ------------------------------------------------------------------------------ pure checks


def check_no_event_lost(
    order_outbox: Sequence[OutboxRow],
    payment_outbox: Sequence[OutboxRow],
    orders_topic: Sequence[KafkaRecord],
    payments_topic: Sequence[KafkaRecord],
    payment_event_ids: set[uuid.UUID],
    applied_event_ids: set[uuid.UUID],
) -> InvariantResult:
    result = InvariantResult("no_event_lost", len(order_outbox) + len(payment_outbox))
    on_orders = {r.event_id for r in orders_topic}
    on_payments = {r.event_id for r in payments_topic}
    for rows, on_topic, effects, where in (
        (order_outbox, on_orders, payment_event_ids, "payment"),
        (payment_outbox, on_payments, applied_event_ids, "applied order event"),
    ):
        for row in rows:
            if row.status not in SENDABLE:
                result.fail(f"{row.event_type} {row.event_id} has outbox status {row.status}")
            elif row.event_id not in on_topic:
                result.fail(f"{row.event_type} {row.event_id} is committed but not on its topic")
            elif row.event_id not in effects:
                result.fail(f"{row.event_type} {row.event_id} is on Kafka but has no {where}")
    return result


def check_one_effect_per_event(
    order_outbox: Sequence[OutboxRow],
    payment_outbox: Sequence[OutboxRow],
    payments: Sequence[PaymentEffect],
    applied_event_ids: Sequence[uuid.UUID],
) -> InvariantResult:
    result = InvariantResult("one_effect_per_event", len(order_outbox))
    per_event: dict[uuid.UUID, int] = defaultdict(int)
    for payment in payments:
        per_event[payment.event_id] += 1
    for row in order_outbox:
        if per_event.get(row.event_id, 0) > 1:
            result.fail(f"OrderPlaced {row.event_id} has {per_event[row.event_id]} payments")
    results: dict[uuid.UUID, int] = defaultdict(int)
    for row in payment_outbox:
        if row.order_id is not None:
            results[row.order_id] += 1
    for order_id, n in sorted(results.items()):
        if n != 1:
            result.fail(f"order {order_id} has {n} payment-result events")
    applied: dict[uuid.UUID, int] = defaultdict(int)
    for event_id in applied_event_ids:
        applied[event_id] += 1
    for event_id, n in sorted(applied.items()):
        if n > 1:
            result.fail(f"event {event_id} applied {n} times to its order")
    return result


def _first_occurrences(records: Sequence[KafkaRecord]) -> dict[str, list[KafkaRecord]]:
    """Per key, the records in partition order, each event id once (its first offset)."""
    by_key: dict[str, list[KafkaRecord]] = defaultdict(list)
    seen: set[uuid.UUID] = set()
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        if record.event_id in seen:
            continue
        seen.add(record.event_id)
        by_key[record.key].append(record)
    return by_key


def check_kafka_order_matches_commit_order(
    orders_topic: Sequence[KafkaRecord], timings: Mapping[uuid.UUID, Timing]
) -> InvariantResult:
    by_key = _first_occurrences([r for r in orders_topic if r.event_type == "OrderPlaced"])
    result = InvariantResult("kafka_order_matches_commit_order", sum(map(len, by_key.values())))
    for key, records in by_key.items():
        seq = [
            (r, timings[r.order_id])
            for r in records
            if r.order_id is not None and r.order_id in timings
        ]
        # For each position, the earliest ack among the records AFTER it: an order acked
        # before this one was even sent must not come after it.
        later_min: tuple[float, KafkaRecord | None] = (float("inf"), None)
        for record, timing in reversed(seq):
            acked_before, later = later_min
            if later is not None and acked_before < timing.sent:
                result.fail(
                    f"customer {key}: order {later.order_id} (offset {later.offset}) committed "
                    f"{timing.sent - acked_before:.3f} s before order {record.order_id} was sent,"
                    f" but follows it (offset {record.offset}) in partition {record.partition}"
                )
            if timing.acked < acked_before:
                later_min = (timing.acked, record)
    return result


def check_applied_in_kafka_order(
    orders_topic: Sequence[KafkaRecord], payments: Sequence[PaymentEffect]
) -> InvariantResult:
    by_key = _first_occurrences([r for r in orders_topic if r.event_type == "OrderPlaced"])
    position = {r.event_id: (r.partition, r.offset) for rs in by_key.values() for r in rs}
    per_customer: dict[str, list[PaymentEffect]] = defaultdict(list)
    for payment in payments:
        per_customer[payment.customer_id].append(payment)
    result = InvariantResult("applied_in_kafka_order", len(payments))
    for customer, rows in per_customer.items():
        rows.sort(key=lambda p: p.created_at)
        for prev, row in itertools.pairwise(rows):
            a, b = position.get(prev.event_id), position.get(row.event_id)
            if a is not None and b is not None and b < a:
                result.fail(
                    f"customer {customer}: order {row.order_id} (offset {b[1]}) was paid after "
                    f"order {prev.order_id} (offset {a[1]}) but precedes it in partition {a[0]}"
                )
    return result


def storms(spans: Sequence[FaultSpan], bound_s: float) -> list[list[FaultSpan]]:
    """Faults grouped into storms: a fault starting less than ``bound_s`` after the running
    storm's end joins it."""
    groups: list[list[FaultSpan]] = []
    end = float("-inf")
    for span in sorted(spans, key=lambda s: s.started):
        if groups and span.started < end + bound_s:
            groups[-1].append(span)
            end = max(end, span.ended)
        else:
            groups.append([span])
            end = span.ended
    return groups


def recovery_s(orders: Sequence[OrderRow], at: float) -> float | None:
    """Seconds after ``at`` until every order created before ``at`` was closed (``None``: some
    never closed; 0: nothing was open)."""
    latest = at
    for order in orders:
        if order.created_at is None or order.created_at.timestamp() >= at:
            continue
        if order.closed_at is None:
            return None
        latest = max(latest, order.closed_at.timestamp())
    return latest - at


def check_liveness_after_faults(
    orders: Sequence[OrderRow], spans: Sequence[FaultSpan], bound_s: float
) -> InvariantResult:
    grouped = storms(spans, bound_s)
    result = InvariantResult("liveness_after_faults", len(grouped))
    for group in grouped:
        end = max(s.ended for s in group)
        took = recovery_s(orders, end)
        if took is None or took > bound_s:
            kinds = ",".join(f"#{s.index} {s.kind}" for s in group)
            late = sum(
                1
                for o in orders
                if o.created_at is not None
                and o.created_at.timestamp() < end
                and (o.closed_at is None or o.closed_at.timestamp() > end + bound_s)
            )
            result.fail(
                f"storm of {len(group)} fault(s) ({kinds[:200]}) ended at epoch {end:.1f}: "
                f"{late} order(s) created before it were not closed within {bound_s:g} s "
                f"({'some never closed' if took is None else f'all closed after {took:.1f} s'})"
            )
    return result


# ------------------------------------------------------------------------------ reading


def _rows(url: str, sql: str) -> list[Mapping[str, Any]]:
    import sqlalchemy as sa
    from sqlalchemy.pool import NullPool

    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return [dict(row) for row in conn.execute(sa.text(sql)).mappings()]
    finally:
        engine.dispose()


def read_outbox(url: str) -> list[OutboxRow]:
    """Every row of the service's outbox."""
    return [
        OutboxRow(
            r["event_id"],
            r["event_type"],
            int(r["status"]),
            r["partition_key"],
            uuid.UUID(r["order_id"]) if r["order_id"] else None,
        )
        for r in _rows(
            url,
            "SELECT event_id, event_type, status, partition_key, payload->>'order_id' AS order_id"
            " FROM outbox",
        )
    ]


def read_payment_effects(url: str) -> list[PaymentEffect]:
    return [
        PaymentEffect(r["order_id"], r["customer_id"], r["event_id"], r["created_at"])
        for r in _rows(url, "SELECT order_id, customer_id, event_id, created_at FROM payments")
    ]


def read_applied_event_ids(url: str) -> list[uuid.UUID]:
    return [r["event_id"] for r in _rows(url, "SELECT event_id FROM order_events_applied")]


@dataclass
class TopicRead:
    records: list[KafkaRecord] = field(default_factory=list)
    unparsable: int = 0


async def read_topic(bootstrap: str, topic: str, timeout_s: float = 300.0) -> TopicRead:
    """Every record of ``topic`` from the beginning to the end offsets seen at the start.

    Raises
    ------
    TimeoutError
        If the end is not reached within ``timeout_s``.
    """
    from aiokafka import AIOKafkaConsumer

    from example_services.demo._kafka import end_offsets
    from ledgerbox.outbox import EnvelopeParseError, envelope_from_kafka

    ends = await end_offsets(bootstrap, [topic])
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=4 * 1024 * 1024,
    )
    await consumer.start()
    out = TopicRead()
    try:
        tps = sorted(ends, key=lambda tp: tp.partition)
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + timeout_s
        remaining = {tp for tp in tps if ends[tp] > 0}
        while remaining:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} back took more than {timeout_s:g} s")
            batch = await consumer.getmany(timeout_ms=1000, max_records=5000)
            for tp, messages in batch.items():
                for m in messages:
                    if m.offset >= ends[tp]:
                        continue
                    try:
                        env = envelope_from_kafka(m.topic, m.key, m.value, list(m.headers))
                    except EnvelopeParseError:
                        out.unparsable += 1
                        continue
                    order_id = env.payload.get("order_id")
                    out.records.append(
                        KafkaRecord(
                            m.partition,
                            m.offset,
                            env.event_id,
                            env.event_type,
                            env.partition_key,
                            uuid.UUID(str(order_id)) if order_id else None,
                        )
                    )
            for tp in list(remaining):
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
            await asyncio.sleep(0)
    finally:
        await consumer.stop()
    return out
