"""The ONE classification of driver errors (ledgerbox._core.faults): every seam uses it, so
the relay and the inbox can never disagree on whose fault a database or Kafka error is."""

from __future__ import annotations

import psycopg
import psycopg.errors as pe
import pytest
import sqlalchemy.exc as sa_exc
from aiokafka import errors as kerr

from ledgerbox import BrokerError, DatabaseError
from ledgerbox._core.faults import Fault, driver_fault, kafka_fault, sqlstate_fault
from ledgerbox.relay import StoreError

ENV, MSG, TRANSIENT, DUP = Fault.ENVIRONMENT, Fault.MESSAGE, Fault.TRANSIENT, Fault.DUPLICATE


@pytest.mark.parametrize(
    ("sqlstate", "fault"),
    [
        (None, ENV),  # client side: connection lost or refused
        ("08006", ENV),  # connection failure
        ("28P01", ENV),  # invalid password
        ("3D000", ENV),  # database does not exist
        ("3F000", ENV),  # schema does not exist
        ("42P01", ENV),  # undefined table: not migrated
        ("42703", ENV),  # undefined column: schema behind
        ("42883", ENV),  # undefined function
        ("42501", ENV),  # insufficient privilege (REVOKE)
        ("25006", ENV),  # read-only transaction (replica, default_transaction_read_only)
        ("53100", ENV),  # disk full
        ("53200", ENV),  # out of memory
        ("53300", ENV),  # too many connections
        ("55006", ENV),  # object in use
        ("55P03", ENV),  # lock not available (lock_timeout)
        ("57014", ENV),  # query canceled (statement_timeout)
        ("57P01", ENV),  # admin shutdown
        ("XX000", ENV),  # internal error
        ("ZZ999", ENV),  # unknown: never blames the message
        ("40001", TRANSIENT),  # serialization failure
        ("40P01", TRANSIENT),  # deadlock
        ("25P02", TRANSIENT),  # in failed transaction
        ("23505", DUP),
        ("23503", MSG),  # foreign key violation
        ("23502", MSG),  # not null violation
        ("23514", MSG),  # check violation
        ("22P02", MSG),  # invalid text representation
        ("22003", MSG),  # numeric value out of range
        ("P0001", MSG),  # RAISE EXCEPTION in a trigger: a business rule
    ],
)
def test_sqlstate_table(sqlstate: str | None, fault: Fault) -> None:
    assert sqlstate_fault(sqlstate) is fault


def wrapped(orig: Exception) -> BaseException:
    return sa_exc.DBAPIError.instance("INSERT ...", {"secret": "p4ss"}, orig, psycopg.Error)


def test_driver_errors_are_found_through_sqlalchemy_and_causes() -> None:
    assert driver_fault(pe.UndefinedTable()) == (ENV, "42P01", None)
    assert driver_fault(wrapped(pe.SerializationFailure())) == (TRANSIENT, "40001", None)
    assert driver_fault(psycopg.OperationalError("connection refused")) == (ENV, None, None)
    try:
        try:
            raise pe.ReadOnlySqlTransaction()
        except pe.Error as inner:
            raise RuntimeError("a handler wrapped it") from inner
    except RuntimeError as outer:
        assert driver_fault(outer) == (ENV, "25006", None)


def test_a_parameter_psycopg_refuses_client_side_is_the_messages_fault() -> None:
    # Before: ENVIRONMENT (no SQLSTATE), retried without bound.
    refused = psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
    assert driver_fault(refused) == (MSG, None, None)
    assert driver_fault(wrapped(refused)) == (MSG, None, None)


def test_what_is_not_a_driver_error_is_left_to_the_caller() -> None:
    assert driver_fault(ValueError("42P01")) is None
    assert driver_fault(KeyError("amount")) is None
    assert DatabaseError.translate(ValueError("x"), "handler") is None


def test_translated_errors_name_the_call_and_never_the_statement_parameters() -> None:
    error = StoreError.translate(wrapped(pe.InsufficientPrivilege("permission denied")), "claim")
    assert isinstance(error, StoreError) and isinstance(error, DatabaseError)
    assert error.fault is ENV and error.sqlstate == "42501"
    assert str(error).startswith("claim failed: InsufficientPrivilege (SQLSTATE 42501)")
    assert "p4ss" not in str(error) and "INSERT" not in str(error)
    assert "\n" not in str(error)


@pytest.mark.parametrize(
    ("exc", "fault"),
    [
        (kerr.MessageSizeTooLargeError(), MSG),
        (kerr.RecordTooLargeError(), MSG),
        (kerr.CorruptRecordException(), MSG),
        (kerr.TopicAuthorizationFailedError(), ENV),
        (kerr.UnknownTopicOrPartitionError(), ENV),
        (kerr.SaslAuthenticationFailed(), ENV),
        (kerr.KafkaConnectionError(), ENV),
        (ConnectionRefusedError(), ENV),
        (kerr.NotEnoughReplicasError(), TRANSIENT),
        (kerr.RequestTimedOutError(), TRANSIENT),
        (kerr.KafkaTimeoutError(), TRANSIENT),
        (RuntimeError("unknown"), TRANSIENT),
    ],
)
def test_kafka_table(exc: BaseException, fault: Fault) -> None:
    assert kafka_fault(exc) is fault
    translated = BrokerError.translate(exc, "send")
    assert translated.fault is fault and translated.kind == type(exc).__name__


def test_a_kafka_client_that_reached_no_broker_is_said_with_the_fix() -> None:
    from aiokafka.errors import KafkaConnectionError, UnknownTopicOrPartitionError

    from ledgerbox._core.errors import BrokerError

    bootstrap = KafkaConnectionError(
        "Unable to bootstrap from [('127.0.0.1', 1, <AddressFamily.AF_INET: 2>)]"
    )
    # aiokafka's text repeats its class name: said once.
    assert str(BrokerError.translate(bootstrap, "reading the lag")) == (
        "reading the lag failed: KafkaConnectionError: Unable to bootstrap from "
        "[('127.0.0.1', 1, <AddressFamily.AF_INET: 2>)]"
    )
    assert str(BrokerError.translate(bootstrap, "reading the lag", servers="k1:9092")) == (
        "reading the lag failed: Kafka is unreachable at k1:9092 (no bootstrap server "
        "answered): start it, or fix --kafka-bootstrap-servers / KAFKA_BOOTSTRAP_SERVERS"
    )
    refused = ConnectionRefusedError(111, "Connection refused")
    assert "Kafka is unreachable at k1:9092" in str(
        BrokerError.translate(refused, "reading", servers="k1:9092")
    )
    # A broker that answered with a refusal is not "unreachable".
    unknown = UnknownTopicOrPartitionError()
    assert "unreachable" not in str(BrokerError.translate(unknown, "reading", servers="k1:9092"))
