"""What both example APIs share: the Idempotency-Key rule, ``/health`` and ``/metrics``.

Status codes of the write endpoints (documented in each API):

- ``201 Created``: a new request, its effect committed.
- ``200 OK``: a retry of an already committed request (same ``Idempotency-Key``): the first
  result is returned and nothing new is written.
- ``400 Bad Request``: ``Idempotency-Key`` missing or malformed (1..128 visible ASCII chars).
- ``422 Unprocessable Content``: invalid body, or a key reused with a different body.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import sqlalchemy as sa
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from example_services._config import prepare_database
from ledgerbox import telemetry

__all__ = ["IDEMPOTENCY_KEY_RULE", "install_health_and_metrics", "validate_idempotency_key"]

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

    @app.middleware("http")
    async def _count(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        requests.labels(service, request.method, path, str(response.status_code)).inc()
        duration.labels(service, path).observe(time.perf_counter() - started)
        return response

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
        engine = create_async_engine(url, pool_size=10, max_overflow=10, pool_pre_ping=True)
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
    install_health_and_metrics(app, title, current_engine)
    return app, engine
