"""The soak's observer: a sample per second, a progress line every 10 s, checks on the way.

Samples come from the service databases over direct connections (never through the fault
proxy: the observer must see through the faults it watches). A sample that fails (the
database is restarting) is recorded as missing, not as zero. Every ``progress_every_s``:
consumer lag from the brokers' own listener (best effort, bounded), the online checks, and
one line on stdout::

    [soak   120.0s] orders 2400 (+201, 20.1/s) closed 2380 | backlog 20 oldest 1.2 s outbox 3/1
    lag 5/0 | faults 14 done 3 active: broker-stall,net-latency | invariants 3/3 ok

Online checks (cheap SQL on one snapshot each, plus the load's own records):
``wallet_balance_reconciles`` (sums per customer), ``no_order_moved_backwards`` (illegal
transitions), ``retries_returned_first`` (the planned HTTP retries so far).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg

from example_services.demo.checker import check_retries_returned_first
from example_services.soak.load import LoadStats
from ledgerbox import DatabaseError
from ledgerbox.admin import Database, relay_status

__all__ = ["Monitor", "Sample"]

_ORDERS = (
    "SELECT count(*), count(*) FILTER (WHERE status = 'PENDING'),"
    " extract(epoch FROM min(created_at) FILTER (WHERE status = 'PENDING'))"
    " FROM orders"
)
_WALLET_MISMATCHES = """
SELECT count(*) FROM (
  SELECT w.customer_id, w.balance,
         coalesce((SELECT sum(t.amount) FROM wallet_topups t
                   WHERE t.customer_id = w.customer_id), 0)
         - coalesce((SELECT sum(p.amount) FROM payments p
                     WHERE p.customer_id = w.customer_id AND p.status = 'SUCCEEDED'), 0) AS want
  FROM wallets w) s
WHERE balance <> want
"""
_ILLEGAL_TRANSITIONS = """
SELECT count(*) FROM order_events_applied
WHERE (outcome = 'applied' AND (coalesce(from_status, '-'), to_status) NOT IN
        (('-', 'PENDING'), ('PENDING', 'PAID'), ('PENDING', 'CANCELLED')))
   OR (outcome = 'ignored' AND (from_status IS DISTINCT FROM to_status
                                OR version_before <> version_after))
"""


@dataclass
class Sample:
    """One observation; ``t`` is wall-clock epoch seconds, ``None`` = could not be read."""

    t: float
    orders: int | None = None
    pending: int | None = None
    oldest_pending_age_s: float | None = None
    outbox_order: int | None = None
    outbox_payment: int | None = None
    lag_payment_group: int | None = None
    lag_order_group: int | None = None
    active_faults: int = 0
    http_ms_p50: float | None = None


@dataclass
class Monitor:
    order_dsn: str
    payment_dsn: str
    order_url: str  # SQLAlchemy URLs of the same databases (ledgerbox.admin.relay_status)
    payment_url: str
    stats: LoadStats
    active_faults: Callable[[], list[str]]
    faults_done: Callable[[], int]
    lag: Callable[[], Any]  # async () -> (payment group lag, order group lag)
    t0_wall: float
    log: Callable[[str], None]
    interval_s: float = 1.0
    progress_every_s: float = 10.0
    samples: list[Sample] = field(default_factory=list)
    online: dict[str, dict[str, int]] = field(default_factory=dict)
    _conns: dict[str, psycopg.AsyncConnection[Any]] = field(default_factory=dict)

    async def run(self, stop: asyncio.Event) -> None:
        """Sample until ``stop``."""
        last_progress = time.monotonic()
        last_orders = 0
        http_seen = 0
        while not stop.is_set():
            sample = Sample(time.time(), active_faults=len(self.active_faults()))
            await self._sample(sample)
            ms = self.stats.http_ms[http_seen:]
            http_seen += len(ms)
            if ms:
                sample.http_ms_p50 = sorted(ms)[len(ms) // 2]
            self.samples.append(sample)
            if time.monotonic() - last_progress >= self.progress_every_s:
                window = time.monotonic() - last_progress
                last_progress = time.monotonic()
                with contextlib.suppress(Exception):
                    sample.lag_payment_group, sample.lag_order_group = await asyncio.wait_for(
                        self.lag(), 5.0
                    )
                await self._online_checks()
                orders = sample.orders if sample.orders is not None else last_orders
                self.log(self._line(sample, orders - last_orders, window))
                last_orders = orders
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    async def aclose(self) -> None:
        for conn in self._conns.values():
            with contextlib.suppress(Exception):
                await conn.close()
        self._conns.clear()

    async def _query(self, name: str, dsn: str, sql: str) -> Sequence[Any] | None:
        try:
            conn = self._conns.get(name)
            if conn is None or conn.closed:
                conn = await psycopg.AsyncConnection.connect(
                    dsn, autocommit=True, connect_timeout=2, options="-c statement_timeout=5000"
                )
                self._conns[name] = conn
            row = await (await conn.execute(sql)).fetchone()
            return row
        except (psycopg.Error, OSError):
            bad = self._conns.pop(name, None)
            if bad is not None:
                with contextlib.suppress(Exception):
                    await bad.close()
            return None

    async def _sample(self, s: Sample) -> None:
        row = await self._query("order", self.order_dsn, _ORDERS)
        if row is not None:
            s.orders, s.pending = int(row[0]), int(row[1])
            s.oldest_pending_age_s = 0.0 if row[2] is None else max(0.0, s.t - float(row[2]))
        s.outbox_order = await self._pending_outbox(self.order_url)
        s.outbox_payment = await self._pending_outbox(self.payment_url)

    async def _pending_outbox(self, url: str) -> int | None:
        """The relay's own pending count (its shards' cursors: a published row keeps
        ``status = 0``), or ``None`` while the database cannot answer."""
        try:
            status = await asyncio.wait_for(relay_status(Database(url=url), held_limit=1), 3.0)
        except (DatabaseError, TimeoutError, OSError):
            return None
        return status.pending

    async def _online_checks(self) -> None:
        checks = {
            "wallet_balance_reconciles": ("payment", self.payment_dsn, _WALLET_MISMATCHES),
            "no_order_moved_backwards": ("order", self.order_dsn, _ILLEGAL_TRANSITIONS),
        }
        for name, (conn, dsn, sql) in checks.items():
            row = await self._query(conn, dsn, sql)
            entry = self.online.setdefault(name, {"checks": 0, "violations": 0, "unreadable": 0})
            if row is None:
                entry["unreadable"] += 1
                continue
            entry["checks"] += 1
            entry["violations"] = max(entry["violations"], int(row[0]))
        retries = check_retries_returned_first(self.stats.requests)
        self.online["retries_returned_first"] = {
            "checks": retries.checked,
            "violations": retries.violations,
            "unreadable": 0,
        }

    def _line(self, s: Sample, new_orders: int, window_s: float) -> str:
        ok = sum(1 for e in self.online.values() if not e["violations"])
        active = self.active_faults()
        closed = None if s.orders is None or s.pending is None else s.orders - s.pending
        return (
            f"orders {_n(s.orders)} (+{new_orders}, "
            f"{new_orders / window_s:.1f}/s) closed {_n(closed)} | backlog {_n(s.pending)} "
            f"oldest {_f(s.oldest_pending_age_s)} s outbox {_n(s.outbox_order)}/"
            f"{_n(s.outbox_payment)} lag {_n(s.lag_payment_group)}/{_n(s.lag_order_group)} | "
            f"faults {self.faults_done()} done {len(active)} active"
            f"{': ' + ','.join(active) if active else ''} | invariants {ok}/{len(self.online)} ok"
            f"{'' if ok == len(self.online) else ' VIOLATED: ' + self._violated()}"
            f" | http in flight {self.stats.in_flight} shed {self.stats.shed}"
        )

    def _violated(self) -> str:
        return ",".join(n for n, e in self.online.items() if e["violations"])

    def as_dicts(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in self.samples]


def _n(value: int | None) -> str:
    return "?" if value is None else str(value)


def _f(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"
