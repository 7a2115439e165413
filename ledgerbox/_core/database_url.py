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

import os
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit

from ledgerbox._core.errors import ConfigurationError, DatabaseError, LedgerboxError
from ledgerbox._core.faults import login_identity, login_refused

__all__ = [
    "CONNECT_TIMEOUT_S",
    "check_database_url",
    "connect_args",
    "database_label",
    "database_remedy",
    "libpq_url",
    "refused_login",
    "sqlalchemy_url",
]

_SCHEMES = ("postgresql", "postgres")

#: libpq's ``connect_timeout`` of every connection ledgerbox opens itself (the relay's, the
#: consumers' engines, the operator commands', the console's, migrate's), in seconds, unless
#: the URL's query (``?connect_timeout=N``) or ``PGCONNECT_TIMEOUT`` sets one. Without it a
#: server that does not answer (a host that is down, a firewall that drops packets) held a
#: connection attempt for the kernel's TCP retries, about two minutes: an operator command
#: printed nothing for that long, a consumer's transaction waited as long per attempt.
CONNECT_TIMEOUT_S = 5

#: libpq's TCP settings of every connection ledgerbox opens itself, each unless the URL's
#: query sets it. A server that vanished without closing its connections (a host lost in a
#: failover, a NAT or load balancer entry dropped) sends nothing and never will: a consumer
#: waiting for the answer to a query it sent held its partition for ever (no error, its Kafka
#: heartbeats kept the partition assigned). The relay had keepalives already.
#: Keepalive probes after 10 s of silence, every 5 s, and ``tcp_user_timeout`` (ms): on
#: Linux the user timeout then decides when unanswered probes end the connection (tcp(7):
#: it overrides the probe count), so a silent dead server is noticed after ~30-40 s, and
#: data sent and never acknowledged after 30 s (``OperationalError``, an environment fault:
#: retried on a new connection). A slow query is not limited: the server's kernel
#: acknowledges the request and answers the probes while it runs (a client sending more than
#: the socket buffers to a server that reads nothing for 30 s would be cut off). Skipped
#: with a libpq older than 12, which does not know ``tcp_user_timeout``. Source: libpq
#: "Parameter Key Words", tcp(7).
TCP_ARGS: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}
_FORM = "postgresql+psycopg://user:password@host:5432/database"


def libpq_url(url: str) -> str:
    """``url`` without SQLAlchemy's ``+driver`` suffix (``postgresql+psycopg://`` ->
    ``postgresql://``), the form libpq and psycopg read."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme.split('+', 1)[0]}{sep}{rest}"


def sqlalchemy_url(url: str) -> str:
    """``url`` for a SQLAlchemy engine on psycopg 3, the one driver ledgerbox connects with.

    The libpq forms (``postgresql://``, ``postgres://``) and a URL naming another driver
    (``postgresql+psycopg2://``, ``+asyncpg``) become ``postgresql+psycopg://``, as the relay,
    which hands the libpq form to psycopg, has always read them: SQLAlchemy alone picks
    psycopg2 for ``postgresql://``, which ledgerbox does not install (a
    ``ModuleNotFoundError`` traceback from ``migrate``, ``consumer check``...). Any other URL
    is returned as it is (:func:`check_database_url` refuses it)."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme.split("+", 1)[0].lower() in _SCHEMES:
        return f"postgresql+psycopg://{rest}"
    return url


def check_database_url(
    url: str, setting: str = "database_url", *, reader: Literal["libpq", "sqlalchemy"] = "libpq"
) -> None:
    """Refuse a database URL that can never connect.

    Parameters
    ----------
    url : str
        SQLAlchemy form (``postgresql+psycopg://...``) or libpq form (``postgresql://``,
        ``postgres://``), several hosts allowed (``h1:5432,h2:5433``).
    setting : str
        The setting named in the error (``ConfigurationError.setting``).
    reader : {"libpq", "sqlalchemy"}
        Who reads the URL: ``"libpq"`` (the relay hands it to libpq as a URI, whose rules are
        strict: a space in a password must be written ``%20``) or ``"sqlalchemy"`` (the
        consumers and the operator commands: SQLAlchemy splits it and hands the parts to
        psycopg, so what SQLAlchemy accepts, e.g. a password with a space as
        ``URL.render_as_string`` writes it, works).

    Raises
    ------
    ledgerbox.ConfigurationError
        Not a PostgreSQL URL, its reader refuses its syntax (an unknown query parameter, a
        bad percent-encoding), or a port is not an integer in 1..65535. The message never
        shows the URL (it may hold a password).
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.split("+", 1)[0].lower() not in _SCHEMES:
        raise ConfigurationError(
            f"{setting} is not a PostgreSQL URL: give {_FORM}", setting=setting
        )
    authority = rest.split("/", 1)[0].split("?", 1)[0]
    if authority.count("@") > 1:
        # user:p@ss@host: libpq took "ss@host" for the host and said "unreachable" forever.
        raise ConfigurationError(
            f"{setting} has more than one '@' before the host: write an '@' in the user name"
            " or the password as %40",
            setting=setting,
        )
    ports = (
        _sqlalchemy_ports(url, setting) if reader == "sqlalchemy" else _libpq_ports(url, setting)
    )
    for port in ports:
        if port and not (port.isdigit() and 1 <= int(port) <= 65535):
            # The value is not shown: in a URL with an unencoded password it may be a part of it.
            raise ConfigurationError(
                f"{setting} has a port that is not a TCP port (an integer in 1..65535)",
                setting=setting,
            )


#: libpq options whose value is one of a few words: a misspelt one makes every connection
#: fail before it is attempted ("invalid sslmode value"), which read as "unreachable".
_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "target_session_attrs": (
        "any",
        "read-write",
        "read-only",
        "primary",
        "standby",
        "prefer-standby",
    ),
    "load_balance_hosts": ("disable", "random"),
}


def _check_choices(options: Mapping[str, Any], setting: str) -> None:
    for name, allowed in _CHOICES.items():
        value = options.get(name)
        if value is not None and str(value) not in allowed:
            raise ConfigurationError(
                f"{setting} has {name}={value!r}, which libpq refuses: use one of"
                f" {', '.join(allowed)}",
                setting=setting,
            )


def _unparsable(setting: str) -> ConfigurationError:
    return ConfigurationError(
        f"{setting} does not parse as a PostgreSQL URL (a misspelt query parameter, a bad "
        f"%-escape, a space not written %20?): give {_FORM}",
        setting=setting,
    )


def _libpq_ports(url: str, setting: str) -> list[str]:
    from psycopg import Error as PsycopgError
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(libpq_url(url))
    except PsycopgError:
        raise _unparsable(setting) from None
    _check_choices(parts, setting)
    return str(parts.get("port") or "").split(",")


def _sqlalchemy_ports(url: str, setting: str) -> list[str]:
    from psycopg import Error as PsycopgError
    from psycopg.conninfo import make_conninfo
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
        port = parsed.port
    except ValueError:  # SQLAlchemy's int() of a port that is not a number
        return ["not-a-number"]
    except ArgumentError:
        raise _unparsable(setting) from None
    # The query parameters go to libpq as connection options: one it does not know can never
    # connect. (make_conninfo validates through libpq's parser.)
    options = {
        key: value if isinstance(value, str) else value[-1] for key, value in parsed.query.items()
    }
    try:
        make_conninfo("", **options)
    except PsycopgError:
        raise _unparsable(setting) from None
    _check_choices(options, setting)
    return [] if port is None else [str(port)]


def _libpq_version() -> int:
    """The libpq psycopg runs on (e.g. 170002), 0 when it cannot be told."""
    try:
        from psycopg import pq

        return int(pq.version())
    except Exception:  # an import or binding problem: assume the oldest
        return 0


def connect_args(url: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The driver arguments ledgerbox adds to a connection of ``url``:
    ``connect_timeout`` (:data:`CONNECT_TIMEOUT_S`) unless the URL's query or
    ``PGCONNECT_TIMEOUT`` (in ``environ``, default ``os.environ``) sets it (libpq then reads
    it), and the TCP keepalive and user timeout of :data:`TCP_ARGS`, each unless the URL's
    query sets it. For SQLAlchemy's ``create_engine(url, connect_args=...)`` and psycopg's
    ``connect(url, **...)``; no I/O."""
    env = os.environ if environ is None else environ
    try:
        query = urlsplit(libpq_url(url)).query
    except ValueError:
        query = ""
    given = {key for key, _value in parse_qsl(query)}
    args: dict[str, Any] = {k: v for k, v in TCP_ARGS.items() if k not in given}
    if _libpq_version() < 120000:
        args.pop("tcp_user_timeout", None)  # libpq 12 added it; older ones refuse to connect
    if not env.get("PGCONNECT_TIMEOUT") and "connect_timeout" not in given:
        args["connect_timeout"] = CONNECT_TIMEOUT_S
    return args


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


def refused_login(exc: BaseException, where: str, url_flag: str = "--database-url") -> str:
    """The ONE line of a login the server refused (:func:`ledgerbox._core.faults.
    login_refused`), naming the user and the database libpq asked for.

    A refused password, an unknown user and a database that does not exist look the same to
    the client: libpq gives a connection error no SQLSTATE, and ledgerbox never reads the
    server's (translatable) message text. So the line names both the user and the database,
    and says when the URL names no database (libpq then takes the user name): the operator
    sees which of the three is wrong.
    """
    user, database = login_identity(exc)
    who = f"the login of user {user!r}" if user else "the login"
    if database:
        who += f" to database {database!r}"
    unnamed = ""
    if where.endswith("/"):  # the URL names no database (database_label)
        unnamed = " (the URL names no database: libpq took the user name)"
    missing = f"no database {database!r} there{unnamed}" if database else "no such database"
    return (
        f"the database server at {where.partition('/')[0]} refused {who} ({exc}): a wrong or "
        f"missing password, an unknown user, or {missing}: fix the user, the password or the "
        f"database name of {url_flag}"
    )


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
        login refused (:func:`refused_login`: the user and the database named), the
        database or a table missing (``ledgerbox migrate``), a privilege missing (GRANT);
        otherwise ``exc``'s own message.
    """
    if isinstance(exc.__cause__, LedgerboxError):
        return str(exc)
    state = exc.sqlstate or ""
    if login_refused(exc):
        return refused_login(exc, where, url_flag)
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
