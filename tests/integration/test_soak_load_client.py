"""The soak's lean HTTP/1.1 client against a real uvicorn app on 127.0.0.1.

Keep-alive connections are reused, JSON goes both ways, ``Connection: close`` is honoured,
and a server that goes away is a typed :class:`HttpError` (the load then retries with the
same key), never a hang.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

import pytest
import pytest_asyncio
import uvicorn
from fastapi import FastAPI, Header, Response

from example_services.demo._procs import free_port
from example_services.soak.load import HttpError, HttpPool

pytestmark = pytest.mark.timeout(60)


def _app() -> FastAPI:
    app = FastAPI()
    seen: list[str | None] = []

    @app.post("/echo")
    async def echo(
        body: dict[str, Any], key: Annotated[str | None, Header(alias="Idempotency-Key")] = None
    ) -> dict[str, Any]:
        seen.append(key)
        return {"body": body, "key": key, "calls": len(seen)}

    @app.get("/bye")
    async def bye(response: Response) -> dict[str, str]:
        response.headers["Connection"] = "close"
        return {"bye": "now"}

    @app.get("/fail")
    async def fail(response: Response) -> dict[str, str]:
        response.status_code = 503
        return {"status": "down"}

    return app


@pytest_asyncio.fixture
async def server() -> AsyncIterator[tuple[uvicorn.Server, int]]:
    port = free_port()
    config = uvicorn.Config(_app(), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve())
    for _ in range(500):
        if srv.started:
            break
        await asyncio.sleep(0.02)
    try:
        yield srv, port
    finally:
        srv.should_exit = True
        await asyncio.wait_for(task, 10)


async def test_json_round_trip_on_reused_connections(server: tuple[uvicorn.Server, int]) -> None:
    _, port = server
    pool = HttpPool(port, size=2)
    try:
        answers = await asyncio.gather(
            *(
                pool.request("POST", "/echo", {"n": i}, {"Idempotency-Key": f"k{i}"})
                for i in range(20)
            )
        )
        assert all(status == 200 for status, _ in answers)
        assert sorted(a["body"]["n"] for _, a in answers) == list(range(20))
        assert {a["key"] for _, a in answers} == {f"k{i}" for i in range(20)}
        assert len(pool._idle) <= 2  # at most `size` connections, kept alive
        assert await pool.request("GET", "/fail") == (503, {"status": "down"})
        assert await pool.request("GET", "/bye") == (200, {"bye": "now"})
    finally:
        pool.close()


async def test_a_server_that_goes_away_is_an_http_error(server: tuple[uvicorn.Server, int]) -> None:
    srv, port = server
    pool = HttpPool(port, size=1, timeout_s=3)
    try:
        assert (await pool.request("POST", "/echo", {}))[0] == 200
        srv.should_exit = True
        await asyncio.sleep(1.0)
        with pytest.raises(HttpError):
            await pool.request("POST", "/echo", {})
    finally:
        pool.close()
    with pytest.raises(HttpError):
        await HttpPool(free_port(), size=1, timeout_s=2).request("GET", "/")
