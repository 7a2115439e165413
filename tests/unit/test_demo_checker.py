"""The demo's invariant checker: clean rows pass, each planted violation is caught by name."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import replace
from decimal import Decimal

import pytest

from example_services.demo import checker
from example_services.demo._scrape import CounterScraper
from example_services.demo.checker import (
    AppliedRow,
    OrderRow,
    PaymentRow,
    RequestRecord,
    Snapshot,
    TopUpRow,
    WalletRow,
)
from example_services.orders._handlers import next_status
from example_services.orders._models import OrderStatus
from example_services.payments._handlers import decide
from example_services.payments._models import PaymentStatus

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
A, B, C = (uuid.UUID(int=i) for i in (1, 2, 3))


def _history(order_id: uuid.UUID, final: str, start_id: int) -> list[AppliedRow]:
    placed = AppliedRow(
        start_id, order_id, uuid.uuid4(), "OrderPlaced", None, "PENDING", 0, 1, "applied"
    )
    event = "PaymentSucceeded" if final == "PAID" else "PaymentFailed"
    result = AppliedRow(
        start_id + 1, order_id, uuid.uuid4(), event, "PENDING", final, 1, 2, "applied"
    )
    return [placed, result]


def clean() -> tuple[Snapshot, list[RequestRecord]]:
    """Customer x: top-up 100, pays A (30) and B (50), C (40) fails for lack of funds."""
    orders = [
        OrderRow(A, "x", Decimal("30.00"), "PAID", 2, T0, T0 + dt.timedelta(milliseconds=100)),
        OrderRow(B, "x", Decimal("50.00"), "PAID", 2, T0, T0 + dt.timedelta(milliseconds=300)),
        OrderRow(C, "x", Decimal("40.00"), "CANCELLED", 2, T0, T0 + dt.timedelta(seconds=1)),
    ]
    payments = [
        PaymentRow(A, "x", Decimal("30.00"), "SUCCEEDED", Decimal("70.00")),
        PaymentRow(B, "x", Decimal("50.00"), "SUCCEEDED", Decimal("20.00")),
        PaymentRow(C, "x", Decimal("40.00"), "FAILED", Decimal("20.00")),
    ]
    applied = _history(A, "PAID", 1) + _history(B, "PAID", 3) + _history(C, "CANCELLED", 5)
    snapshot = Snapshot(
        orders=orders,
        applied=applied,
        payments=payments,
        topups=[TopUpRow("x", Decimal("100.00"))],
        wallets=[WalletRow("x", Decimal("20.00"))],
    )
    requests = [
        RequestRecord("k1", A, 201, False),
        RequestRecord("k1", A, 200, True),
        RequestRecord("k2", B, 201, False),
        RequestRecord("k3", C, 201, False),
    ]
    return snapshot, requests


def failed(snapshot: Snapshot, requests: list[RequestRecord] | None = None) -> set[str]:
    return {r.name for r in checker.check_all(snapshot, requests) if not r.ok}


def test_clean_rows_hold_every_invariant() -> None:
    snapshot, requests = clean()
    results = checker.check_all(snapshot, requests)
    assert [r.name for r in results if not r.ok] == []
    assert {r.name for r in results} == {
        "orders_final",
        "orders_match_requests",
        "retries_returned_first",
        "one_payment_per_order",
        "order_matches_payment",
        "wallet_balance_reconciles",
        "balance_never_negative",
        "no_order_moved_backwards",
        "events_applied_in_order",
    }


def test_double_debit_is_caught_by_the_balance_reconciliation() -> None:
    snapshot, requests = clean()
    # The planted bug's effect: order A's amount debited twice, one payment row.
    snapshot.wallets = [WalletRow("x", Decimal("-10.00"))]
    result = checker.check_wallet_balance_reconciles(
        snapshot.wallets, snapshot.topups, snapshot.payments
    )
    assert result.violations == 1
    assert "difference -30.00" in result.examples[0]
    assert failed(snapshot, requests) == {"wallet_balance_reconciles", "balance_never_negative"}


def test_pending_order_is_caught() -> None:
    snapshot, _ = clean()
    snapshot.orders[2] = replace(snapshot.orders[2], status="PENDING", version=1)
    snapshot.applied = snapshot.applied[:-1]
    snapshot.payments = snapshot.payments[:2]
    assert "orders_final" in failed(snapshot)
    assert "one_payment_per_order" in failed(snapshot)


def test_second_payment_for_one_order_is_caught() -> None:
    snapshot, _ = clean()
    snapshot.payments.append(PaymentRow(A, "x", Decimal("30.00"), "SUCCEEDED", Decimal("-10")))
    assert {"one_payment_per_order", "wallet_balance_reconciles"} <= failed(snapshot)


def test_order_status_contradicting_its_payment_is_caught() -> None:
    snapshot, _ = clean()
    snapshot.payments[2] = replace(snapshot.payments[2], status="SUCCEEDED")
    assert "order_matches_payment" in failed(snapshot)


def test_negative_balance_after_a_payment_is_caught() -> None:
    snapshot, _ = clean()
    snapshot.payments[1] = replace(snapshot.payments[1], balance_after=Decimal("-0.01"))
    assert failed(snapshot) == {"balance_never_negative"}


def test_order_moving_backwards_is_caught() -> None:
    snapshot, _ = clean()
    back = AppliedRow(7, A, uuid.uuid4(), "PaymentFailed", "PAID", "CANCELLED", 2, 3, "applied")
    snapshot.applied.append(back)
    snapshot.orders[0] = replace(snapshot.orders[0], status="CANCELLED", version=3)
    result = checker.check_no_order_moved_backwards(snapshot.applied)
    assert result.violations == 1 and "PAID -> CANCELLED" in result.examples[0]


def test_ignored_late_event_is_legal_but_must_not_change_state() -> None:
    snapshot, _ = clean()
    late = AppliedRow(7, A, uuid.uuid4(), "PaymentFailed", "PAID", "PAID", 2, 2, "ignored")
    snapshot.applied.append(late)
    assert failed(snapshot) == set()
    snapshot.applied[-1] = replace(late, to_status="CANCELLED")
    assert "no_order_moved_backwards" in failed(snapshot)


def test_out_of_order_application_is_caught() -> None:
    snapshot, _ = clean()
    placed, paid = snapshot.applied[0], snapshot.applied[1]
    # The payment result applied before OrderPlaced: ids swapped.
    snapshot.applied[0], snapshot.applied[1] = replace(placed, id=2), replace(paid, id=1)
    assert "events_applied_in_order" in failed(snapshot)


def test_gap_in_versions_and_twice_applied_event_are_caught() -> None:
    snapshot, _ = clean()
    snapshot.applied[1] = replace(snapshot.applied[1], version_before=2, version_after=3)
    result = checker.check_events_applied_in_order(snapshot.orders, snapshot.applied)
    assert result.violations >= 1
    snapshot, _ = clean()
    again = replace(snapshot.applied[1], id=99, outcome="ignored", from_status="PAID")
    again = replace(again, version_before=2)
    snapshot.applied.append(again)
    result = checker.check_events_applied_in_order(snapshot.orders, snapshot.applied)
    assert any("applied twice" in e for e in result.examples)


def test_lost_and_extra_orders_and_bad_retries_are_caught() -> None:
    snapshot, requests = clean()
    lost = uuid.UUID(int=42)
    requests.append(RequestRecord("k4", lost, 201, False))
    assert "orders_match_requests" in failed(snapshot, requests)
    snapshot, requests = clean()
    requests = [r for r in requests if r.key != "k3"]  # C exists but nobody asked for it
    assert "orders_match_requests" in failed(snapshot, requests)
    snapshot, requests = clean()
    requests[1] = RequestRecord("k1", B, 201, True)  # a retry that created another order
    assert {"retries_returned_first", "orders_match_requests"} <= failed(snapshot, requests)


def test_examples_are_capped_but_the_count_is_exact() -> None:
    orders = [OrderRow(uuid.UUID(int=i), "x", Decimal(1), "PENDING", 1) for i in range(25)]
    result = checker.check_orders_final(orders)
    assert result.violations == 25 and len(result.examples) == checker.MAX_EXAMPLES
    assert result.as_dict()["ok"] is False


def test_latency_and_percentiles() -> None:
    snapshot, _ = clean()
    lat = checker.latencies_ms(snapshot.orders)
    assert lat == [100.0, 300.0, 1000.0]
    assert checker.percentile(lat, 50) == 300.0
    assert checker.percentile(lat, 99) == 1000.0
    assert checker.percentile([], 50) is None


@pytest.mark.parametrize(
    ("current", "event_type", "expected"),
    [
        (OrderStatus.PENDING, "PaymentSucceeded", OrderStatus.PAID),
        (OrderStatus.PENDING, "PaymentFailed", OrderStatus.CANCELLED),
        (OrderStatus.PAID, "PaymentFailed", None),
        (OrderStatus.CANCELLED, "PaymentSucceeded", None),
        (OrderStatus.PAID, "PaymentSucceeded", None),
        (OrderStatus.PENDING, "SomethingElse", None),
    ],
)
def test_order_state_machine_only_moves_pending(
    current: OrderStatus, event_type: str, expected: OrderStatus | None
) -> None:
    assert next_status(current, event_type) is expected


def test_payment_decision() -> None:
    assert decide(None, Decimal(1)) == (PaymentStatus.FAILED, "no wallet")
    assert decide(Decimal("0.99"), Decimal(1)) == (PaymentStatus.FAILED, "insufficient funds")
    assert decide(Decimal(1), Decimal(1)) == (PaymentStatus.SUCCEEDED, None)


def test_counter_scraper_sums_process_lifetimes() -> None:
    scraper = CounterScraper("unused", "ledgerbox_inbox_duplicates_total", "path")

    def page(redis: float, db: float) -> str:
        return (
            "# TYPE ledgerbox_inbox_duplicates counter\n"
            f'ledgerbox_inbox_duplicates_total{{group="g",path="redis"}} {redis}\n'
            f'ledgerbox_inbox_duplicates_total{{group="g",path="db"}} {db}\n'
        )

    scraper.update(page(3, 1))
    scraper.update(page(5, 2))
    scraper.update(page(1, 0))  # restarted
    assert scraper.totals() == {"db": 2, "redis": 6}


def test_public_names_are_pinned() -> None:
    import example_services
    import example_services.demo

    assert example_services.__all__ == []
    assert example_services.demo.__all__ == []
    assert "check_all" in checker.__all__ and "read_snapshot" in checker.__all__
