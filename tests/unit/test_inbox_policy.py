"""Pure inbox policy: retry classification, retry bounds, inbox state transitions, config."""

from __future__ import annotations

import itertools
import warnings

import psycopg
import psycopg.errors as pe
import pytest
import sqlalchemy.exc as sa_exc

from ledgerbox import DatabaseError, LedgerboxError, inbox
from ledgerbox._core.faults import Fault
from ledgerbox.inbox import (
    ConsumerConfig,
    FencedWriteError,
    InboxError,
    InboxStatus,
    LockBusyError,
    VersionConflictError,
)
from ledgerbox.inbox._config import RetentionWarning
from ledgerbox.inbox._deadletter import dead_letter_headers
from ledgerbox.inbox._policy import check_transition, classify, should_retry
from ledgerbox.inbox._tx import translate_errors
from ledgerbox.outbox import EnvelopeParseError


class _Diag:
    def __init__(self, constraint_name: str | None) -> None:
        self.constraint_name = constraint_name


class FakeUniqueViolation(pe.UniqueViolation):
    """A psycopg unique violation naming ``constraint`` (a real one gets it from the server)."""

    def __init__(self, constraint: str | None) -> None:
        super().__init__("duplicate key value violates unique constraint (text never read)")
        self._fake_diag = _Diag(constraint)

    @property
    def diag(self) -> _Diag:  # type: ignore[override]
        return self._fake_diag


def wrapped(orig: Exception) -> BaseException:
    return sa_exc.DBAPIError.instance("INSERT ...", {}, orig, psycopg.Error)


def test_error_tree_has_the_ledgerbox_root() -> None:
    assert issubclass(InboxError, LedgerboxError)
    for cls in (VersionConflictError, FencedWriteError, LockBusyError, inbox.RedisUnavailableError):
        assert issubclass(cls, InboxError)
    assert VersionConflictError.__module__ == "ledgerbox.inbox"


def seam(exc: BaseException) -> BaseException:
    """What the inbox's database seam (``translate_errors``) raises for ``exc``."""
    try:
        with translate_errors("test"):
            raise exc
    except BaseException as raised:
        return raised
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (pe.SerializationFailure(), Fault.TRANSIENT),
        (pe.DeadlockDetected(), Fault.TRANSIENT),
        (wrapped(pe.SerializationFailure()), Fault.TRANSIENT),
        (VersionConflictError("t", {"id": 1}, 3), Fault.TRANSIENT),
        (FencedWriteError("t", {"id": 1}, 7), Fault.TRANSIENT),
        (LockBusyError("busy"), Fault.TRANSIENT),
        (TimeoutError(), Fault.TRANSIENT),
        (pe.LockNotAvailable(), Fault.ENVIRONMENT),
        (pe.QueryCanceled(), Fault.ENVIRONMENT),
        (pe.AdminShutdown(), Fault.ENVIRONMENT),
        (pe.TooManyConnections(), Fault.ENVIRONMENT),
        (pe.DiskFull(), Fault.ENVIRONMENT),
        (pe.ConnectionFailure(), Fault.ENVIRONMENT),
        (pe.UndefinedTable(), Fault.ENVIRONMENT),
        (pe.UndefinedColumn(), Fault.ENVIRONMENT),
        (pe.InsufficientPrivilege(), Fault.ENVIRONMENT),
        (pe.ReadOnlySqlTransaction(), Fault.ENVIRONMENT),
        (psycopg.OperationalError("connection refused"), Fault.ENVIRONMENT),
        (wrapped(psycopg.OperationalError("server closed the connection")), Fault.ENVIRONMENT),
        (ConnectionRefusedError(), Fault.ENVIRONMENT),
        (FakeUniqueViolation("inbox_pkey"), Fault.DUPLICATE),
        (wrapped(FakeUniqueViolation("inbox_pkey")), Fault.DUPLICATE),
        (FakeUniqueViolation("payments_order_id_key"), Fault.MESSAGE),
        (FakeUniqueViolation(None), Fault.MESSAGE),
        (pe.NotNullViolation(), Fault.MESSAGE),
        (pe.InvalidTextRepresentation(), Fault.MESSAGE),
        (EnvelopeParseError("bad"), Fault.MESSAGE),
        (ValueError("bug"), Fault.MESSAGE),
        (KeyError("amount"), Fault.MESSAGE),
    ],
)
def test_classify(exc: BaseException, expected: Fault) -> None:
    assert classify(seam(exc), inbox_constraint="inbox_pkey") is expected


def test_the_seam_translates_driver_errors_and_passes_the_rest() -> None:
    translated = seam(wrapped(pe.UndefinedTable()))
    assert isinstance(translated, DatabaseError)
    assert translated.sqlstate == "42P01"
    assert isinstance(translated.__cause__, sa_exc.DBAPIError)
    plain = ValueError("bug")
    assert seam(plain) is plain


def test_classify_follows_the_cause_chain() -> None:
    try:
        try:
            raise pe.DeadlockDetected()
        except pe.DeadlockDetected as inner:
            raise RuntimeError("handler wrapped it") from inner
    except RuntimeError as outer:
        assert classify(seam(outer)) is Fault.TRANSIENT


def test_classify_never_reads_messages() -> None:
    assert classify(ValueError("deadlock detected; serialization failure; 40001")) is (
        Fault.MESSAGE
    )


def test_should_retry_is_bounded_for_transient_and_unbounded_for_the_environment() -> None:
    assert [should_retry(Fault.TRANSIENT, n, 3) for n in (1, 2, 3, 4)] == [
        True,
        True,
        False,
        False,
    ]
    assert should_retry(Fault.ENVIRONMENT, 10_000, 3)
    assert not should_retry(Fault.MESSAGE, 1, 5)
    assert not should_retry(Fault.DUPLICATE, 1, 5)


def test_inbox_state_transitions() -> None:
    allowed = {
        (a, b)
        for a, b in itertools.product([None, *InboxStatus], InboxStatus)
        if check_transition(a, b)
    }
    assert allowed == {
        (None, InboxStatus.DONE),
        (None, InboxStatus.DEAD_LETTERED),
        (InboxStatus.DEAD_LETTERED, InboxStatus.DONE),
        (InboxStatus.DEAD_LETTERED, InboxStatus.DEAD_LETTERED),
    }  # DONE is final


def test_store_sql_encodes_the_same_transitions() -> None:
    from ledgerbox.inbox._store import CLAIM, CLAIM_MANY, FAIL

    # The SQL embeds the status numbers: a claim takes over only a FAILED row, a failure
    # never overwrites a DONE one.
    assert (int(InboxStatus.DONE), int(InboxStatus.DEAD_LETTERED)) == (1, 2)
    for claim in (CLAIM, CLAIM_MANY):
        assert "WHERE t.status = 2" in claim
        assert "status = 1," in claim
    assert "WHERE t.status <> 1" in FAIL
    assert check_transition(InboxStatus.DEAD_LETTERED, InboxStatus.DONE)
    assert not check_transition(InboxStatus.DONE, InboxStatus.DONE)
    assert not check_transition(InboxStatus.DONE, InboxStatus.DEAD_LETTERED)


def test_config_defaults_and_validation() -> None:
    config = ConsumerConfig(
        group_id="g",
        topics=["a"],
        database_url="postgresql+psycopg://x/y",
        kafka_bootstrap_servers="k:9092",
    )
    assert config.dead_letter_topic_for("a") == "a.dlq"
    assert config.retention_s == 7 * 24 * 3600 and config.max_attempts == 5
    assert config.effective_lock_wait_ms == config.lock_ttl_ms
    with pytest.raises(inbox.InboxError.__mro__[1]):  # outbox.LedgerboxError
        ConsumerConfig(
            group_id="g",
            topics=["a"],
            database_url="x",
            kafka_bootstrap_servers="k",
            inbox_table="Bad Name",
        )
    for bad in (
        {"max_attempts": 0},
        {"lock_ttl_ms": 0},
        {"topics": "a"},
        {"lock_aggregates": True},
    ):
        with pytest.raises(ValueError):
            ConsumerConfig(
                **{
                    "group_id": "g",
                    "topics": ["a"],
                    "database_url": "x",
                    "kafka_bootstrap_servers": "k",
                    **bad,
                }  # type: ignore[arg-type]
            )


def test_retention_shorter_than_redelivery_horizon_warns() -> None:
    with pytest.warns(RetentionWarning):
        ConsumerConfig(
            group_id="g",
            topics=["a"],
            database_url="x",
            kafka_bootstrap_servers="k",
            retention_s=3600,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ConsumerConfig(
            group_id="g",
            topics=["a"],
            database_url="x",
            kafka_bootstrap_servers="k",
            retention_s=3600,
            offset_retention_s=1800,
        )


def test_dead_letter_headers_keep_the_original_and_add_the_reason() -> None:
    original = [("ce_id", b"1"), ("trace", b"\xff"), ("ledgerbox_attempts", b"9")]
    headers = dead_letter_headers(
        original,
        error=EnvelopeParseError("value is not JSON"),
        attempts=2,
        topic="t",
        partition=3,
        offset=41,
    )
    assert headers[:2] == original[:2]
    assert dict(headers) == {
        "ce_id": b"1",
        "trace": b"\xff",
        "ledgerbox_error_type": b"ledgerbox.outbox.EnvelopeParseError",
        "ledgerbox_error_message": b"value is not JSON",
        "ledgerbox_attempts": b"2",
        "ledgerbox_source_topic": b"t",
        "ledgerbox_source_partition": b"3",
        "ledgerbox_source_offset": b"41",
    }
    long = dead_letter_headers(
        [], error=ValueError("x" * 10_000), attempts=1, topic="t", partition=0, offset=0
    )
    assert len(dict(long)["ledgerbox_error_message"]) == 4096
