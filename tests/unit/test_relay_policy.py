"""Pure parts of the relay: fair share, lease book, error classes, on-dead rule, config."""

from __future__ import annotations

import pytest
from aiokafka import errors as kerr

import ledgerbox.relay.testing  # noqa: F401  (relay.testing below)
from ledgerbox import relay
from ledgerbox.outbox import ConfigurationError, LedgerboxError
from ledgerbox.relay import RelayConfig, RelayError, StoreError
from ledgerbox.relay._policy import (
    LEADER_SHARD,
    ErrorKind,
    LeaseBook,
    classify_publish_error,
    fair_share,
    held_after_reject,
)
from ledgerbox.relay._store import is_transient_sqlstate


def test_public_names_are_pinned() -> None:
    assert relay.__all__ == [
        "KafkaPublisher",
        "OutboundRecord",
        "Publisher",
        "Relay",
        "RelayConfig",
        "RelayError",
        "RelayTables",
        "StoreError",
    ]
    assert relay.testing.__all__ == ["InMemoryPublisher"]
    assert issubclass(RelayError, LedgerboxError)
    assert issubclass(StoreError, RelayError)
    assert RelayError.__module__ == "ledgerbox.relay"


@pytest.mark.parametrize(
    ("shards", "live", "share"),
    [(64, 1, 64), (64, 2, 32), (64, 3, 22), (64, 0, 64), (64, 100, 1), (1, 2, 1)],
)
def test_fair_share_is_ceil_of_shards_per_live_member(shards: int, live: int, share: int) -> None:
    assert fair_share(shards, live) == share


def test_fair_shares_of_all_members_cover_every_shard() -> None:
    for live in range(1, 70):
        assert fair_share(64, live) * live >= 64


def test_lease_book_deadline_is_send_time_plus_ttl_minus_margin() -> None:
    book = LeaseBook(ttl_s=5.0, margin_s=1.0)
    assert book.granted([(3, 7), (1, 2)], sent_at=100.0) == [1, 3]
    assert book.usable(103.9) == [1, 3]
    assert book.usable(104.0) == [], "past the local deadline nothing is published"
    assert book.fence(3) == 7


def test_lease_book_renewal_drops_lost_and_refenced_shards() -> None:
    book = LeaseBook(ttl_s=5.0, margin_s=1.0)
    book.granted([(0, 1), (1, 1), (2, 1)], sent_at=0.0)
    lost = book.renewed([(0, 1), (2, 9)], sent_at=10.0)
    assert lost == [1, 2], "missing shard and a changed fence are both lost"
    assert book.usable(13.0) == [0]
    assert book.usable(14.0) == []


def test_lease_book_leader_lease_is_not_a_data_shard() -> None:
    book = LeaseBook(ttl_s=5.0, margin_s=1.0)
    assert book.granted([(LEADER_SHARD, 4)], sent_at=0.0) == []
    assert book.is_leader(3.0)
    assert not book.is_leader(4.0)
    assert book.usable(1.0) == []
    assert book.data_shards() == []


def test_lease_book_plan_acquires_below_share_and_drains_above() -> None:
    book = LeaseBook(ttl_s=5.0, margin_s=1.0)
    assert book.plan(4) == (4, [])
    book.granted([(s, 1) for s in range(6)], sent_at=0.0)
    want, drain = book.plan(4)
    assert (want, drain) == (0, [4, 5])
    assert book.usable(1.0) == [0, 1, 2, 3], "draining shards are not claimed any more"
    assert book.draining() == [4, 5]
    assert book.plan(4) == (0, []), "already draining"
    book.drop([4, 5])
    assert book.data_shards() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "exc",
    [
        kerr.MessageSizeTooLargeError(),
        kerr.RecordTooLargeError(),
        kerr.InvalidTopicError(),
        kerr.TopicAuthorizationFailedError(),
        kerr.RecordListTooLargeError(),
    ],
)
def test_permanent_rejects(exc: BaseException) -> None:
    assert classify_publish_error(exc) is ErrorKind.PERMANENT


@pytest.mark.parametrize(
    "exc",
    [
        kerr.KafkaConnectionError(),
        kerr.RequestTimedOutError(),
        kerr.NotLeaderForPartitionError(),
        kerr.KafkaTimeoutError(),
        kerr.NotEnoughReplicasError(),
        kerr.UnknownTopicOrPartitionError(),
        RuntimeError("anything unknown"),
    ],
)
def test_everything_else_is_transient(exc: BaseException) -> None:
    assert classify_publish_error(exc) is ErrorKind.TRANSIENT


def test_on_dead_hold_keeps_later_events_of_the_key() -> None:
    assert held_after_reject("hold", "k1", {"k1"})
    assert not held_after_reject("hold", "k2", {"k1"})
    assert not held_after_reject("skip", "k1", {"k1"})


@pytest.mark.parametrize(
    ("sqlstate", "transient"),
    [
        (None, True),
        ("08006", True),
        ("57P01", True),
        ("40001", True),
        ("40P01", True),
        ("53300", True),
        ("42P01", False),
        ("42501", False),
        ("23505", False),
    ],
)
def test_sqlstate_classification(sqlstate: str | None, transient: bool) -> None:
    assert is_transient_sqlstate(sqlstate) is transient


def test_config_defaults_and_url_conversion() -> None:
    cfg = RelayConfig(
        database_url="postgresql+psycopg://u:p@h:5/db", kafka_bootstrap_servers="k:9092"
    )
    assert cfg.batch_size == 1000
    assert cfg.lanes == 8
    assert cfg.on_dead == "hold"
    assert cfg.compression == "lz4"
    assert cfg.retention_s == 7 * 86400
    assert cfg.libpq_url == "postgresql://u:p@h:5/db"
    assert cfg.member_id and cfg.member_id == cfg.member_id
    named = RelayConfig(
        database_url="postgresql://h/db", kafka_bootstrap_servers="k", relay_id="r1"
    )
    assert named.member_id == "r1"
    assert named.libpq_url == "postgresql://h/db"


@pytest.mark.parametrize(
    "bad",
    [
        {"batch_size": 0},
        {"poll_interval_s": 0},
        {"heartbeat_interval_s": 3.0},
        {"on_dead": "drop"},
        {"compression": "brotli"},
        {"outbox_table": "Outbox; DROP"},
        {"schema": "a-b"},
        {"shard_count": 0},
        {"lanes": 0},
        {"lanes": 65},
    ],
)
def test_config_rejects_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        RelayConfig(database_url="postgresql://h/db", kafka_bootstrap_servers="k", **bad)  # type: ignore[arg-type]


async def test_in_memory_publisher_injects_faults() -> None:
    from ledgerbox.relay import OutboundRecord, Publisher
    from ledgerbox.relay.testing import InMemoryPublisher

    pub = InMemoryPublisher()
    assert isinstance(pub, Publisher)
    rec = OutboundRecord(topic="t", key=b"k", value=b"{}", timestamp_ms=1, headers=[])
    pub.fail_next_sends(1, kerr.KafkaTimeoutError())
    (first, second) = await pub.send_many([rec, rec])
    with pytest.raises(kerr.KafkaTimeoutError):
        await first
    await second
    big = OutboundRecord(topic="t", key=b"big", value=b"{}", timestamp_ms=1, headers=[])
    pub.reject_on_send(lambda r: r.key == b"big", kerr.MessageSizeTooLargeError())
    assert isinstance(pub.precheck(big), kerr.MessageSizeTooLargeError)
    assert pub.precheck(rec) is None
    assert pub.records == [rec]


def test_kafka_publisher_precheck_refuses_records_above_max_request_size() -> None:
    from ledgerbox.relay import KafkaPublisher, OutboundRecord

    pub = KafkaPublisher("127.0.0.1:1")
    small = OutboundRecord(topic="t", key=b"k", value=b"{}", timestamp_ms=1, headers=[])
    huge = OutboundRecord(topic="t", key=b"k", value=b"x" * 1_100_000, timestamp_ms=1, headers=[])
    assert pub.precheck(small) is None
    assert isinstance(pub.precheck(huge), kerr.MessageSizeTooLargeError)


def test_lane_count_has_hysteresis_so_a_steady_load_does_not_flip_it() -> None:
    """Up when one lane's claim is full; down only after 2 s in which no lane claimed more
    than half a batch's share (a steady load between the two keeps its lane count)."""
    from ledgerbox.relay import Relay
    from ledgerbox.relay.testing import InMemoryPublisher

    now = [0.0]
    config = RelayConfig(
        database_url="postgresql://u@h/db", kafka_bootstrap_servers="k:9092", lanes=8
    )
    relay = Relay(config, publisher=InMemoryPublisher(), clock=lambda: now[0])
    relay._adapt_lanes(999)
    assert relay._wanted == 1, "a claim below a full batch keeps one lane"
    relay._adapt_lanes(1000)
    assert relay._wanted == 8, "a full claim brings every lane in"
    relay._active, relay._regroup = 8, type(relay._regroup)()  # the regroup happened
    for _ in range(50):  # 1,000/16 = 62.5: 63 rows per lane claim is still busy
        now[0] += 0.5
        relay._adapt_lanes(63)
    assert relay._wanted == 8 and not relay._regroup.is_set()
    for _ in range(4):
        now[0] += 0.5
        relay._adapt_lanes(62)
    assert not relay._regroup.is_set(), "not before 2 s"
    now[0] += 0.5
    relay._adapt_lanes(62)
    assert relay._regroup.is_set() and relay._wanted == 1
