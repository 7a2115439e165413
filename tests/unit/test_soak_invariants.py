"""The soak's invariants: clean rows pass, each planted violation is caught and named."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from example_services.demo.checker import InvariantResult, OrderRow
from example_services.soak import invariants as inv
from example_services.soak.invariants import FaultSpan, KafkaRecord, OutboxRow, PaymentEffect

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
E0 = T0.timestamp()
ORDERS = [uuid.UUID(int=i) for i in range(1, 5)]  # orders
P = [uuid.UUID(int=100 + i) for i in range(1, 5)]  # OrderPlaced event ids
R = [uuid.UUID(int=200 + i) for i in range(1, 5)]  # payment-result event ids


@dataclass
class World:
    order_outbox: list[OutboxRow]
    payment_outbox: list[OutboxRow]
    orders_topic: list[KafkaRecord]
    payments_topic: list[KafkaRecord]
    effects: list[PaymentEffect]
    timings: dict[uuid.UUID, inv.Timing]
    applied: set[uuid.UUID]


def _world() -> World:
    """Customer x places orders 0, 1, 2 one after the other; all published, paid, applied."""
    order_outbox = [OutboxRow(P[i], "OrderPlaced", 1, "x", ORDERS[i]) for i in range(3)]
    payment_outbox = [
        OutboxRow(R[i], "PaymentSucceeded", 1, str(ORDERS[i]), ORDERS[i]) for i in range(3)
    ]
    orders_topic = [KafkaRecord(0, i, P[i], "OrderPlaced", "x", ORDERS[i]) for i in range(3)]
    payments_topic = [
        KafkaRecord(1, i, R[i], "PaymentSucceeded", str(ORDERS[i]), ORDERS[i]) for i in range(3)
    ]
    effects = [
        PaymentEffect(ORDERS[i], "x", P[i], T0 + dt.timedelta(seconds=10 + i)) for i in range(3)
    ]
    timings = {ORDERS[i]: inv.Timing(ORDERS[i], E0 + 2 * i, E0 + 2 * i + 1) for i in range(3)}
    return World(
        order_outbox, payment_outbox, orders_topic, payments_topic, effects, timings, set(R[:3])
    )


def _lost(w: World, **changes: Any) -> InvariantResult:
    w = replace(w, **changes)
    return inv.check_no_event_lost(
        w.order_outbox,
        w.payment_outbox,
        w.orders_topic,
        w.payments_topic,
        {e.event_id for e in w.effects},
        w.applied,
    )


def test_clean_world_passes_every_check() -> None:
    w = _world()
    assert _lost(w).ok
    one = inv.check_one_effect_per_event(
        w.order_outbox,
        w.payment_outbox,
        w.effects,
        R[:3],
    )
    assert one.ok and one.checked == 3
    assert inv.check_kafka_order_matches_commit_order(w.orders_topic, w.timings).ok
    assert inv.check_applied_in_kafka_order(w.orders_topic, w.effects).ok


def test_no_event_lost_names_the_stage_where_it_stopped() -> None:
    w = _world()
    # Under the snapshot cursor a published row keeps status 0: on its topic, it is fine.
    cursor = [replace(r, status=0) for r in w.order_outbox]
    assert _lost(w, order_outbox=cursor).ok
    dead = [OutboxRow(P[0], "OrderPlaced", 2, "x", ORDERS[0]), *cursor[1:]]
    assert "has outbox status 2" in _lost(w, order_outbox=dead).examples[0]
    held = [*cursor[:2], OutboxRow(P[2], "OrderPlaced", 3, "x", ORDERS[2])]
    assert "has outbox status 3" in _lost(w, order_outbox=held).examples[0]
    missing = w.orders_topic[1:]
    result = _lost(w, order_outbox=cursor, orders_topic=missing)
    assert result.violations == 1 and "committed but not on its topic" in result.examples[0]
    unpaid = w.effects[1:]
    result = _lost(w, effects=unpaid)
    assert not result.ok and "has no payment" in result.examples[0]
    result = _lost(w, applied=set(R[1:3]))
    assert result.violations == 1 and "no applied order event" in result.examples[0]


def test_one_effect_per_event_catches_a_double_payment_and_a_double_result() -> None:
    w = _world()
    effects = [*w.effects, PaymentEffect(ORDERS[0], "x", P[0], T0)]
    result = inv.check_one_effect_per_event(w.order_outbox, w.payment_outbox, effects, R[:3])
    assert result.violations == 1 and "2 payments" in result.examples[0]
    outbox = [*w.payment_outbox, OutboxRow(R[3], "PaymentFailed", 1, str(ORDERS[0]), ORDERS[0])]
    result = inv.check_one_effect_per_event(w.order_outbox, outbox, w.effects, [*R[:3], R[0]])
    assert result.violations == 2


def test_kafka_order_must_follow_commit_order_when_commits_did_not_overlap() -> None:
    w = _world()
    swapped = [
        KafkaRecord(0, 0, P[1], "OrderPlaced", "x", ORDERS[1]),
        KafkaRecord(0, 1, P[0], "OrderPlaced", "x", ORDERS[0]),
        KafkaRecord(0, 2, P[2], "OrderPlaced", "x", ORDERS[2]),
    ]
    result = inv.check_kafka_order_matches_commit_order(swapped, w.timings)
    assert result.violations == 1 and f"order {ORDERS[0]}" in result.examples[0]
    # Overlapping requests (the second sent before the first was answered) may go either way.
    overlapping = {
        ORDERS[0]: inv.Timing(ORDERS[0], E0, E0 + 5),
        ORDERS[1]: inv.Timing(ORDERS[1], E0 + 1, E0 + 2),
        ORDERS[2]: inv.Timing(ORDERS[2], E0 + 10, E0 + 11),
    }
    assert inv.check_kafka_order_matches_commit_order(swapped, overlapping).ok
    # A duplicate re-sent later does not count: the first offset is the event's position.
    dup = [*w.orders_topic, KafkaRecord(0, 3, P[0], "OrderPlaced", "x", ORDERS[0])]
    assert inv.check_kafka_order_matches_commit_order(dup, w.timings).ok


def test_payments_must_be_applied_in_partition_order() -> None:
    w = _world()
    effects = [
        PaymentEffect(ORDERS[0], "x", P[0], T0 + dt.timedelta(seconds=10)),
        PaymentEffect(ORDERS[1], "x", P[1], T0 + dt.timedelta(seconds=12)),
        PaymentEffect(ORDERS[2], "x", P[2], T0 + dt.timedelta(seconds=11)),
    ]
    result = inv.check_applied_in_kafka_order(w.orders_topic, effects)
    assert result.violations == 1 and f"order {ORDERS[1]}" in result.examples[0]


def _order(i: int, created_s: float, closed_s: float | None) -> OrderRow:
    closed = None if closed_s is None else T0 + dt.timedelta(seconds=closed_s)
    status = "PENDING" if closed is None else "PAID"
    return OrderRow(
        ORDERS[i], "x", Decimal(1), status, 2, T0 + dt.timedelta(seconds=created_s), closed
    )


def test_storms_merge_faults_closer_than_the_bound() -> None:
    spans = [
        FaultSpan(0, "a", E0 + 10, E0 + 20),
        FaultSpan(1, "b", E0 + 15, E0 + 30),
        FaultSpan(2, "c", E0 + 70, E0 + 75),  # 40 s after the first storm: joins with 60 s
        FaultSpan(3, "d", E0 + 200, E0 + 201),
    ]
    assert [[s.index for s in g] for g in inv.storms(spans, 60)] == [[0, 1, 2], [3]]
    assert [[s.index for s in g] for g in inv.storms(spans, 30)] == [[0, 1], [2], [3]]


def test_liveness_needs_every_earlier_order_closed_within_the_bound() -> None:
    spans = [FaultSpan(0, "broker-kill", E0 + 10, E0 + 20)]
    orders = [_order(0, 5, 50), _order(1, 15, 79), _order(2, 30, 31)]
    result = inv.check_liveness_after_faults(orders, spans, 60)
    assert result.ok and result.checked == 1
    assert inv.recovery_s(orders, E0 + 20) == 59
    late = [*orders[:2], _order(2, 19, 81)]
    result = inv.check_liveness_after_faults(late, spans, 60)
    assert result.violations == 1 and "1 order(s)" in result.examples[0]
    never = [*orders[:2], _order(2, 19, None)]
    result = inv.check_liveness_after_faults(never, spans, 60)
    assert not result.ok and "never closed" in result.examples[0]
    assert inv.recovery_s(never, E0 + 20) is None
