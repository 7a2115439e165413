"""Whose fault is it: the ONE classification of driver errors (PostgreSQL, Kafka, OS).

Every seam that talks to a driver (the relay store, the inbox transaction, the Kafka edges)
translates a driver error into a library error carrying a :class:`Fault` taken from the
tables below; the pure policy modules read only that :class:`Fault`, never a driver class,
never a message text.

The rule (docs/guarantees.md, "Whose fault is it"): a message is dead-lettered only for a
fault of THAT message (:attr:`Fault.MESSAGE`, or a :attr:`Fault.TRANSIENT` error that kept
failing for that message alone). A fault of the environment (:attr:`Fault.ENVIRONMENT`:
connection, schema missing or behind, grants, read-only, authentication, disk full, locks,
operator intervention) stops progress, is reported as health ``down`` with its cause, and is
retried without bound until it is fixed; no message is blamed for it. An unknown database
error counts as a fault of the environment: a wrong "environment" costs a pause, a wrong
"message" loses a good event to the dead-letter topic.
"""

from __future__ import annotations

import enum
import functools

__all__ = [
    "PERMANENT_CONFIRM_S",
    "Fault",
    "PermanentVerdict",
    "describe_driver_error",
    "driver_fault",
    "kafka_fault",
    "login_identity",
    "login_refused",
    "sqlstate_fault",
]


class Fault(enum.Enum):
    """Whose fault a failed call is, and therefore what the caller does about it."""

    #: A unique violation (23505): the row exists. The caller decides by constraint name
    #: (the inbox key: a duplicate delivery; any other constraint: the message's fault).
    DUPLICATE = "duplicate"
    #: May succeed when the same work is retried soon in a fresh transaction (serialization
    #: failure, deadlock, an invalid transaction state). Retried a bounded number of times.
    TRANSIENT = "transient"
    #: The environment is away or misconfigured. Retried without bound; health ``down``.
    ENVIRONMENT = "environment"
    #: The message itself is refused (bad data, a constraint, a record too large).
    MESSAGE = "message"


_ENV = Fault.ENVIRONMENT
_MSG = Fault.MESSAGE
_TRANSIENT = Fault.TRANSIENT

#: SQLSTATE class (first two characters) -> fault. Source: PostgreSQL documentation,
#: Appendix A "PostgreSQL Error Codes". A class that is not listed is ENVIRONMENT.
SQLSTATE_CLASSES: dict[str, Fault] = {
    "08": _ENV,  # connection exception
    "09": _MSG,  # triggered action exception
    "0A": _ENV,  # feature not supported (server version or configuration)
    "0B": _TRANSIENT,  # invalid transaction initiation
    "0L": _ENV,  # invalid grantor
    "0P": _ENV,  # invalid role specification
    "20": _MSG,  # case not found
    "21": _MSG,  # cardinality violation
    "22": _MSG,  # data exception (invalid text representation, numeric value out of range...)
    "23": _MSG,  # integrity constraint violation (23505: see SQLSTATE_CODES)
    "24": _TRANSIENT,  # invalid cursor state
    "25": _TRANSIENT,  # invalid transaction state (25006 read-only: see SQLSTATE_CODES)
    "26": _ENV,  # invalid SQL statement name (a prepared statement vanished: pooler, restart)
    "27": _MSG,  # triggered data change violation
    "28": _ENV,  # invalid authorization specification (authentication)
    "2B": _TRANSIENT,  # dependent privilege descriptors still exist
    "2D": _TRANSIENT,  # invalid transaction termination
    "2F": _MSG,  # SQL routine exception
    "34": _TRANSIENT,  # invalid cursor name
    "38": _MSG,  # external routine exception
    "39": _MSG,  # external routine invocation exception
    "3B": _TRANSIENT,  # savepoint exception
    "3D": _ENV,  # invalid catalog name (the database does not exist)
    "3F": _ENV,  # invalid schema name (not migrated)
    "40": _TRANSIENT,  # transaction rollback: serialization failure, deadlock
    "42": _ENV,  # syntax error or access rule violation: undefined table/column, privilege
    "44": _MSG,  # WITH CHECK OPTION violation
    "53": _ENV,  # insufficient resources: disk full, out of memory, too many connections
    "54": _MSG,  # program limit exceeded (statement too complex for this message's data)
    "55": _ENV,  # object not in prerequisite state: lock not available, object in use
    "57": _ENV,  # operator intervention: shutdown, cannot connect now, query canceled
    "58": _ENV,  # system error (I/O)
    "72": _ENV,  # snapshot too old
    "F0": _ENV,  # configuration file error
    "HV": _ENV,  # foreign data wrapper error
    "P0": _MSG,  # PL/pgSQL: RAISE EXCEPTION of a trigger (a business rule), no data found
    "XX": _ENV,  # internal error, data corrupted
}

#: Single SQLSTATEs whose fault differs from their class's.
SQLSTATE_CODES: dict[str, Fault] = {
    "23505": Fault.DUPLICATE,  # unique_violation
    "25006": _ENV,  # read_only_sql_transaction (a replica, default_transaction_read_only)
    "25P03": _ENV,  # idle_in_transaction_session_timeout (the server closed the session)
    "40003": _TRANSIENT,  # statement_completion_unknown
}


def sqlstate_fault(sqlstate: str | None) -> Fault:
    """The fault of a PostgreSQL error by its SQLSTATE; ``None`` (a client-side failure such
    as a lost connection) and unknown classes are :attr:`Fault.ENVIRONMENT`."""
    if not sqlstate:
        return _ENV
    return SQLSTATE_CODES.get(sqlstate) or SQLSTATE_CLASSES.get(sqlstate[:2], _ENV)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc``, the driver error SQLAlchemy wraps (``.orig``), and their causes, once each."""
    out: list[BaseException] = []
    todo: list[BaseException] = [exc]
    seen: set[int] = set()
    while todo:
        item = todo.pop(0)
        if id(item) in seen:
            continue
        seen.add(id(item))
        out.append(item)
        orig = getattr(item, "orig", None)
        if isinstance(orig, BaseException):
            todo.append(orig)
        if item.__cause__ is not None:
            todo.append(item.__cause__)
    return out


def _from_module(exc: BaseException, prefix: str) -> bool:
    # Checked by the modules of the class hierarchy, not by import, so that the relay, which
    # never imports SQLAlchemy, stays light (and subclasses of driver errors count).
    return any(cls.__module__.startswith(prefix) for cls in type(exc).__mro__)


def _is_sqlalchemy_error(exc: BaseException) -> bool:
    return _from_module(exc, "sqlalchemy.")


def _is_psycopg_error(exc: BaseException) -> bool:
    return _from_module(exc, "psycopg")


def driver_fault(exc: BaseException) -> tuple[Fault, str | None, str | None] | None:
    """``(fault, sqlstate, constraint)`` if ``exc`` is a database driver error (psycopg,
    SQLAlchemy, or one they wrap or caused), else ``None``.

    The SQLSTATE comes from psycopg (``exc.sqlstate``, also under SQLAlchemy's ``.orig``);
    ``constraint`` is ``diag.constraint_name`` when the server named one. Errors without a
    SQLSTATE are client side: a lost, refused or timed-out connection, an invalidated pooled
    connection, a pool timeout (all :attr:`Fault.ENVIRONMENT`), except psycopg's own
    ``DataError`` (a parameter it cannot send, e.g. text with a NUL: :attr:`Fault.MESSAGE`).
    """
    chain = _chain(exc)
    if not any(_is_sqlalchemy_error(e) or _is_psycopg_error(e) for e in chain):
        return None
    for item in chain:
        state = getattr(item, "sqlstate", None)
        if isinstance(state, str) and state:
            diag = getattr(item, "diag", None)
            constraint = getattr(diag, "constraint_name", None)
            return sqlstate_fault(state), state, constraint if isinstance(constraint, str) else None
    if any(type(item).__name__ == "DataError" and _is_psycopg_error(item) for item in chain):
        # psycopg refused a parameter before sending it (a NUL in a text value): the
        # data's fault, as the server's class 22 is; as ENVIRONMENT it was retried without
        # bound (a consumer's partition stopped for good on one such record).
        return _MSG, None, None
    top = type(exc).__name__
    if top in {"PendingRollbackError", "ResourceClosedError", "InvalidRequestError"}:
        # SQLAlchemy session state (a flush failed earlier in this transaction): a fresh
        # transaction fixes it.
        return _TRANSIENT, None, None
    return _ENV, None, None


def login_refused(exc: BaseException) -> bool:
    """True if the database server answered and refused this login (a wrong or missing
    password, an unknown user or database): an ENVIRONMENT fault that waiting does not fix,
    so the daemons' startup checks call it permanent.

    An SQLSTATE of class 28 (invalid authorization) says so; a connection-time error carries
    none in libpq, so libpq's own account is read too: the server asked for a password
    (``needs_password``: none was given) or took ours (``used_password``) before the
    connection failed. The message text is never read. ``exc`` may be wrapped (SQLAlchemy's
    ``.orig``, a library error's ``__cause__``).
    """
    for item in _chain(exc):
        state = getattr(item, "sqlstate", None)
        if isinstance(state, str) and state.startswith("28"):
            return True
        pgconn = getattr(item, "pgconn", None)
        if pgconn is not None:
            return bool(getattr(pgconn, "used_password", False)) or bool(
                getattr(pgconn, "needs_password", False)
            )
    return False


def login_identity(exc: BaseException) -> tuple[str | None, str | None]:
    """``(user, database)`` of the connection attempt that failed with ``exc``, as libpq
    resolved them (the URL's, else its defaults: ``PGUSER``/``PGDATABASE``, the user name as
    the database when the URL names none); ``(None, None)`` when ``exc`` carries no libpq
    connection. Never the password."""
    for item in _chain(exc):
        pgconn = getattr(item, "pgconn", None)
        if pgconn is not None:
            return _text(getattr(pgconn, "user", None)), _text(getattr(pgconn, "db", None))
    return None, None


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace") or None
    return value if isinstance(value, str) and value else None


#: How long a startup check's "permanent" verdict (a refused login, an unknown database, Kafka
#: refusing the credentials) must hold before a daemon exits on it, in seconds.
PERMANENT_CONFIRM_S = 2.0


class PermanentVerdict:
    """Whether a startup check's permanent verdict held long enough to exit on it (pure: the
    caller passes the clock).

    A refused login is known to the client only by libpq's account of the connection (the
    server took our password, then the connection failed: :func:`login_refused`), and a
    server restarting or going into recovery closes a connection right after taking the
    password too: the soak saw a consumer exit 2 with "refused the login" during a PostgreSQL
    restart. A real refusal repeats; a restart does not. So that verdict counts only once the
    checks over :data:`PERMANENT_CONFIRM_S` said so: the daemons look once more after it (a
    wrong password is reported ~2 s later, after two logins). An unambiguous refusal (Kafka's
    SaslAuthenticationFailed) is not rechecked: one login, no retry storm.

    Parameters
    ----------
    window_s : float | None
        Seconds the verdict must hold (``None``: :data:`PERMANENT_CONFIRM_S`, read now).
    """

    def __init__(self, window_s: float | None = None) -> None:
        self.window_s = PERMANENT_CONFIRM_S if window_s is None else window_s
        self._since: float | None = None

    def holds(self, permanent: bool, now: float) -> bool:
        """Record one check's verdict at ``now`` (monotonic seconds); True once permanent
        verdicts, with no other in between, span ``window_s``."""
        if not permanent:
            self._since = None
            return False
        if self._since is None:
            self._since = now
        return now - self._since >= self.window_s


def describe_driver_error(exc: BaseException) -> str:
    """One line naming a driver error: its class, SQLSTATE and the server's primary message
    (never the SQL statement or its parameters, which may hold secrets or payloads)."""
    for item in _chain(exc):
        state = getattr(item, "sqlstate", None)
        if isinstance(state, str) and state:
            diag = getattr(item, "diag", None)
            primary = getattr(diag, "message_primary", None) or _first_line(item)
            return f"{type(item).__name__} (SQLSTATE {state}): {primary}"
    for item in _chain(exc):
        if _is_psycopg_error(item) or isinstance(item, OSError):
            return f"{type(item).__name__}: {_first_line(item)}"
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "no detail"


@functools.cache
def kafka_tables() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """``(message, environment)``: the Kafka error classes whose record is at fault, and
    those where the cluster or our access to it is wrong. Built on first use, so that the
    write path, which imports this module's neighbours, never loads aiokafka.

    Message: retrying the same bytes to the same topic cannot succeed. Source: Kafka protocol
    error codes (MESSAGE_TOO_LARGE 10, RECORD_LIST_TOO_LARGE 18, CORRUPT_MESSAGE 2,
    INVALID_TIMESTAMP 32) and aiokafka's client-side RecordTooLarge. (The relay never lets a
    timestamp refusal dead-letter an event: see ``ledgerbox.relay``.)

    Environment: topic or cluster authorization, unknown topic (auto-creation off), broker
    policy, SASL and authentication, a record format the broker does not take, no broker
    reachable. Retried without bound; health down.
    """
    from aiokafka import errors as kerr

    message: tuple[type[BaseException], ...] = (
        kerr.MessageSizeTooLargeError,
        kerr.RecordTooLargeError,
        kerr.RecordListTooLargeError,
        kerr.CorruptRecordException,
        kerr.InvalidTimestampError,
    )
    environment: tuple[type[BaseException], ...] = (
        kerr.TopicAuthorizationFailedError,
        kerr.ClusterAuthorizationFailedError,
        kerr.GroupAuthorizationFailedError,
        kerr.TransactionalIdAuthorizationFailed,
        kerr.UnknownTopicOrPartitionError,
        kerr.InvalidTopicError,
        kerr.PolicyViolationError,
        kerr.UnsupportedForMessageFormatError,
        kerr.UnsupportedSaslMechanismError,
        kerr.IllegalSaslStateError,
        kerr.SaslAuthenticationFailed,
        kerr.AuthenticationFailedError,
        kerr.AuthenticationMethodNotSupported,
        kerr.NoBrokersAvailable,
        kerr.KafkaConnectionError,
        OSError,
    )
    return message, environment


def kafka_fault(exc: BaseException) -> Fault:
    """The fault of a Kafka client error by its class; anything not known to be the record's
    fault nor the environment's is :attr:`Fault.TRANSIENT` (a wrong "transient" costs
    retries, a wrong "message" would dead-letter a good event)."""
    message, environment = kafka_tables()
    if isinstance(exc, message):
        return _MSG
    if isinstance(exc, environment):
        return _ENV
    return _TRANSIENT
