"""The error tree of ledgerbox: one root, every public error below it.

::

    ledgerbox.LedgerboxError
    ├── ledgerbox.ConfigurationError        a setting or name is invalid (also ValueError)
    ├── ledgerbox.DatabaseError             a database call failed (fault, sqlstate, constraint)
    ├── ledgerbox.BrokerError               a Kafka call failed (fault, kind)
    ├── ledgerbox.outbox
    │   ├── EventValidationError            an event cannot be written (also ValueError)
    │   │   ├── EventIdConflictError        its event id is stored under another idempotency key
    │   │   ├── FutureEventTimeError        occurred_at beyond ``max_future_s`` (Kafka refuses it)
    │   │   ├── NaiveDatetimeError          a datetime without tzinfo in envelope or payload
    │   │   ├── NonFiniteNumberError        NaN or Infinity in the payload (JSON has neither)
    │   │   ├── PayloadTooLargeError        serialized payload above ``max_payload_bytes``
    │   │   └── UnroutedEventError          no topic route for the event/aggregate type
    │   └── EnvelopeParseError              a Kafka record is not a ledgerbox event
    ├── ledgerbox.relay
    │   └── RelayError                      the relay could not do something
    │       ├── StoreError                  (also DatabaseError)
    │       └── PublishError                (also BrokerError)
    ├── ledgerbox.migrations
    │   └── MigrationError                  the tables cannot be migrated as asked (says why)
    └── ledgerbox.inbox
        └── InboxError                      any inbox failure
            ├── VersionConflictError        optimistic version check matched no row (G5)
            ├── FencedWriteError            a fenced write was refused: a newer holder wrote
            ├── LockBusyError               the per-aggregate lock stayed taken
            ├── RedisUnavailableError       Redis did not answer; the DB path carries on (G6)
            └── DeadLetterError             (also BrokerError) a dead-letter send failed

Driver errors (psycopg, SQLAlchemy, aiokafka, redis) are translated into these only at the
seams (the relay store, the inbox store and transaction, the Redis edges, the Kafka edges),
classified from ONE table (:mod:`ledgerbox._core.faults`) by SQLSTATE or error class, never by
message text. Every exception reports its public import path (``__module__``).
"""

from __future__ import annotations

from typing import Self

from ledgerbox._core.faults import Fault, describe_driver_error, driver_fault, kafka_fault

__all__ = [
    "BrokerError",
    "ConfigurationError",
    "DatabaseError",
    "LedgerboxError",
    "kafka_unreachable",
]


class LedgerboxError(Exception):
    """Root of every error raised by ledgerbox (``outbox``, ``relay``, ``inbox``)."""

    __module__ = "ledgerbox"


class ConfigurationError(LedgerboxError, ValueError):
    """A configuration value is invalid (e.g. a table name that is not a SQL identifier).

    Attributes
    ----------
    setting : str | None
        The setting (config field) at fault, e.g. ``"batch_size"``, when one is; the command
        line names its flag and environment variables from it (docs/configuration.md).
    """

    __module__ = "ledgerbox"

    def __init__(self, message: str, *, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting


class DatabaseError(LedgerboxError):
    """A database call failed. Translated from the driver's error (psycopg, SQLAlchemy) at
    the seam that made the call; the driver's error is the ``__cause__``.

    Attributes
    ----------
    fault : Fault
        Whose fault it is (``ledgerbox._core.faults``): ``ENVIRONMENT`` (connection, schema,
        grants, read-only, disk...), ``TRANSIENT``, ``MESSAGE`` or ``DUPLICATE``.
    sqlstate : str | None
        The server's SQLSTATE, ``None`` for a client-side failure (connection lost).
    constraint : str | None
        The constraint the server named (unique and foreign key violations), else ``None``.
    """

    __module__ = "ledgerbox"

    def __init__(
        self,
        message: str,
        *,
        fault: Fault,
        sqlstate: str | None = None,
        constraint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.fault = fault
        self.sqlstate = sqlstate
        self.constraint = constraint

    @classmethod
    def translate(cls, exc: BaseException, what: str) -> Self | None:
        """The library error for the driver error ``exc`` raised by ``what`` (e.g.
        ``"claim"``), or ``None`` when ``exc`` is not a database driver error."""
        found = driver_fault(exc)
        if found is None:
            return None
        fault, sqlstate, constraint = found
        return cls(
            f"{what} failed: {describe_driver_error(exc)}",
            fault=fault,
            sqlstate=sqlstate,
            constraint=constraint,
        )


class BrokerError(LedgerboxError):
    """A Kafka call failed. Translated from aiokafka's error at the Kafka seam that made the
    call; aiokafka's error is the ``__cause__``.

    Attributes
    ----------
    fault : Fault
        ``MESSAGE`` (this record is refused for good: too large, corrupt), ``ENVIRONMENT``
        (authorization, unknown topic, SASL, no broker) or ``TRANSIENT``.
    kind : str
        The Kafka client's error class name, e.g. ``"NotEnoughReplicasError"`` (for logs and
        for the few rules that depend on the exact refusal, such as a refused timestamp).
    no_broker : bool
        The client reached no broker at all (down, a wrong address, or a listener that
        closes on it: TLS or SASL settings that do not match), as opposed to a broker that
        answered with a refusal.
    """

    __module__ = "ledgerbox"

    def __init__(self, message: str, *, fault: Fault, kind: str, no_broker: bool = False) -> None:
        super().__init__(message)
        self.fault = fault
        self.kind = kind
        self.no_broker = no_broker

    @classmethod
    def translate(cls, exc: BaseException, what: str, *, servers: str | None = None) -> Self:
        """The library error for the Kafka client error ``exc`` raised by ``what``.

        ``servers`` (the bootstrap servers the client was given): a client that reached no
        broker (aiokafka's ``KafkaConnectionError``, a refused or reset connection) is then
        said as :func:`kafka_unreachable` says it, with the fix."""
        if isinstance(exc, cls):
            return exc
        name = type(exc).__name__
        text = str(exc).strip().splitlines()
        first = text[0] if text else ""
        if first.startswith(f"{name}: "):  # aiokafka's errors repeat their class name
            first = first[len(name) + 2 :]
        fault, no_broker = kafka_fault(exc), _no_broker(exc, first)
        if servers is not None and no_broker:
            detail = "no bootstrap server answered" if "bootstrap" in first else first or name
            message = f"{what} failed: {kafka_unreachable(servers, detail)}"
        else:
            message = f"{what} failed: {name}{': ' + first if first else ''}"
        return cls(message, fault=fault, kind=name, no_broker=no_broker)


def kafka_unreachable(servers: str, detail: str = "no bootstrap server accepts connections") -> str:
    """The ONE line every command and daemon prints when no broker of ``servers`` answers:
    ``"Kafka is unreachable at <servers> (<detail>): start it, or fix
    --kafka-bootstrap-servers / KAFKA_BOOTSTRAP_SERVERS"`` (docs/security.md, "What you see
    when a setting is wrong")."""
    return (
        f"Kafka is unreachable at {servers} ({detail}): start it, or fix "
        "--kafka-bootstrap-servers / KAFKA_BOOTSTRAP_SERVERS"
    )


def _no_broker(exc: BaseException, text: str) -> bool:
    # No broker reached at all, as opposed to a broker that answered with a refusal.
    if isinstance(exc, ConnectionError):
        return True
    return type(exc).__name__ == "KafkaConnectionError" or "Unable to bootstrap" in text
