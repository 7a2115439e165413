"""Redaction: secrets that never print, URLs without their password (docs/security.md).

Three tools, used at every edge that prints or logs:

* :class:`Secret` holds a password or key passphrase: ``str()``, ``repr()`` and f-strings show
  ``***``; only :meth:`Secret.reveal` gives the value, to the driver that needs it.
* :func:`redact_url` drops the password (and a ``password=`` query parameter) of a URL, for
  log lines and messages.
* :func:`scrub`: a text with the password of every URL in it, and the value of every
  ``password=``-like field (a libpq conninfo, a query, a ``'password': ...`` mapping, a
  ``Bearer`` token), replaced by ``***``; the commands apply it to what they print and
  :class:`ScrubFilter` to every log record, a safety net under the rule that no message is
  built with a secret in it. It masks by position, never by value: a password that is also
  a user name, a database name or an ordinary word ("wrong", "server") leaves the rest of
  the message as it was (masking every occurrence of the value said which word it was).
"""

from __future__ import annotations

import hmac
import logging
import re
import urllib.parse
from pathlib import Path
from typing import Any

__all__ = [
    "MASK",
    "ScrubFilter",
    "Secret",
    "install_scrub_filter",
    "redact_url",
    "scrub",
]

#: What a secret prints as.
MASK = "***"

_SECRET_QUERY_KEYS = frozenset({"password", "sslpassword", "pass", "token", "secret"})
_KEYS = "|".join(sorted(_SECRET_QUERY_KEYS, key=len, reverse=True))

# A URL's userinfo password: ``scheme://user:PASSWORD@host``. The password runs to the last
# ``@`` of the token (libpq and urllib split the netloc at its last ``@``; SQLAlchemy accepts
# a ``/`` in it), never across a space or a quote.
_URL_PASSWORD = re.compile(r"""(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/?#@:'"]*:)[^\s'"<>]*@""")
# ``password=value`` (libpq conninfo, URL query), the value quoted or not.
_FIELD = re.compile(
    rf"""(?P<head>(?<![A-Za-z0-9_])(?:{_KEYS})=)(?:'(?:[^'\\]|\\.)*'|[^\s&'"]*)""",
    re.IGNORECASE,
)
# ``'password': 'value'`` (a dict's repr, JSON).
_MAPPING = re.compile(
    rf"""(?P<head>(?P<q>['"])(?:{_KEYS})(?P=q)\s*:\s*)(?P<v>['"])(?:(?!(?P=v)).)*(?P=v)""",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(?P<head>\bBearer\s+)[^\s'\",]+", re.IGNORECASE)


class Secret:
    """A secret string (password, token, key passphrase) that never prints.

    ``str(s)``, ``repr(s)`` and formatting show ``***``; :meth:`reveal` returns the value.
    Two secrets are equal when their values are (compared in constant time).

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


def scrub(text: str) -> str:
    """``text`` with the password of every URL in it (``scheme://user:***@host``) and the value
    of every password-like field (``password=***``, ``'password': '***'``, ``Bearer ***``)
    replaced by ``***``. Nothing else of the text changes: it masks by position, never by
    value."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@", text)
    text = _FIELD.sub(lambda m: f"{m['head']}{MASK}", text)
    text = _MAPPING.sub(lambda m: f"{m['head']}{m['v']}{MASK}{m['v']}", text)
    return _BEARER.sub(lambda m: f"{m['head']}{MASK}", text)


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
    """A logging filter that masks the URL passwords and password fields (:func:`scrub`) in
    a record's message (its arguments are merged first) and in the text of an attached
    exception."""

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
