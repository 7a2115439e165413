"""Steady HTTP load for the soak: a lean HTTP/1.1 client, orders at a fixed rate, top-ups.

The client is :class:`example_services._client.HttpPool` (keep-alive HTTP/1.1 over asyncio
streams; no httpx: at a few hundred requests per second httpx would cost the orchestrator more
CPU than the APIs it drives). Orders are sent open-loop at ``rate_per_s``: a request is
started on every tick whatever the previous ones do, up to ``max_in_flight``; a tick with no
free slot is counted as ``shed`` (the load generator, not the system, would then be the
limit; the report shows it).

Each order is retried with the SAME Idempotency-Key after a transport error or a 5xx, until it
is answered or ``give_up_s`` passed; a planned fraction is sent a second time after the first
answer (the retry must get 200 and the first order). What every attempt saw goes to
:class:`~example_services.demo.checker.RequestRecord` plus the wall-clock times the checks
need: ``sent`` (first attempt started, before the order's transaction began) and ``acked``
(first 2xx received, after it committed).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from example_services._client import HttpError, HttpPool
from example_services.demo.checker import RequestRecord

__all__ = ["HttpError", "HttpPool", "LoadStats", "OrderLoad", "OrderTiming"]

_CENT = Decimal("0.01")


@dataclass
class OrderTiming:
    """Wall-clock epoch seconds of one order key: first attempt sent, first 2xx received."""

    key: str
    customer_id: str
    sent: float
    acked: float | None = None
    order_id: uuid.UUID | None = None


@dataclass
class LoadStats:
    """Counters of the load generator (read by the progress line and the report)."""

    requests: list[RequestRecord] = field(default_factory=list)
    timings: dict[str, OrderTiming] = field(default_factory=dict)
    ticks: int = 0
    shed: int = 0
    answered: int = 0
    abandoned: int = 0
    transport_errors: int = 0
    server_errors: int = 0
    client_errors: int = 0
    same_key_retries: int = 0
    replays: int = 0
    topups: int = 0
    topup_failures: int = 0
    in_flight: int = 0
    http_ms: list[float] = field(default_factory=list)


class OrderLoad:
    """Orders at a steady rate plus periodic wallet top-ups (see the module doc)."""

    def __init__(
        self,
        *,
        order_port: int,
        payment_port: int,
        rng: random.Random,
        rate_per_s: float,
        customers: int,
        retry_fraction: float = 0.03,
        max_in_flight: int = 256,
        give_up_s: float = 180.0,
        topup_every_s: float = 5.0,
        funding: float = 0.85,
    ) -> None:
        self.orders = HttpPool(order_port, max_in_flight)
        self.payments = HttpPool(payment_port, 16)
        self.rng = rng
        self.rate_per_s = rate_per_s
        self.customers = [f"c{i:03d}" for i in range(customers)]
        self.retry_fraction = retry_fraction
        self.max_in_flight = max_in_flight
        self.give_up_s = give_up_s
        self.topup_every_s = topup_every_s
        self.funding = funding
        self.stats = LoadStats()
        self._tasks: set[asyncio.Task[None]] = set()

    async def seed_wallets(self, seconds_of_spend: float) -> None:
        """Fund every wallet with about ``seconds_of_spend`` of its expected orders."""
        share = self._spend_per_customer_per_s() * Decimal(str(seconds_of_spend))
        await asyncio.gather(
            *(self._top_up(c, share, replay=i < 3) for i, c in enumerate(self.customers))
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Send orders until ``stop``; then wait for the ones in flight (bounded by give_up_s)."""
        topping = asyncio.create_task(self._topups(stop))
        interval = 1.0 / self.rate_per_s
        next_tick = time.monotonic()
        while not stop.is_set():
            self.stats.ticks += 1
            if self.stats.in_flight >= self.max_in_flight:
                self.stats.shed += 1
            else:
                task = asyncio.create_task(self._order())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            next_tick += interval
            delay = next_tick - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
            elif delay < -1.0:
                next_tick = time.monotonic()  # the loop itself lagged: do not burst
        await topping
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.give_up_s + 30)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.orders.close()
        self.payments.close()

    # ------------------------------------------------------------------ orders

    async def _order(self) -> None:
        stats = self.stats
        stats.in_flight += 1
        try:
            key = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
            customer = self.rng.choice(self.customers)
            amount = Decimal(self.rng.randint(500, 6000)) * _CENT
            replay = self.rng.random() < self.retry_fraction
            body = {"customer_id": customer, "amount": str(amount), "currency": "EUR"}
            timing = OrderTiming(key, customer, time.time())
            stats.timings[key] = timing
            for retry in (False, True) if replay else (False,):
                status, answer = await self._post_until_answered(self.orders, "/orders", key, body)
                order_id = None
                if status in (200, 201) and isinstance(answer, dict):
                    order_id = uuid.UUID(answer["id"])
                    if timing.acked is None:
                        timing.acked, timing.order_id = time.time(), order_id
                elif status >= 400:
                    stats.client_errors += 1
                if status == 0:
                    stats.abandoned += 1
                else:
                    stats.answered += 1
                if retry and status == 200:
                    stats.replays += 1
                stats.requests.append(RequestRecord(key, order_id, status, retry))
                if status == 0:
                    return
        finally:
            stats.in_flight -= 1

    async def _post_until_answered(
        self, pool: HttpPool, path: str, key: str, body: dict[str, str]
    ) -> tuple[int, Any]:
        """Status 0 if nothing but transport errors / 5xx came back within ``give_up_s``."""
        deadline = time.monotonic() + self.give_up_s
        backoff = 0.2
        attempt = 0
        while True:
            if attempt:
                self.stats.same_key_retries += 1
            attempt += 1
            started = time.monotonic()
            try:
                status, answer = await pool.request("POST", path, body, {"Idempotency-Key": key})
            except HttpError:
                self.stats.transport_errors += 1
            else:
                self.stats.http_ms.append((time.monotonic() - started) * 1000.0)
                if status < 500:
                    return status, answer
                self.stats.server_errors += 1
            if time.monotonic() + backoff > deadline:
                return 0, None
            await asyncio.sleep(backoff * self.rng.uniform(0.5, 1.0))
            backoff = min(2.0, backoff * 2)

    # ------------------------------------------------------------------ wallets

    def _spend_per_customer_per_s(self) -> Decimal:
        mean_amount = Decimal("32.50")
        return mean_amount * Decimal(str(self.rate_per_s)) / len(self.customers)

    async def _top_up(self, customer: str, amount: Decimal, *, replay: bool = False) -> None:
        amount = max(Decimal("5.00"), amount.quantize(_CENT))
        key = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        path = f"/wallets/{customer}/top-up"
        for attempt in range(2 if replay else 1):
            status, _ = await self._post_until_answered(
                self.payments, path, key, {"amount": str(amount)}
            )
            if status not in (200, 201):
                self.stats.topup_failures += 1
                return
            if attempt == 0:
                self.stats.topups += 1

    async def _topups(self, stop: asyncio.Event) -> None:
        """Every ``topup_every_s``: top up half the customers with ~2x their expected spend
        (x ``funding``), so wallets neither all run dry nor all stay rich."""
        per_round = self._spend_per_customer_per_s() * Decimal(str(self.topup_every_s))
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.topup_every_s)
            if stop.is_set():
                return
            chosen = [c for c in self.customers if self.rng.random() < 0.5]
            factor = Decimal(str(round(2 * self.funding * self.rng.uniform(0.7, 1.3), 2)))
            await asyncio.gather(
                *(
                    self._top_up(c, per_round * factor, replay=self.rng.random() < 0.1)
                    for c in chosen
                ),
                return_exceptions=True,
            )
