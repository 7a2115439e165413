"""Invariant checker of the demo: pure functions over rows, plus the part that reads them.

Every ``check_*`` function is pure (rows in, :class:`InvariantResult` out) so that unit tests
can plant a violation in hand-made rows; :func:`read_snapshot` reads the rows from the two
service databases; :func:`check_all` runs every check.

Invariants (names as reported):

``orders_final``                every order is PAID or CANCELLED
``orders_match_requests``       one order per accepted request key, none extra, none lost
``retries_returned_first``      a retried POST (same key) answered the first order, 200
``one_payment_per_order``       exactly one payment per order, none for unknown orders
``order_matches_payment``       PAID <=> SUCCEEDED, CANCELLED <=> FAILED, same amount
``wallet_balance_reconciles``   per customer: top-ups - successful payments = balance
``balance_never_negative``      no wallet balance, and no balance after a payment, below 0
``no_order_moved_backwards``    only PENDING -> PAID / CANCELLED ever applied
``events_applied_in_order``     per order: OrderPlaced first, versions chain without gaps,
                                the last applied state is the order's state
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from itertools import pairwise
from typing import Any

__all__ = [
    "AppliedRow",
    "InvariantResult",
    "OrderRow",
    "PaymentRow",
    "RequestRecord",
    "Snapshot",
    "TopUpRow",
    "WalletRow",
    "check_all",
    "check_balance_never_negative",
    "check_events_applied_in_order",
    "check_no_order_moved_backwards",
    "check_one_payment_per_order",
    "check_order_matches_payment",
    "check_orders_final",
    "check_orders_match_requests",
    "check_retries_returned_first",
    "check_wallet_balance_reconciles",
    "latencies_ms",
    "percentile",
    "read_snapshot",
]

#: At most this many example violations are kept per invariant (the count is exact).
MAX_EXAMPLES = 10

FINAL = frozenset({"PAID", "CANCELLED"})
LEGAL_TRANSITIONS = frozenset({(None, "PENDING"), ("PENDING", "PAID"), ("PENDING", "CANCELLED")})
RESULT_OF_PAYMENT = {"SUCCEEDED": "PAID", "FAILED": "CANCELLED"}


@dataclass(frozen=True)
class OrderRow:
    id: uuid.UUID
    customer_id: str
    amount: Decimal
    status: str
    version: int
    created_at: dt.datetime | None = None
    closed_at: dt.datetime | None = None


@dataclass(frozen=True)
class AppliedRow:
    """One row of ``order_events_applied``; ``id`` is the application order."""

    id: int
    order_id: uuid.UUID
    event_id: uuid.UUID
    event_type: str
    from_status: str | None
    to_status: str
    version_before: int
    version_after: int
    outcome: str


@dataclass(frozen=True)
class PaymentRow:
    order_id: uuid.UUID
    customer_id: str
    amount: Decimal
    status: str
    balance_after: Decimal | None = None


@dataclass(frozen=True)
class TopUpRow:
    customer_id: str
    amount: Decimal


@dataclass(frozen=True)
class WalletRow:
    customer_id: str
    balance: Decimal


@dataclass(frozen=True)
class RequestRecord:
    """What the load generator saw for one POST /orders (first try or a retry)."""

    key: str
    order_id: uuid.UUID | None
    status_code: int
    retry: bool


@dataclass
class Snapshot:
    """All rows the checks read, from both databases."""

    orders: list[OrderRow] = field(default_factory=list)
    applied: list[AppliedRow] = field(default_factory=list)
    payments: list[PaymentRow] = field(default_factory=list)
    topups: list[TopUpRow] = field(default_factory=list)
    wallets: list[WalletRow] = field(default_factory=list)


@dataclass
class InvariantResult:
    """Outcome of one invariant: ``violations`` counts them, ``examples`` shows a few."""

    name: str
    checked: int
    violations: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.violations == 0

    def fail(self, message: str) -> None:
        self.violations += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(message)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


# ------------------------------------------------------------------------------ pure checks


def check_orders_final(orders: Sequence[OrderRow]) -> InvariantResult:
    result = InvariantResult("orders_final", len(orders))
    for order in orders:
        if order.status not in FINAL:
            result.fail(f"order {order.id} is {order.status}")
    return result


def check_orders_match_requests(
    orders: Sequence[OrderRow], requests: Sequence[RequestRecord]
) -> InvariantResult:
    """Each key answered 200/201 maps to one existing order; the DB holds no other order."""
    result = InvariantResult("orders_match_requests", len(orders))
    by_key: dict[str, set[uuid.UUID]] = defaultdict(set)
    for req in requests:
        if req.order_id is not None and req.status_code in (200, 201):
            by_key[req.key].add(req.order_id)
    known = {order.id for order in orders}
    expected: set[uuid.UUID] = set()
    for key, ids in by_key.items():
        if len(ids) != 1:
            result.fail(f"key {key} answered {len(ids)} different orders")
        expected |= ids
    for missing in sorted(expected - known):
        result.fail(f"order {missing} was acknowledged but is not in the database")
    for extra in sorted(known - expected):
        result.fail(f"order {extra} is in the database but no request created it")
    return result


def check_retries_returned_first(requests: Sequence[RequestRecord]) -> InvariantResult:
    """A retry after a committed first try gets 200 and the first try's order."""
    firsts = {r.key: r for r in requests if not r.retry and r.status_code == 201}
    retries = [r for r in requests if r.retry and r.key in firsts]
    result = InvariantResult("retries_returned_first", len(retries))
    for retry in retries:
        first = firsts[retry.key]
        if retry.status_code != 200 or retry.order_id != first.order_id:
            result.fail(
                f"retry of key {retry.key}: HTTP {retry.status_code} order {retry.order_id}, "
                f"first was 201 order {first.order_id}"
            )
    return result


def check_one_payment_per_order(
    orders: Sequence[OrderRow], payments: Sequence[PaymentRow]
) -> InvariantResult:
    result = InvariantResult("one_payment_per_order", len(orders))
    count: dict[uuid.UUID, int] = defaultdict(int)
    for payment in payments:
        count[payment.order_id] += 1
    ids = {order.id for order in orders}
    for order in orders:
        if count[order.id] != 1:
            result.fail(f"order {order.id} has {count[order.id]} payments")
    for order_id in sorted(set(count) - ids):
        result.fail(f"payment for unknown order {order_id}")
    return result


def check_order_matches_payment(
    orders: Sequence[OrderRow], payments: Sequence[PaymentRow]
) -> InvariantResult:
    result = InvariantResult("order_matches_payment", len(orders))
    by_order = {p.order_id: p for p in payments}
    for order in orders:
        payment = by_order.get(order.id)
        if payment is None or order.status not in FINAL:
            continue  # reported by one_payment_per_order / orders_final
        if RESULT_OF_PAYMENT.get(payment.status) != order.status:
            result.fail(f"order {order.id} is {order.status} but its payment {payment.status}")
        if payment.amount != order.amount or payment.customer_id != order.customer_id:
            result.fail(f"order {order.id}: payment amount/customer differ from the order")
    return result


def check_wallet_balance_reconciles(
    wallets: Sequence[WalletRow], topups: Sequence[TopUpRow], payments: Sequence[PaymentRow]
) -> InvariantResult:
    """Initial balance (0: wallets are created by their first top-up) + top-ups - paid = now."""
    expected: dict[str, Decimal] = defaultdict(Decimal)
    for topup in topups:
        expected[topup.customer_id] += topup.amount
    for payment in payments:
        if payment.status == "SUCCEEDED":
            expected[payment.customer_id] -= payment.amount
    actual = {w.customer_id: w.balance for w in wallets}
    customers = sorted(set(expected) | set(actual))
    result = InvariantResult("wallet_balance_reconciles", len(customers))
    for customer in customers:
        want, have = expected.get(customer, Decimal(0)), actual.get(customer, Decimal(0))
        if want != have:
            result.fail(
                f"customer {customer}: top-ups - successful payments = {want}, balance = {have} "
                f"(difference {have - want})"
            )
    return result


def check_balance_never_negative(
    wallets: Sequence[WalletRow], payments: Sequence[PaymentRow]
) -> InvariantResult:
    result = InvariantResult("balance_never_negative", len(wallets) + len(payments))
    for wallet in wallets:
        if wallet.balance < 0:
            result.fail(f"customer {wallet.customer_id} balance {wallet.balance}")
    for payment in payments:
        if payment.balance_after is not None and payment.balance_after < 0:
            result.fail(f"payment of order {payment.order_id} left balance {payment.balance_after}")
    return result


def check_no_order_moved_backwards(applied: Sequence[AppliedRow]) -> InvariantResult:
    result = InvariantResult("no_order_moved_backwards", len(applied))
    for row in applied:
        if row.outcome == "ignored":
            if row.from_status != row.to_status or row.version_before != row.version_after:
                result.fail(f"order {row.order_id}: ignored event {row.event_id} changed state")
        elif (row.from_status, row.to_status) not in LEGAL_TRANSITIONS:
            result.fail(
                f"order {row.order_id}: illegal transition {row.from_status} -> {row.to_status} "
                f"by {row.event_type} {row.event_id}"
            )
    return result


def check_events_applied_in_order(
    orders: Sequence[OrderRow], applied: Sequence[AppliedRow]
) -> InvariantResult:
    result = InvariantResult("events_applied_in_order", len(orders))
    history: dict[uuid.UUID, list[AppliedRow]] = defaultdict(list)
    for row in sorted(applied, key=lambda r: r.id):
        history[row.order_id].append(row)
    for order in orders:
        rows = history.get(order.id, [])
        if not rows or rows[0].event_type != "OrderPlaced" or rows[0].version_before != 0:
            result.fail(f"order {order.id}: history does not start with OrderPlaced at v0")
            continue
        seen: set[uuid.UUID] = set()
        for prev, row in pairwise(rows):
            if row.version_before != prev.version_after or row.from_status != prev.to_status:
                result.fail(
                    f"order {order.id}: {row.event_type} applied at v{row.version_before} "
                    f"({row.from_status}) after v{prev.version_after} ({prev.to_status})"
                )
        for row in rows:
            if row.event_id in seen:
                result.fail(f"order {order.id}: event {row.event_id} applied twice")
            seen.add(row.event_id)
            step = row.version_after - row.version_before
            if step != (1 if row.outcome == "applied" else 0):
                result.fail(f"order {order.id}: {row.outcome} event moved version by {step}")
        last = rows[-1]
        if (last.to_status, last.version_after) != (order.status, order.version):
            result.fail(
                f"order {order.id} is {order.status} v{order.version} but its history ends at "
                f"{last.to_status} v{last.version_after}"
            )
    return result


def check_all(
    snapshot: Snapshot, requests: Sequence[RequestRecord] | None = None
) -> list[InvariantResult]:
    """Run every check; the request-based ones only when ``requests`` is given."""
    s = snapshot
    results = [
        check_orders_final(s.orders),
        check_one_payment_per_order(s.orders, s.payments),
        check_order_matches_payment(s.orders, s.payments),
        check_wallet_balance_reconciles(s.wallets, s.topups, s.payments),
        check_balance_never_negative(s.wallets, s.payments),
        check_no_order_moved_backwards(s.applied),
        check_events_applied_in_order(s.orders, s.applied),
    ]
    if requests is not None:
        results.insert(1, check_orders_match_requests(s.orders, requests))
        results.insert(2, check_retries_returned_first(requests))
    return results


# ------------------------------------------------------------------------------ latency


def latencies_ms(orders: Iterable[OrderRow]) -> list[float]:
    """Commit-to-applied latency per closed order: ``closed_at - created_at`` in ms.

    Both stamps come from the database clock (``now()`` of the placing transaction,
    ``clock_timestamp()`` in the consumer transaction that closed the order).
    """
    return sorted(
        (o.closed_at - o.created_at).total_seconds() * 1000.0
        for o in orders
        if o.closed_at is not None and o.created_at is not None
    )


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of already sorted values; ``None`` if empty."""
    if not sorted_values:
        return None
    rank = max(1, min(len(sorted_values), round(q / 100.0 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


# ------------------------------------------------------------------------------ reading


def _rows(url: str, sql: str, build: Callable[[Mapping[str, Any]], Any]) -> list[Any]:
    import sqlalchemy as sa
    from sqlalchemy.pool import NullPool

    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return [build(dict(row)) for row in conn.execute(sa.text(sql)).mappings()]
    finally:
        engine.dispose()


def read_snapshot(order_db_url: str, payment_db_url: str) -> Snapshot:
    """Read every row the checks need from the order and payment databases."""
    return Snapshot(
        orders=_rows(
            order_db_url,
            "SELECT id, customer_id, amount, status, version, created_at, closed_at FROM orders",
            lambda r: OrderRow(**r),
        ),
        applied=_rows(
            order_db_url,
            "SELECT id, order_id, event_id, event_type, from_status, to_status, version_before,"
            " version_after, outcome FROM order_events_applied",
            lambda r: AppliedRow(**r),
        ),
        payments=_rows(
            payment_db_url,
            "SELECT order_id, customer_id, amount, status, balance_after FROM payments",
            lambda r: PaymentRow(**r),
        ),
        topups=_rows(
            payment_db_url,
            "SELECT customer_id, amount FROM wallet_topups",
            lambda r: TopUpRow(**r),
        ),
        wallets=_rows(
            payment_db_url, "SELECT customer_id, balance FROM wallets", lambda r: WalletRow(**r)
        ),
    )
