"""Pure inbox policy: retry classification, retry bounds, inbox state transitions, config."""

from __future__ import annotations

import itertools

import psycopg
import psycopg.errors as pe
import pytest
import sqlalchemy.exc as sa_exc

from ledgerbox import ConfigurationError, DatabaseError, LedgerboxError, inbox
from ledgerbox._core.faults import Fault
from ledgerbox.inbox import (
    ConsumerConfig,
    FencedWriteError,
    InboxError,
    InboxStatus,
    LockBusyError,
    VersionConflictError,
)
from ledgerbox.inbox._deadletter import dead_letter_headers, replay_target
from ledgerbox.inbox._policy import (
    Outcome,
    check_transition,
    classify,
    delivery_outcome,
    should_retry,
)
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
        # An exception nobody declared: retried up to max_attempts, then dead-lettered.
        (ValueError("bug"), Fault.TRANSIENT),
        (KeyError("amount"), Fault.TRANSIENT),
        (RuntimeError("gateway said no"), Fault.TRANSIENT),
    ],
)
def test_classify(exc: BaseException, expected: Fault) -> None:
    assert classify(seam(exc), inbox_constraint="inbox_pkey") is expected


class PaymentDeclined(Exception):
    """A business refusal the user declares permanent."""


class CardExpired(PaymentDeclined):
    """A more specific refusal the user declares retryable (the card is renewed)."""


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (PaymentDeclined(), Fault.MESSAGE),  # declared permanent: one attempt
        (CardExpired(), Fault.TRANSIENT),  # the most specific declared class wins
        (pe.ForeignKeyViolation(), Fault.TRANSIENT),  # retry_on turns a data error retryable
        (wrapped(pe.ForeignKeyViolation()), Fault.TRANSIENT),  # found through the seam's cause
        (pe.NotNullViolation(), Fault.MESSAGE),  # a data error not declared stays MESSAGE
        (RuntimeError("undeclared"), Fault.MESSAGE),  # Exception is declared permanent here
        # Nothing the user declares turns the environment's fault or a serialization failure
        # into the event's, even a declaration as broad as Exception.
        (pe.UndefinedTable(), Fault.ENVIRONMENT),
        (pe.InsufficientPrivilege(), Fault.ENVIRONMENT),
        (pe.ReadOnlySqlTransaction(), Fault.ENVIRONMENT),
        (ConnectionRefusedError(), Fault.ENVIRONMENT),
        (pe.SerializationFailure(), Fault.TRANSIENT),
        (VersionConflictError("t", {"id": 1}, 3), Fault.TRANSIENT),
        (FakeUniqueViolation("inbox_pkey"), Fault.DUPLICATE),
        (EnvelopeParseError("bad"), Fault.MESSAGE),
    ],
)
def test_failsafe_04_declared_exception_types_decide_within_the_rule(
    exc: BaseException, expected: Fault
) -> None:
    assert (
        classify(
            seam(exc),
            inbox_constraint="inbox_pkey",
            retry_on=(CardExpired, pe.ForeignKeyViolation),
            dead_letter_on=(PaymentDeclined, Exception),
        )
        is expected
    )


def test_failsafe_04_an_undeclared_handler_exception_is_retried_then_dead_lettered() -> None:
    # Before: RuntimeError was MESSAGE, dead-lettered after ONE attempt.
    kind = classify(RuntimeError("boom"))
    assert kind is Fault.TRANSIENT
    assert [should_retry(kind, n, 3) for n in (1, 2, 3)] == [True, True, False]


def test_failsafe_04_config_takes_declared_types_and_refuses_overlaps() -> None:
    base = {
        "group_id": "g",
        "topics": ["a"],
        "database_url": "postgresql+psycopg://x/y",
        "kafka_bootstrap_servers": "k",
    }
    config = ConsumerConfig(
        **base,  # type: ignore[arg-type]
        retry_on=[CardExpired],
        dead_letter_on=PaymentDeclined,  # type: ignore[arg-type]
    )
    assert config.retry_on == (CardExpired,) and config.dead_letter_on == (PaymentDeclined,)
    with pytest.raises(ConfigurationError, match="both"):
        ConsumerConfig(**base, retry_on=[KeyError], dead_letter_on=[KeyError])  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="exception types"):
        ConsumerConfig(**base, retry_on=["KeyError"])  # type: ignore[arg-type,list-item]


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
    text = "deadlock detected; serialization failure; 40001; connection refused"
    assert classify(ValueError(text), dead_letter_on=(ValueError,)) is Fault.MESSAGE
    assert classify(seam(pe.NotNullViolation(text))) is Fault.MESSAGE


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


def test_failsafe_10_inbox_state_transitions() -> None:
    allowed = {
        (a, b)
        for a, b in itertools.product([None, *InboxStatus], InboxStatus)
        if check_transition(a, b)
    }
    assert allowed == {
        (None, InboxStatus.DONE),
        (None, InboxStatus.DEAD_LETTERED),
        # Only the operator's replay request reopens a dead-lettered event ...
        (InboxStatus.DEAD_LETTERED, InboxStatus.REPLAY_REQUESTED),
        # ... and the next delivery takes it over: applied, or dead-lettered again.
        (InboxStatus.REPLAY_REQUESTED, InboxStatus.DONE),
        (InboxStatus.REPLAY_REQUESTED, InboxStatus.DEAD_LETTERED),
    }  # DONE is final; DEAD_LETTERED is final for redeliveries and copies (C17)


def test_failsafe_10_a_delivery_of_a_final_row_never_runs_the_handler() -> None:
    assert delivery_outcome(None) is Outcome.APPLIED
    assert delivery_outcome(InboxStatus.DONE) is Outcome.DUPLICATE
    assert delivery_outcome(InboxStatus.DEAD_LETTERED) is Outcome.ALREADY_DEAD_LETTERED


def test_failsafe_10_store_sql_encodes_the_same_transitions() -> None:
    from ledgerbox.inbox._store import CLAIM, CLAIM_MANY, FAIL, REQUEST_REPLAY

    # The SQL embeds the status numbers: a claim takes over only a REPLAY_REQUESTED row, a
    # failure overwrites only a REPLAY_REQUESTED row, a replay request moves only a
    # DEAD_LETTERED one.
    assert [int(s) for s in InboxStatus] == [1, 2, 3]
    for claim in (CLAIM, CLAIM_MANY):
        assert "WHERE t.status = 3" in claim
        assert "status = 1," in claim
    assert "WHERE t.status = 3" in FAIL and "status, attempts" in FAIL
    assert "SET status = 3" in REQUEST_REPLAY and "AND status = 2" in REQUEST_REPLAY
    assert check_transition(InboxStatus.REPLAY_REQUESTED, InboxStatus.DONE)
    assert check_transition(InboxStatus.REPLAY_REQUESTED, InboxStatus.DEAD_LETTERED)
    assert check_transition(InboxStatus.DEAD_LETTERED, InboxStatus.REPLAY_REQUESTED)
    assert not check_transition(InboxStatus.DEAD_LETTERED, InboxStatus.DONE)
    assert not check_transition(InboxStatus.DEAD_LETTERED, InboxStatus.DEAD_LETTERED)
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
    assert config.batch_max_records == 100 and config.batch_across_partitions is True
    with pytest.raises(inbox.InboxError.__mro__[1]):  # outbox.LedgerboxError
        ConsumerConfig(
            group_id="g",
            topics=["a"],
            database_url="postgresql+psycopg://x/y",
            kafka_bootstrap_servers="k",
            inbox_table="Bad Name",
        )
    for bad in (
        {"max_attempts": 0},
        {"lock_ttl_ms": 0},
        {"topics": "a"},
        {"lock_aggregates": True},
        {"batch_across_partitions": "no"},
    ):
        with pytest.raises(ValueError):
            ConsumerConfig(
                **{
                    "group_id": "g",
                    "topics": ["a"],
                    "database_url": "postgresql+psycopg://x/y",
                    "kafka_bootstrap_servers": "k",
                    **bad,
                }  # type: ignore[arg-type]
            )


def test_failsafe_09_retention_shorter_than_redelivery_horizon_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="offset_retention_s"):
        ConsumerConfig(
            group_id="g",
            topics=["a"],
            database_url="postgresql+psycopg://x/y",
            kafka_bootstrap_servers="k",
            retention_s=3600,
        )
    config = ConsumerConfig(
        group_id="g",
        topics=["a"],
        database_url="postgresql+psycopg://x/y",
        kafka_bootstrap_servers="k",
        retention_s=3600,
        offset_retention_s=1800,
    )
    assert config.retention_s == 3600
    with pytest.raises(ConfigurationError):
        ConsumerConfig(
            group_id="g",
            topics=["a"],
            database_url="postgresql+psycopg://x/y",
            kafka_bootstrap_servers="k",
            offset_retention_s=0,
        )


def test_failsafe_05_on_unhandled_is_validated() -> None:
    base = {
        "group_id": "g",
        "topics": ["a"],
        "database_url": "postgresql+psycopg://x/y",
        "kafka_bootstrap_servers": "k",
    }
    assert ConsumerConfig(**base).on_unhandled == "ignore"  # type: ignore[arg-type]
    for mode in ("ignore", "dead_letter", "fail"):
        assert ConsumerConfig(**base, on_unhandled=mode).on_unhandled == mode  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="on_unhandled"):
        ConsumerConfig(**base, on_unhandled="drop")  # type: ignore[arg-type]


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


def test_dead_letter_headers_name_the_group_and_drop_an_earlier_replays_target() -> None:
    # A replayed record (target group g1, replay id 7) dead-lettered again by g1: one group
    # header, the new one; the replay headers do not survive into the new dead letter.
    replayed = [
        ("ce_id", b"1"),
        ("ledgerbox_consumer_group", b"g1"),
        ("ledgerbox_replay_group", b"g1"),
        ("ledgerbox_replay_id", b"7"),
    ]
    headers = dead_letter_headers(
        replayed, error=ValueError("no"), attempts=1, topic="t", partition=0, offset=5, group="g1"
    )
    names = [name for name, _ in headers]
    assert names.count("ledgerbox_consumer_group") == 1
    assert dict(headers)["ledgerbox_consumer_group"] == b"g1"
    assert "ledgerbox_replay_group" not in names and "ledgerbox_replay_id" not in names
    assert replay_target(replayed) == "g1"
    assert replay_target([("ce_id", b"1")]) is None and replay_target(None) is None


def test_schema_revision_is_the_head_of_the_migrations() -> None:
    # The consumer's startup check compares the version table with SCHEMA_REVISION.
    from alembic.script import ScriptDirectory

    from ledgerbox import migrations
    from ledgerbox._core.names import SCHEMA_REVISION, SCHEMA_VERSION_TABLE

    script = ScriptDirectory.from_config(migrations.alembic_config("postgresql://u@h/d"))
    assert script.get_heads() == [SCHEMA_REVISION]
    assert migrations.VERSION_TABLE == SCHEMA_VERSION_TABLE


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"topics": ["bad topic"]}, "'bad topic' is not a legal Kafka topic name"),
        ({"topics": ["a", ""]}, "'' is not a legal Kafka topic name"),
        ({"dead_letter_topic": "dlq/x"}, "'dlq/x' is not a legal Kafka topic name"),
        ({"topics": [], "assignment": [("a b", 0)]}, "'a b' is not a legal Kafka topic name"),
        ({"topics": ["a" * 248]}, "leaves no room for its dead-letter topic"),
        ({"max_attempts": 2.5}, "max_attempts must be a whole number, got 2.5"),
        ({"max_attempts": True}, "max_attempts must be a whole number, got True"),
        ({"max_attempts": "3"}, "max_attempts must be a whole number, got '3'"),
        ({"batch_max_records": 10.0}, "batch_max_records must be a whole number"),
        ({"in_progress_ttl_ms": "5"}, "in_progress_ttl_ms must be a whole number"),
    ],
)
def test_topic_names_and_whole_numbers_are_checked_when_the_config_is_built(
    bad: dict[str, object], named: str
) -> None:
    """A newcomer's review: an illegal topic name was accepted (``consumer check`` said ok,
    ``run`` blamed Kafka: "Kafka is unreachable ... UnknownTopicOrPartitionError"), 2.5 and
    True passed as max_attempts, "3" raised a bare TypeError. Now each is a one-line
    ConfigurationError naming the setting."""
    with pytest.raises(ConfigurationError) as raised:
        ConsumerConfig(
            **{
                "group_id": "g",
                "topics": ["a"],
                "database_url": "postgresql+psycopg://x/y",
                "kafka_bootstrap_servers": "k",
                **bad,
            }  # type: ignore[arg-type]
        )
    assert named in str(raised.value) and "\n" not in str(raised.value)
