"""Redaction: secrets that never print, URLs without their password (docs/security.md).

Three tools, used at every edge that prints or logs:

* :class:`Secret` holds a password or key passphrase: ``str()``, ``repr()`` and f-strings show
  ``***``; only :meth:`Secret.reveal` gives the value, to the driver that needs it.
* :func:`redact_url` drops the password (and a ``password=`` query parameter) of a URL, for
  log lines and messages.
* :func:`remember` / :func:`scrub`: a process-wide set of the secret values in use (the
  configs add theirs when they are built). :func:`scrub` replaces every one of them in a text
  by ``***`` where it stands on its own (not inside a longer word: a password ``postgres``
  leaves ``postgresql`` alone); the commands apply it to what they print and
  :class:`ScrubFilter` to every log record, a safety net under the rule that no message is
  built with a secret in it.
"""

from __future__ import annotations

import hmac
import logging
import re
import threading
import urllib.parse
from pathlib import Path
from typing import Any

__all__ = [
    "MASK",
    "ScrubFilter",
    "Secret",
    "install_scrub_filter",
    "redact_url",
    "remember",
    "remember_url",
    "scrub",
]

#: What a secret prints as.
MASK = "***"

# Shorter values are not scrubbed from texts: "pw" would mangle every line that holds it.
_MIN_SCRUBBED = 4
_KNOWN: set[str] = set()
_KNOWN_LOCK = threading.Lock()
_PATTERN: list[re.Pattern[str] | None] = [None]  # built on first scrub after a remember


class Secret:
    """A secret string (password, token, key passphrase) that never prints.

    ``str(s)``, ``repr(s)`` and formatting show ``***``; :meth:`reveal` returns the value.
    Two secrets are equal when their values are (compared in constant time). Building one
    :func:`remember`\\ s the value, so that :func:`scrub` masks it wherever it would appear.

    Parameters
    ----------
    value : str
        The secret; an object with ``get_secret_value()`` (pydantic's ``SecretStr``) works too.

    Raises
    ------
    TypeError
        If ``value`` is neither.
    """

    __slots__ = ("_value",)

    def __init__(self, value: str | Any) -> None:
        if isinstance(value, Secret):
            value = value.reveal()
        elif not isinstance(value, str) and callable(getattr(value, "get_secret_value", None)):
            value = value.get_secret_value()
        if not isinstance(value, str):
            raise TypeError(f"a secret must be a str, got {type(value).__name__}")
        self._value = value
        remember(value)

    @classmethod
    def from_file(cls, path: str | Path) -> Secret:
        """The content of ``path`` (a Docker or Kubernetes secret file), without the line
        break at its end.

        Raises
        ------
        OSError
            If the file cannot be read (the message names the path, never the content).
        """
        text = Path(path).read_text(encoding="utf-8")
        return cls(text.removesuffix("\n").removesuffix("\r"))

    def reveal(self) -> str:
        """The value, for the driver that needs it. Never log or print it."""
        return self._value

    def __repr__(self) -> str:
        return f"Secret('{MASK}')"

    def __str__(self) -> str:
        return MASK

    def __format__(self, spec: str) -> str:
        return MASK

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash((Secret, len(self._value)))

    def __bool__(self) -> bool:
        return bool(self._value)

    def __reduce__(self) -> Any:
        raise TypeError("a Secret is not pickled (it would leave the process in clear)")


def remember(value: str | None) -> None:
    """Add ``value`` to the secrets :func:`scrub` masks (no-op for ``None`` and values
    shorter than 4 characters, which would mask ordinary words)."""
    if value and len(value) >= _MIN_SCRUBBED:
        with _KNOWN_LOCK:
            before = len(_KNOWN)
            _KNOWN.add(value)
            # Also as it appears inside a URL (percent-encoded).
            quoted = urllib.parse.quote(value, safe="")
            if quoted != value:
                _KNOWN.add(quoted)
            if len(_KNOWN) != before:
                _PATTERN[0] = None


def remember_url(url: str | None) -> None:
    """:func:`remember` the password of ``url`` (userinfo or ``password=`` query), if any."""
    if not url:
        return
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return
    if parts.password:
        remember(urllib.parse.unquote(parts.password))
        remember(parts.password)
    for key, value in urllib.parse.parse_qsl(parts.query):
        if key.lower() in _SECRET_QUERY_KEYS:
            remember(value)


def scrub(text: str) -> str:
    """``text`` with every remembered secret replaced by ``***`` (longest first), where it is
    not part of a longer word (no letter, digit or ``_`` right before or after it)."""
    with _KNOWN_LOCK:
        pattern = _PATTERN[0]
        if pattern is None and _KNOWN:
            values = sorted(_KNOWN, key=len, reverse=True)
            alternatives = "|".join(re.escape(v) for v in values)
            pattern = re.compile(rf"(?<![A-Za-z0-9_])(?:{alternatives})(?![A-Za-z0-9_])")
            _PATTERN[0] = pattern
    if pattern is None:
        return text
    return pattern.sub(MASK, text)


_SECRET_QUERY_KEYS = frozenset({"password", "sslpassword", "pass", "token", "secret"})


def redact_url(url: str) -> str:
    """``url`` with its password (userinfo and ``password``-like query parameters) replaced
    by ``***``: ``postgresql://app:***@db:5432/app?sslmode=verify-full``. A text that does
    not parse as a URL comes back scrubbed (:func:`scrub`)."""
    try:
        parts = urllib.parse.urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            user, _, host = netloc.rpartition("@")
            name = user.partition(":")[0]
            netloc = f"{name}:{MASK}@{host}"
        query = parts.query
        if query:
            pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
            query = "&".join(
                f"{k}={MASK if k.lower() in _SECRET_QUERY_KEYS else v}" for k, v in pairs
            )
        return scrub(urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query)))
    except ValueError:
        return scrub(url)


class ScrubFilter(logging.Filter):
    """A logging filter that masks every remembered secret in a record's message (its
    arguments are merged first) and in the text of an attached exception."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: leave it to the handler to report
            return True
        cleaned = scrub(message)
        if cleaned != message:  # else the record stays as it was (args kept for others)
            record.msg, record.args = cleaned, None
        if record.exc_info and record.exc_info[1] is not None:
            formatted = logging.Formatter().formatException(record.exc_info)
            scrubbed = scrub(formatted)
            if scrubbed != formatted:
                record.exc_info, record.exc_text = None, scrubbed
        return True


def install_scrub_filter() -> None:
    """Attach one :class:`ScrubFilter` to every handler of the root logger (idempotent): a
    handler filter sees the records of every logger, including the drivers'."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, ScrubFilter) for f in handler.filters):
            handler.addFilter(ScrubFilter())
