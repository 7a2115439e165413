"""The demo's async HTTP load generator: wallets, orders, retries with the same key.

Requests go through :class:`example_services._client.HttpPool` (lean keep-alive HTTP/1.1, a
few hundred us of CPU per request instead of httpx's ~4 ms, so the generator does not take
the services' CPU).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from example_services._client import HttpError, HttpPool
from example_services.demo.checker import RequestRecord

__all__ = [
    "LoadStats",
    "OrderPlan",
    "Progress",
    "place_orders",
    "plan_balances",
    "plan_orders",
    "top_up",
]

#: Transport errors and 5xx are retried with the SAME key, like any well-behaved client; 40
#: attempts (backoff capped at 2 s, ~75 s in all) outlast a PostgreSQL restart also on a
#: loaded machine (12 attempts, ~17 s, gave up on 16 of 300 orders while tests ran beside it).
MAX_ATTEMPTS = 40
_CENT = Decimal("0.01")


@dataclass(frozen=True)
class OrderPlan:
    """One order the generator will place; ``retry``: send it twice with the same key."""

    key: str
    customer_id: str
    amount: Decimal
    retry: bool


@dataclass
class Progress:
    """Orders finished so far (answered or abandoned); the fault scheduler waits on it."""

    total: int
    done: int = 0
    _waiters: list[tuple[float, asyncio.Event]] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return 1.0 if self.total == 0 else self.done / self.total

    def advance(self) -> None:
        """One more order finished."""
        self.done += 1
        for threshold, event in self._waiters:
            if self.fraction >= threshold:
                event.set()

    async def reached(self, fraction: float) -> None:
        """Return once ``fraction`` (0..1) of the orders finished."""
        if self.fraction >= fraction:
            return
        event = asyncio.Event()
        self._waiters.append((fraction, event))
        await event.wait()

    def finish(self) -> None:
        """Release every waiter (the load ended early, e.g. ``--duration-s``)."""
        self.done = max(self.done, self.total)
        for _, event in self._waiters:
            event.set()


@dataclass
class LoadStats:
    """What the load generator did."""

    requests: list[RequestRecord] = field(default_factory=list)
    posts: int = 0
    transport_errors: int = 0
    server_errors: int = 0
    client_errors: int = 0
    same_key_retries: int = 0
    replayed_200: int = 0
    skipped_by_deadline: int = 0
    topups: int = 0
    topup_replays: int = 0
    elapsed_s: float = 0.0


def customer_ids(count: int) -> list[str]:
    return [f"c{index:03d}" for index in range(count)]


def plan_orders(
    rng: random.Random, orders: int, customers: Sequence[str], retry_fraction: float
) -> list[OrderPlan]:
    """Random orders: uniform customer, amount 5.00..60.00; ``retry_fraction`` sent twice."""
    return [
        OrderPlan(
            key=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            customer_id=rng.choice(list(customers)),
            amount=Decimal(rng.randint(500, 6000)) * _CENT,
            retry=rng.random() < retry_fraction,
        )
        for _ in range(orders)
    ]


def plan_balances(
    rng: random.Random, plans: Sequence[OrderPlan], customers: Sequence[str]
) -> dict[str, Decimal]:
    """Initial top-up per customer: 30..130% of what their orders cost, so some run dry."""
    spend: dict[str, Decimal] = defaultdict(Decimal)
    for plan in plans:
        spend[plan.customer_id] += plan.amount
    balances = {}
    for customer in customers:
        share = Decimal(rng.randint(30, 130)) / 100
        balances[customer] = max(Decimal("10.00"), (spend[customer] * share).quantize(_CENT))
    return balances


async def _post(
    client: HttpPool, path: str, key: str, body: dict[str, str], stats: LoadStats
) -> tuple[int, Any] | None:
    """POST with retries on transport errors and 5xx (same key): ``(status, JSON answer)``,
    ``None`` if every attempt failed."""
    for attempt in range(MAX_ATTEMPTS):
        if attempt:
            stats.same_key_retries += 1
            await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
        try:
            status, answer = await client.request("POST", path, body, {"Idempotency-Key": key})
        except HttpError:
            stats.transport_errors += 1
            continue
        if status >= 500:
            stats.server_errors += 1
            continue
        return status, answer
    return None


async def top_up(
    client: HttpPool,
    customer_id: str,
    amount: Decimal,
    key: str,
    stats: LoadStats,
    *,
    replay: bool = False,
) -> None:
    """Top a wallet up (``client``: the payment API); with ``replay`` send the same request
    again (must be a no-op)."""
    path = f"/wallets/{customer_id}/top-up"
    for attempt in range(2 if replay else 1):
        answer = await _post(client, path, key, {"amount": str(amount)}, stats)
        if answer is None or answer[0] not in (200, 201):
            detail = "no answer" if answer is None else f"{answer[0]} {answer[1]}"
            raise RuntimeError(f"top-up of {customer_id} failed: {detail}")
        if attempt == 0:
            stats.topups += 1
        elif answer[0] == 200:
            stats.topup_replays += 1


async def _place_one(client: HttpPool, plan: OrderPlan, stats: LoadStats) -> None:
    body = {"customer_id": plan.customer_id, "amount": str(plan.amount), "currency": "EUR"}
    for retry in (False, True) if plan.retry else (False,):
        stats.posts += 1
        answer = await _post(client, "/orders", plan.key, body, stats)
        if answer is None:
            stats.requests.append(RequestRecord(plan.key, None, 0, retry))
            return
        status, order = answer
        if status >= 400:
            stats.client_errors += 1
        order_id = None
        if status in (200, 201):
            order_id = uuid.UUID(order["id"])
        if retry and status == 200:
            stats.replayed_200 += 1
        stats.requests.append(RequestRecord(plan.key, order_id, status, retry))


async def place_orders(
    client: HttpPool,
    plans: Sequence[OrderPlan],
    *,
    concurrency: int,
    progress: Progress,
    stats: LoadStats,
    duration_s: float | None = None,
) -> None:
    """Place ``plans`` (``client``: the order API) with ``concurrency`` workers; stop starting
    new ones after ``duration_s``."""
    queue: asyncio.Queue[OrderPlan] = asyncio.Queue()
    for plan in plans:
        queue.put_nowait(plan)
    started = time.monotonic()

    async def worker() -> None:
        while True:
            try:
                plan = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            if duration_s is not None and time.monotonic() - started > duration_s:
                stats.skipped_by_deadline += 1
            else:
                await _place_one(client, plan, stats)
            progress.advance()

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    progress.finish()
    stats.elapsed_s = time.monotonic() - started
