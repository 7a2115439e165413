"""The console's web app: FastAPI, one server-rendered page (Jinja2, autoescaped), plain
HTML forms and one small hand-written script (confirm dialogs); no build step, no fetched
code. Every action goes through the operator API (:mod:`ledgerbox.admin`, via
:class:`~ledgerbox.console._source.ConsoleSource`), like the CLI (docs/console.md).

Routes::

    GET  /                                    every service (?refresh=N: reload every N s)
    GET  /healthz                             "ok" (no token needed; shows nothing)
    GET  /login, POST /login                  the token form (when a token is set)
    POST /services/{name}/dead/replay|discard   form: ids (repeated), dry_run, operator
    POST /services/{name}/dlq/replay|discard    form: refs (repeated), dry_run, operator

A POST answers ``303 See Other`` back to ``/`` with the result (or the one-line error) shown
on top of the page.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape

from ledgerbox._core.errors import LedgerboxError
from ledgerbox._core.redaction import scrub
from ledgerbox.admin import ActionResult
from ledgerbox.console._auth import COOKIE, Guard
from ledgerbox.console._config import ConsoleConfig, ServiceTarget
from ledgerbox.console._source import AdminSource, ConsoleSource
from ledgerbox.console._view import RateMeter, gather

__all__ = ["create_app"]

_log = logging.getLogger("ledgerbox.console")
_MAX_FORM_BYTES = 64 * 1024
_FLASHES = 64


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _since(at: datetime | None) -> str:
    if at is None:
        return "-"
    return _age((datetime.now(UTC) - at).total_seconds()) + " ago"


def _environment() -> Environment:
    env = Environment(
        loader=PackageLoader("ledgerbox.console", "templates"),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["age"] = _age
    env.filters["since"] = _since
    return env


def create_app(
    config: ConsoleConfig,
    source: ConsoleSource | None = None,
    *,
    guard: Guard | None = None,
    rates: RateMeter | None = None,
) -> FastAPI:
    """The console app of ``config`` (serve it with uvicorn; ``ledgerbox console`` does).

    Parameters
    ----------
    config : ConsoleConfig
    source : ConsoleSource | None
        Where data comes from (default :class:`AdminSource`: the operator API on the
        configured services; tests pass :class:`ledgerbox.console.testing.InMemorySource`).
    guard : Guard | None
        The access rules (default: from ``config``, with a fresh form key).
    rates : RateMeter | None
        Publish-rate readings (default: a new one on the monotonic clock).

    Returns
    -------
    fastapi.FastAPI
        Actions change what the operator API changes (one audit row each); reads change
        nothing.
    """
    source = source if source is not None else AdminSource(config)
    guard = guard if guard is not None else Guard(config)
    rates = rates if rates is not None else RateMeter()
    templates = _environment()
    flashes: OrderedDict[str, tuple[bool, str]] = OrderedDict()
    counter = itertools.count(1)
    app = FastAPI(title="ledgerbox console", docs_url=None, redoc_url=None, openapi_url=None)

    def render(name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
        html = templates.get_template(name).render(
            form_token=guard.form_token(), token_required=guard.token_required, **context
        )
        return HTMLResponse(html, status_code=status_code, headers=_SECURITY_HEADERS)

    def flash(ok: bool, text: str) -> RedirectResponse:
        key = str(next(counter))
        flashes[key] = (ok, text)
        while len(flashes) > _FLASHES:
            flashes.popitem(last=False)
        return RedirectResponse(f"/?flash={key}", status_code=303)

    async def form(request: Request) -> dict[str, list[str]] | None:
        body = await request.body()
        if len(body) > _MAX_FORM_BYTES:
            return None
        return parse_qs(body.decode("utf-8", "replace"), keep_blank_values=False)

    @app.middleware("http")
    async def access(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        host = request.headers.get("host")
        if not guard.host_allowed(host):
            return PlainTextResponse(
                "unknown Host header: open the console by its address (or add the name to "
                "--allowed-hosts)",
                status_code=400,
            )
        path = request.url.path
        if path == "/healthz" or path == "/login":
            return await call_next(request)
        if not guard.authenticated(
            request.headers.get("authorization"), request.cookies.get(COOKIE)
        ):
            if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
                return render("login.html", status_code=401, error=None)
            return PlainTextResponse(
                "a token is required: send 'Authorization: Bearer <token>' or log in at /login",
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await call_next(request)

    @app.get("/healthz")
    async def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/login", response_model=None)
    async def login_form() -> Response:
        if not guard.token_required:
            return RedirectResponse("/", status_code=303)
        return render("login.html", error=None)

    @app.post("/login", response_model=None)
    async def login(request: Request) -> Response:
        fields = await form(request)
        if fields is None or not guard.form_ok(
            _one(fields, "csrf"), request.headers.get("origin"), request.headers.get("host")
        ):
            return PlainTextResponse("refused: not a form of this console", status_code=403)
        if not guard.token_required:
            return RedirectResponse("/", status_code=303)
        if not guard.token_ok(_one(fields, "token")):
            _log.warning("console login refused from %s", _remote(request))
            return render("login.html", status_code=401, error="wrong token")
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(
            COOKIE,
            guard.session_value(),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    @app.get("/", response_class=HTMLResponse)
    async def page(request: Request) -> HTMLResponse:
        views = await gather(config, source, rates)
        key = request.query_params.get("flash")
        message = flashes.get(key) if key else None
        return render(
            "page.html",
            views=views,
            services={s.name: s for s in config.services},
            kafka=config.kafka is not None,
            message=message,
            refresh=_refresh_s(request.query_params.get("refresh", "")),
            now=datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        )

    async def act(request: Request, name: str, side: str, verb: str) -> Response:
        fields = await form(request)
        if fields is None or not guard.form_ok(
            _one(fields, "csrf"), request.headers.get("origin"), request.headers.get("host")
        ):
            return PlainTextResponse("refused: not a form of this console", status_code=403)
        service = config.service(name)
        if service is None or verb not in ("replay", "discard"):
            return PlainTextResponse(f"no service {name!r} or action {verb!r}", status_code=404)
        actor = guard.actor(_remote(request), _one(fields, "operator"))
        dry_run = _one(fields, "dry_run") in ("1", "on", "true")
        try:
            result = await _dispatch(source, service, side, verb, fields, actor, dry_run)
        except _BadInput as exc:
            return flash(False, f"{service.name}: {exc}")
        except LedgerboxError as exc:
            line = scrub(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return flash(False, f"{service.name}: {side} {verb} refused: {line}")
        return flash(True, _summary(service, result))

    @app.post("/services/{name}/dead/{verb}", response_model=None)
    async def dead_action(request: Request, name: str, verb: str) -> Response:
        return await act(request, name, "dead", verb)

    @app.post("/services/{name}/dlq/{verb}", response_model=None)
    async def dlq_action(request: Request, name: str, verb: str) -> Response:
        return await act(request, name, "dlq", verb)

    return app


_SECURITY_HEADERS = {
    "X-Frame-Options": "DENY",  # no clickjacking of the replay buttons
    "Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; "
    "script-src 'unsafe-inline'; frame-ancestors 'none'; form-action 'self'",
    # Not "no-referrer": Chromium then sends "Origin: null" with the forms (refused below).
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class _BadInput(Exception):
    pass


def _refresh_s(value: str) -> int | None:
    """``?refresh=N``: N seconds between reloads when N is 1..3600 in ASCII digits, else
    ``None`` (``str.isdigit`` alone also accepts digits such as ``²`` that ``int`` refuses)."""
    if value.isascii() and value.isdigit() and 1 <= int(value) <= 3600:
        return int(value)
    return None


def _one(fields: dict[str, list[str]], name: str) -> str | None:
    values = fields.get(name)
    return values[0] if values else None


def _remote(request: Request) -> str | None:
    return request.client.host if request.client else None


async def _dispatch(
    source: ConsoleSource,
    service: ServiceTarget,
    side: str,
    verb: str,
    fields: dict[str, list[str]],
    actor: str,
    dry_run: bool,
) -> ActionResult:
    if side == "dead":
        raw = fields.get("ids", [])
        if not raw:
            raise _BadInput("no dead event selected")
        try:
            ids = [int(v) for v in raw]
        except ValueError:
            raise _BadInput(f"not an event id: {raw!r}") from None
        call = source.replay_dead if verb == "replay" else source.discard_dead
        return await call(service, ids, actor=actor, dry_run=dry_run)
    refs = fields.get("refs", [])
    if not refs:
        raise _BadInput("no DLQ record selected")
    dlq_call = source.replay_dlq if verb == "replay" else source.discard_dlq
    return await dlq_call(service, refs, actor=actor, dry_run=dry_run)


def _summary(service: ServiceTarget, result: ActionResult) -> str:
    what = "dry run: would " if result.dry_run else ""
    verb = result.action.rsplit(".", 1)[-1]
    items = ", ".join(result.ids)
    return (
        f"{service.name}: {what}{verb} {items} ({result.action}, {result.changed} rows changed, "
        f"by {result.actor}, audit #{result.audit_id})"
    )
