"""The database URL: checked once, before any connection, and named in messages.

A URL that can never work (not a PostgreSQL URL, libpq cannot parse it, a port outside
1..65535) is a configuration error, found at once: without this check the relay and the
consumers, which wait for a database that is down (fail-safe, docs/relay.md "Health"),
would retry it forever. A server that is down is not found here: that one is waited for.

What to do about a failed database call (:func:`database_remedy`) is one line: the cause
and the fix (start the server at host:port, run ``ledgerbox migrate``, GRANT, ...).

Pure: no I/O, no clock; psycopg's conninfo parser (libpq's own rules, no connection) is
the only import, made when a URL is checked.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ledgerbox._core.errors import ConfigurationError, DatabaseError, LedgerboxError
from ledgerbox._core.faults import login_refused

__all__ = ["check_database_url", "database_label", "database_remedy", "libpq_url"]

_SCHEMES = ("postgresql", "postgres")
_FORM = "postgresql+psycopg://user:password@host:5432/database"


def libpq_url(url: str) -> str:
    """``url`` without SQLAlchemy's ``+driver`` suffix (``postgresql+psycopg://`` ->
    ``postgresql://``), the form libpq and psycopg read."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme.split('+', 1)[0]}{sep}{rest}"


def check_database_url(url: str, setting: str = "database_url") -> None:
    """Refuse a database URL that can never connect.

    Parameters
    ----------
    url : str
        SQLAlchemy form (``postgresql+psycopg://...``) or libpq form (``postgresql://``,
        ``postgres://``), several hosts allowed (``h1:5432,h2:5433``).
    setting : str
        The setting named in the error (``ConfigurationError.setting``).

    Raises
    ------
    ledgerbox.ConfigurationError
        Not a PostgreSQL URL, libpq refuses its syntax (an unknown query parameter, a bad
        percent-encoding), or a port is not an integer in 1..65535. The message never
        shows the URL (it may hold a password).
    """
    scheme, sep, _rest = url.partition("://")
    if not sep or scheme.split("+", 1)[0].lower() not in _SCHEMES:
        raise ConfigurationError(
            f"{setting} is not a PostgreSQL URL: give {_FORM}", setting=setting
        )
    plain = libpq_url(url)
    from psycopg import Error as PsycopgError
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(plain)
    except PsycopgError:
        raise ConfigurationError(
            f"{setting} does not parse as a PostgreSQL URL (a misspelt query parameter or a "
            f"bad %-escape?): give {_FORM}",
            setting=setting,
        ) from None
    for port in str(parts.get("port") or "").split(","):
        if port and not (port.isdigit() and 1 <= int(port) <= 65535):
            # The value is not shown: in a URL with an unencoded password it may be a part of it.
            raise ConfigurationError(
                f"{setting} has a port that is not a TCP port (an integer in 1..65535)",
                setting=setting,
            )


def database_label(url: str) -> str:
    """``host:port/database`` of ``url`` for messages (never the user or the password);
    ``"(database)"`` when it cannot be read."""
    try:
        split = urlsplit(libpq_url(url))
        hosts = split.netloc.rpartition("@")[2]
    except ValueError:
        return "(database)"
    named = ",".join(_with_port(h) for h in (hosts or "localhost").split(","))
    return f"{named}/{split.path.lstrip('/')}"


def _with_port(host: str) -> str:
    if host.startswith("["):  # IPv6: [::1] or [::1]:5432
        return host if "]:" in host else f"{host}:5432"
    return host if ":" in host else f"{host}:5432"


def database_remedy(exc: DatabaseError, where: str, *, url_flag: str = "--database-url") -> str:
    """``exc`` as ONE line with what to do about it.

    Parameters
    ----------
    exc : ledgerbox.DatabaseError
        A failed database call. One raised from another ledgerbox error was already given
        its fix by the seam that raised it (e.g. the missing audit table): returned as is.
    where : str
        ``host:port/database`` (:func:`database_label`).
    url_flag : str
        The flag that sets the URL, named in the fix.

    Returns
    -------
    str
        The cause and the fix: the server unreachable (start it, check ``where``), the
        login refused, the database or a table missing (``ledgerbox migrate``), a privilege
        missing (GRANT); otherwise ``exc``'s own message.
    """
    if isinstance(exc.__cause__, LedgerboxError):
        return str(exc)
    state = exc.sqlstate or ""
    if login_refused(exc):
        return (
            f"the database at {where} refused the login ({exc}): fix the user or password "
            f"of {url_flag}"
        )
    if state == "3D000":
        return f"{exc}: create the database, or fix the database name of {url_flag}"
    if state in ("42P01", "3F000"):
        return (
            f"{exc}: the ledgerbox tables are missing or behind in {where}: run "
            "`ledgerbox migrate` (or check --schema and the table names)"
        )
    if state == "42501":
        return (
            f"{exc}: GRANT this role the privilege on the table (docs/security.md, "
            '"Least privilege")'
        )
    if not state or state.startswith("08") or state in ("57P01", "57P02", "57P03"):
        return (
            f"the database at {where} is unreachable ({exc}): start the server at "
            f"{where.partition('/')[0]}, or fix the host/port of {url_flag}"
        )
    return str(exc)
