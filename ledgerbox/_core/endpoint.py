"""The HTTP endpoints of the daemons (Prometheus metrics, the ops console): where they
listen, by ONE rule (docs/security.md, "HTTP endpoints").

They bind to ``127.0.0.1`` unless the operator names another address explicitly
(``--metrics-host``): what is on the machine stays on the machine by default. An endpoint
that serves more than read-only metrics (the console) must also require a token when it is
not on a loopback address (:func:`needs_token`).
"""

from __future__ import annotations

import ipaddress
import logging

from ledgerbox._core.errors import ConfigurationError

__all__ = ["DEFAULT_HOST", "check_port", "is_loopback", "needs_token", "serve_metrics"]

#: Where an endpoint listens unless told otherwise.
DEFAULT_HOST = "127.0.0.1"

_log = logging.getLogger("ledgerbox.endpoint")


def is_loopback(host: str) -> bool:
    """True for ``127.0.0.0/8``, ``::1`` and ``localhost``: reachable from this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[] ")).is_loopback
    except ValueError:
        return False


def needs_token(host: str) -> bool:
    """An endpoint that can change anything (the console) on ``host`` must require a token:
    True unless ``host`` is a loopback address."""
    return not is_loopback(host)


def check_port(port: int, setting: str, *, zero: str | None = None) -> None:
    """Refuse a TCP port outside 1..65535, at configuration (before: 70000 raised
    ``OverflowError`` from ``bind()``, a traceback; -1 named the host setting).

    Parameters
    ----------
    port : int
    setting : str
        Named in the message and set as the error's ``setting`` (``"metrics_port"``).
    zero : str | None
        What 0 means for this setting (``"off"``, ``"any free port"``); ``None``: 0 is
        refused too.

    Raises
    ------
    ledgerbox.ConfigurationError
        ``"metrics_port must be a TCP port in 1..65535 (0: off) (got 70000)"``.
    """
    if not (0 if zero else 1) <= port <= 65535:
        what = f" (0: {zero})" if zero else ""
        raise ConfigurationError(
            f"{setting} must be a TCP port in 1..65535{what} (got {port})", setting=setting
        )


def serve_metrics(port: int, host: str = DEFAULT_HOST, *, setting: str = "metrics_host") -> None:
    """Serve Prometheus metrics on ``host:port`` in a background thread
    (``prometheus_client.start_http_server``, which would otherwise bind every interface).

    A host that is not a loopback address is logged once at WARNING: the metrics are then
    reachable from other machines (they hold group and topic names, never a secret).

    Raises
    ------
    ledgerbox.ConfigurationError
        If ``port`` is not in 1..65535 (:func:`check_port`), or the address cannot be bound
        (in use, not an address of this machine); ``setting`` names ``metrics_host`` (or
        ``metrics_port`` when the port is the cause).
    """
    from prometheus_client import start_http_server

    check_port(port, "metrics_port")

    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        name = "metrics_port" if exc.errno in (98, 13) else setting  # EADDRINUSE, EACCES
        raise ConfigurationError(
            f"metrics endpoint cannot listen on {host}:{port} ({why})", setting=name
        ) from None
    if not is_loopback(host):
        _log.warning(
            "metrics are served on %s:%d, reachable from other machines (--metrics-host)",
            host,
            port,
        )
