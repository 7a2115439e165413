"""What both example APIs share: the Idempotency-Key rule, ``/health`` and ``/metrics``.

Status codes of the write endpoints (documented in each API):

- ``201 Created``: a new request, its effect committed.
- ``200 OK``: a retry of an already committed request (same ``Idempotency-Key``): the first
  result is returned and nothing new is written.
- ``400 Bad Request``: ``Idempotency-Key`` missing or malformed (1..128 visible ASCII chars).
- ``422 Unprocessable Content``: invalid body, or a key reused with a different body.
- ``503 Service Unavailable``: the database cannot be reached right now (connection lost or
  refused, no pooled connection free within ``POOL_TIMEOUT_S``); nothing was committed, or
  the commit's outcome is unknown: retry with the SAME ``Idempotency-Key``.

The request path is lean on purpose (measured in ``docs/performance.md``, "Example
services"; the choices are explained in ``example_services/README.md``): a fixed pool without
overflow and without pre-ping, a pure ASGI metrics middleware.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import sqlalchemy as sa
import sqlalchemy.exc
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from example_services._config import prepare_database
from ledgerbox import telemetry

__all__ = [
    "IDEMPOTENCY_KEY_RULE",
    "POOL_SIZE",
    "POOL_TIMEOUT_S",
    "install_health_and_metrics",
    "validate_idempotency_key",
]

#: Connections of an API process to its database, all opened once and kept: no overflow.
#: Overflow connections are closed when returned, so bursts above the pool size would open
#: and close a PostgreSQL connection per request (a backend fork: ~2-3 ms of CPU on each
#: side). A request holds one for ~3 round trips, so 10 cover well over 1,000 requests/s.
POOL_SIZE = 10

#: Seconds a request waits for a free pooled connection before it is answered 503.
POOL_TIMEOUT_S = 10.0

#: libpq settings of the API's connections (libpq "Parameter Key Words"), as ledgerbox sets
#: them on its own connections (docs/configuration.md): give up connecting after 5 s, and
#: notice a server that vanished without closing the connection (a host lost in a failover)
#: in ~30-40 s through TCP keepalive probes and a user timeout (these override the URL's own
#: values), instead of a request that waits for an answer that never comes. A slow query is
#: not affected.
CONNECT_ARGS = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}

#: Visible ASCII (0x21..0x7E), 1 to 128 characters: what the IETF draft
#: "The Idempotency-Key HTTP Header Field" allows in practice for a UUID or similar token.
IDEMPOTENCY_KEY_RULE = re.compile(r"^[\x21-\x7e]{1,128}$")


def validate_idempotency_key(value: str | None) -> str:
    """Return the header value, or raise ``HTTPException(400)`` saying what is wrong."""
    if value is None:
        raise HTTPException(
            status_code=400,
            detail="Idempotency-Key header is required (1..128 visible ASCII characters)",
        )
    if not IDEMPOTENCY_KEY_RULE.match(value):
        raise HTTPException(
            status_code=400,
            detail="Idempotency-Key must be 1..128 visible ASCII characters (0x21-0x7E)",
        )
    return value


def install_health_and_metrics(
    app: FastAPI, service: str, engine: Callable[[], AsyncEngine | None]
) -> CollectorRegistry:
    """Add ``GET /health``, ``GET /metrics`` and a request-metrics middleware to ``app``.

    Parameters
    ----------
    service : str
        Label value of the ``service`` label.
    engine : Callable[[], AsyncEngine | None]
        Returns the app's engine (``None`` before startup); ``/health`` runs ``SELECT 1``.

    Returns
    -------
    CollectorRegistry
        The app's own registry (one per app, so tests can build several apps).
    """
    registry = CollectorRegistry()
    requests = Counter(
        "example_http_requests_total",
        "HTTP requests by route and status code",
        ["service", "method", "route", "status"],
        registry=registry,
    )
    duration = Histogram(
        "example_http_request_duration_seconds",
        "HTTP request duration in seconds",
        ["service", "route"],
        registry=registry,
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    )

    app.add_middleware(_RequestMetrics, service=service, requests=requests, duration=duration)

    @app.get("/health")
    async def health() -> JSONResponse:
        current = engine()
        if current is None:
            return JSONResponse({"status": "starting", "service": service}, status_code=503)
        try:
            async with current.connect() as conn:
                await conn.execute(sa.text("SELECT 1"))
        except Exception as exc:  # any failure means "not healthy"; the reason is reported
            return JSONResponse(
                {"status": "unhealthy", "service": service, "error": type(exc).__name__},
                status_code=503,
            )
        return JSONResponse({"status": "ok", "service": service})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return registry


class _RequestMetrics:
    """Pure ASGI middleware counting requests by route and status, timing them.

    Not ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` runs every request
    through an extra task group and memory streams (~300 us of CPU per request measured).
    """

    def __init__(
        self, app: ASGIApp, *, service: str, requests: Counter, duration: Histogram
    ) -> None:
        self.app = app
        self.service = service
        self.requests = requests
        self.duration = duration
        # Children by label values: ``labels()`` validates and locks on every call.
        self._counters: dict[tuple[str, str, int], Any] = {}
        self._timers: dict[str, Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception escaping the app becomes a 500 further out

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            # The router stores the matched route in the (shared) scope.
            path = getattr(scope.get("route"), "path", "unmatched")
            key = (scope["method"], path, status)
            counter = self._counters.get(key)
            if counter is None:
                counter = self.requests.labels(self.service, key[0], path, str(status))
                self._counters[key] = counter
            counter.inc()
            timer = self._timers.get(path)
            if timer is None:
                timer = self._timers[path] = self.duration.labels(self.service, path)
            timer.observe(time.perf_counter() - started)


async def _database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """503 for a lost or refused database connection and a pool timeout; else re-raise."""
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and not (
        exc.connection_invalidated
        or isinstance(exc, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError)
    ):
        raise exc  # a bug or a constraint: a 500, logged with its traceback
    return JSONResponse(
        {
            "detail": f"database unavailable ({type(exc).__name__}); "
            "retry with the same Idempotency-Key"
        },
        status_code=503,
    )


async def _invalid_request(request: Request, exc: Exception) -> Response:
    """422 with pydantic's errors, as FastAPI's own handler answers, but as ASCII JSON: the
    errors echo the input, and a lone surrogate (a JSON ``"\\ud800"`` in the body) has no
    UTF-8 form, so FastAPI's rendering raised UnicodeEncodeError and the client got a 500."""
    assert isinstance(exc, RequestValidationError)
    body = json.dumps({"detail": jsonable_encoder(exc.errors())}, ensure_ascii=True)
    return Response(body, status_code=422, media_type="application/json")


def service_app(
    title: str, database_url: Callable[[], str], metadata: sa.MetaData, migrate: bool
) -> tuple[FastAPI, Callable[[], AsyncEngine]]:
    """A FastAPI app whose lifespan prepares and connects the service database.

    Returns the app (with ``/health`` and ``/metrics``) and ``engine()``, which gives the
    connected ``AsyncEngine`` or answers 503 while the service is starting. Spans are
    exported if the ``OTEL_*`` variables ask for it (:func:`ledgerbox.telemetry.configure`;
    docs/observability.md, "Export").
    """
    telemetry.configure(title)
    engines: list[AsyncEngine] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        url = database_url()
        if migrate:
            await asyncio.to_thread(prepare_database, url, metadata)
        # No pre-ping: it is one more round trip (SELECT 1) per request. A connection that
        # died with its server fails its first statement instead; SQLAlchemy then drops the
        # whole pool (reconnecting on next use) and the request is answered 503 (see
        # _database_unavailable): nothing was committed, the client retries with its key.
        engine = create_async_engine(
            url,
            pool_size=POOL_SIZE,
            max_overflow=0,
            pool_timeout=POOL_TIMEOUT_S,
            connect_args=CONNECT_ARGS,
        )
        engines.append(engine)
        try:
            yield
        finally:
            engines.clear()
            await engine.dispose()

    def current_engine() -> AsyncEngine | None:
        return engines[0] if engines else None

    def engine() -> AsyncEngine:
        current = current_engine()
        if current is None:
            raise HTTPException(status_code=503, detail="starting")
        return current

    app = FastAPI(title=title, lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(sqlalchemy.exc.DBAPIError, _database_unavailable)
    app.add_exception_handler(sqlalchemy.exc.TimeoutError, _database_unavailable)
    install_health_and_metrics(app, title, current_engine)
    return app, engine
