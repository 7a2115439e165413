"""The Redis URL of a consumer: checked once, when the config is built, before any client.

A URL that can never work (not ``redis://``, ``rediss://`` or ``unix://``, a port outside
1..65535, a database that is not an integer) is a configuration error, found at once, one
line naming the setting: without this check it surfaced as a ``ValueError`` traceback from
the Redis client (exit 1, which ``consumer check`` uses for "degraded"). A Redis server that
is down is not found here: the consumer carries on without it (degraded, G6).

Pure: no I/O; the message never shows the URL (it may hold a password).
"""

from __future__ import annotations

from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from ledgerbox._core.errors import ConfigurationError

__all__ = ["check_redis_url", "redis_label"]

_SCHEMES = ("redis", "rediss", "unix")
_FORM = "redis://[user:password@]host:6379/0, rediss://... (TLS) or unix:///path/redis.sock"


def check_redis_url(url: str, setting: str = "redis_url") -> None:
    """Refuse a Redis URL that can never connect.

    Raises
    ------
    ledgerbox.ConfigurationError
        ``setting`` names it: not a Redis scheme, a port that is not an integer in
        1..65535, a database (the path, or ``?db=``) that is not an integer >= 0, a
        ``unix://`` URL without a socket path, or a query the Redis client refuses.
    """
    scheme, sep, _rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise ConfigurationError(f"{setting} is not a Redis URL: give {_FORM}", setting=setting)
    try:
        split = urlsplit(url)
        port = split.port
    except ValueError:  # not an integer, or outside 0..65535
        port = -1
    if port is not None and not 1 <= port <= 65535:
        # The value is not shown: in a URL with an unencoded password it may be a part of it.
        raise ConfigurationError(
            f"{setting} has a port that is not a TCP port (an integer in 1..65535): give {_FORM}",
            setting=setting,
        )
    if scheme.lower() == "unix" and not split.path:
        raise ConfigurationError(
            f"{setting} names no socket path: give unix:///path/redis.sock", setting=setting
        )
    for db in _databases(split):
        if not db.isdigit():
            raise ConfigurationError(
                f"{setting} has a database that is not an integer (the path /0 or ?db=0)",
                setting=setting,
            )
    from redis.connection import parse_url  # the client's own reading of the query

    try:
        parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError:
        raise ConfigurationError(
            f"{setting} does not parse as a Redis URL (a misspelt query parameter or a bad "
            f"value?): give {_FORM}",
            setting=setting,
        ) from None


def redis_label(url: str) -> str:
    """``host:port/db`` of a Redis URL for log lines, ``+TLS`` for ``rediss://``, the socket
    path for ``unix://``: never the user or the password; ``"(redis)"`` when it cannot be
    read (a URL that :func:`check_redis_url` accepted always can)."""
    try:
        split = urlsplit(url)
        host, port = split.hostname, split.port
    except ValueError:
        return "(redis)"
    scheme = split.scheme.lower()
    databases = _databases(split)
    if scheme == "unix":
        return f"{split.path or '(redis)'}{f' db {databases[0]}' if databases else ''}"
    if not host:
        host = "localhost"
    if ":" in host:  # IPv6
        host = f"[{host}]"
    db = databases[0] if databases else "0"
    return f"{host}:{port or 6379}/{db}{' +TLS' if scheme == 'rediss' else ''}"


def _databases(split: SplitResult) -> list[str]:
    """The databases a Redis URL names, as written: its path's (``/3``; a ``unix://`` path
    is the socket), then each ``?db=``."""
    path = split.path
    named = (
        [] if split.scheme.lower() == "unix" or path in ("", "/") else [unquote(path).lstrip("/")]
    )
    return named + [v for k, v in parse_qsl(split.query) if k == "db"]
