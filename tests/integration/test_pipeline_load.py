"""The ``demo_pipeline`` benchmark's load generator against a real uvicorn app on 127.0.0.1.

It is the benchmark's measuring instrument, so what it must not get wrong is checked here:
one fresh ``Idempotency-Key`` per request, every order id of a 2xx answer reported, the
open-loop schedule kept while the server is slow (requests are not held back waiting for
answers; latency counts from the time a request was due), and the closed loop never having
more than ``--max-in-flight`` requests at the server.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import pytest
import pytest_asyncio
import uvicorn
from fastapi import FastAPI, Header, Response

from example_services.demo._procs import free_port
from tests._services import REPO_ROOT

pytestmark = pytest.mark.timeout(90)


class _Orders:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.keys: list[str | None] = []
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/orders", status_code=201)
        async def place(
            body: dict[str, Any],
            response: Response,
            key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
        ) -> dict[str, Any]:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                self.keys.append(key)
                self.bodies.append(body)
                await asyncio.sleep(self.delay_s)
                return {"id": str(uuid.uuid4()), "status": "PENDING", **body}
            finally:
                self.in_flight -= 1

        return app


@pytest_asyncio.fixture
async def slow_orders() -> AsyncIterator[tuple[_Orders, int]]:
    orders = _Orders(delay_s=0.2)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(orders.app(), host="127.0.0.1", port=port, log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.02)
    try:
        yield orders, port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def _run_load(port: int, out: Path, *args: str) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "bench._pipeline_load", "--port", str(port)),
        *("--customers", "7", "--out", str(out), *args),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    output, _ = await proc.communicate()
    assert proc.returncode == 0, output.decode(errors="replace")
    result: dict[str, Any] = json.loads(await asyncio.to_thread(out.read_text))
    return result


async def test_open_loop_keeps_its_schedule_while_the_server_is_slow(
    slow_orders: tuple[_Orders, int], tmp_path: Path
) -> None:
    orders, port = slow_orders
    result = await _run_load(
        port, tmp_path / "open.json", "--rate", "100", "--duration-s", "1", "--seed", "3"
    )
    assert result["sent"] == 100 and result["shed"] == 0 and result["errors"] == 0
    assert result["statuses"] == {"201": 100}
    # Each answer takes 200 ms, requests are due every 10 ms: an open loop keeps ~20 in
    # flight (a closed loop with the 8 warm connections could not send 100 within 1 s).
    assert orders.max_in_flight >= 15, orders.max_in_flight
    assert result["ended_at"] - result["started_at"] < 2.0
    assert len(result["http_ms"]) == 100 and min(result["http_ms"]) >= 199.0
    assert len(set(orders.keys)) == 100 and None not in orders.keys
    assert all(uuid.UUID(str(k)).version == 4 for k in orders.keys)
    assert len(set(result["order_ids"])) == 100
    assert {b["customer_id"] for b in orders.bodies} <= {f"c{i:03d}" for i in range(7)}
    assert all(b["currency"] == "EUR" and float(b["amount"]) >= 5.0 for b in orders.bodies)
    assert result["cpu_s"] > 0


async def test_closed_loop_never_exceeds_max_in_flight(
    slow_orders: tuple[_Orders, int], tmp_path: Path
) -> None:
    orders, port = slow_orders
    result = await _run_load(
        port, tmp_path / "closed.json", "--rate", "0", "--duration-s", "1", "--max-in-flight", "4"
    )
    assert orders.max_in_flight == 4
    # ~1 s / 200 ms * 4 in flight, plus the ones still in flight at the end.
    assert 16 <= result["sent"] <= 28 and result["answered"] == result["sent"]
    assert result["errors"] == 0 and len(result["order_ids"]) == result["sent"]
