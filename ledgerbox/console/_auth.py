"""Who may use the console, and whether a form post is the console's own (docs/console.md,
"Access"). Pure checks over header values; the app (``_app``) applies them to each request.

* Host: the ``Host`` header must name the bound address, ``localhost``, ``127.0.0.1`` or an
  ``allowed_hosts`` entry, so that a web page cannot reach a loopback console through a DNS
  name it controls (DNS rebinding).
* Token: when one is set, every request must carry it, as ``Authorization: Bearer <token>``
  or as the session cookie the login form sets (an HMAC of the token, HttpOnly,
  SameSite=Strict; never the token itself). Compared in constant time.
* Forms: every POST must carry the page's form token (an HMAC of a key drawn when the console
  starts) and, when the browser sends ``Origin``, come from the console's own origin; a page
  of another site can neither read the form token nor pass the origin check (cross-site
  request forgery), also on a loopback console without a token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from ledgerbox.console._config import ConsoleConfig

__all__ = ["COOKIE", "Guard"]

#: Name of the session cookie set by the login form.
COOKIE = "ledgerbox_console"


def _hostname(host_header: str) -> str:
    """``"127.0.0.1:8090"`` -> ``"127.0.0.1"``, ``"[::1]:8090"`` -> ``"::1"``."""
    value = host_header.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        return value.partition(":")[0]
    return value


class Guard:
    """The access rules of one console.

    Parameters
    ----------
    config : ConsoleConfig
    key : bytes | None
        Key of the form tokens (default: 32 random bytes drawn now; tests pass one).
    """

    def __init__(self, config: ConsoleConfig, key: bytes | None = None) -> None:
        self._token = config.token_value
        self._key = key if key is not None else secrets.token_bytes(32)
        bound = _hostname(config.host)
        self._hosts = {"localhost", "127.0.0.1", "::1", bound}
        self._hosts.update(_hostname(h) for h in config.allowed_hosts)
        self._wildcard = bound in ("0.0.0.0", "::")  # every address: any Host is the console

    @property
    def token_required(self) -> bool:
        """A token is set: every request needs it."""
        return self._token is not None

    def host_allowed(self, host_header: str | None) -> bool:
        """The ``Host`` header names this console (always true when bound to every address:
        the token then guards it)."""
        if self._wildcard:
            return True
        return host_header is not None and _hostname(host_header) in self._hosts

    def session_value(self) -> str:
        """The session cookie's value (an HMAC of the token: the cookie never holds it)."""
        assert self._token is not None
        return hmac.new(
            self._token.encode(), b"ledgerbox-console-session", hashlib.sha256
        ).hexdigest()

    def token_ok(self, candidate: str | None) -> bool:
        """``candidate`` is the token (constant time)."""
        if self._token is None or candidate is None:
            return False
        return hmac.compare_digest(candidate.encode(), self._token.encode())

    def authenticated(self, authorization: str | None, cookie: str | None) -> bool:
        """The request carries the token (bearer header) or the session cookie; always true
        without a token."""
        if self._token is None:
            return True
        if authorization is not None:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer" and self.token_ok(value.strip()):
                return True
        return cookie is not None and hmac.compare_digest(
            cookie.encode(), self.session_value().encode()
        )

    def form_token(self) -> str:
        """The hidden field every form of the page carries."""
        return hmac.new(self._key, b"ledgerbox-console-form", hashlib.sha256).hexdigest()

    def form_ok(self, field: str | None, origin: str | None, host_header: str | None) -> bool:
        """A POST is the console's own: the form token matches, and ``Origin`` (when sent)
        is this console's origin."""
        if field is None or not hmac.compare_digest(field.encode(), self.form_token().encode()):
            return False
        if origin is None or host_header is None:
            return origin is None
        if origin == "null":
            return False
        return origin.partition("://")[2].rstrip("/").lower() == host_header.strip().lower()

    @staticmethod
    def actor(remote: str | None, operator: str | None) -> str:
        """The actor of an operator action from the console: ``console:<remote address>``,
        or ``console:<name>@<remote address>`` when the operator typed a name."""
        where = remote or "unknown"
        name = "".join(c for c in (operator or "").strip() if c.isprintable())[:64]
        return f"console:{name}@{where}" if name else f"console:{where}"
