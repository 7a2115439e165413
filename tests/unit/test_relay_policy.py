"""Pure parts of the relay: fair share, lease book, error classes, on-dead rule, config."""

from __future__ import annotations

import pytest
from aiokafka import errors as kerr

import ledgerbox.relay.testing  # noqa: F401  (relay.testing below)
from ledgerbox import ConfigurationError
from ledgerbox._core.faults import Fault
from ledgerbox.relay import PublishError, RelayConfig
from ledgerbox.relay._policy import (
    LEADER_SHARD,
    LeaseBook,
    fair_share,
    held_behind_dead_letter,
    not_sent,
    publish_fault,
)


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


def as_published(exc: BaseException) -> BaseException:
    """What the publisher seam hands the relay for a client error ``exc``."""
    return PublishError.translate(exc, "send")


@pytest.mark.parametrize(
    "exc",
    [
        kerr.MessageSizeTooLargeError(),
        kerr.RecordTooLargeError(),
        kerr.RecordListTooLargeError(),
        kerr.CorruptRecordException(),
    ],
)
def test_record_faults_dead_letter(exc: BaseException) -> None:
    assert publish_fault(as_published(exc)) is Fault.MESSAGE


@pytest.mark.parametrize(
    "exc",
    [
        kerr.TopicAuthorizationFailedError(),
        kerr.InvalidTopicError(),
        kerr.UnknownTopicOrPartitionError(),
        kerr.KafkaConnectionError(),
        kerr.SaslAuthenticationFailed(),
    ],
)
def test_environment_faults_never_dead_letter(exc: BaseException) -> None:
    assert publish_fault(as_published(exc)) is Fault.ENVIRONMENT


@pytest.mark.parametrize(
    "exc",
    [
        kerr.RequestTimedOutError(),
        kerr.NotLeaderForPartitionError(),
        kerr.KafkaTimeoutError(),
        kerr.NotEnoughReplicasError(),
        RuntimeError("anything unknown"),
    ],
)
def test_everything_else_is_transient(exc: BaseException) -> None:
    assert publish_fault(as_published(exc)) is Fault.TRANSIENT
    assert publish_fault(exc) is Fault.TRANSIENT, "an untranslated error is never the record's"


def test_on_dead_hold_keeps_later_events_of_the_key() -> None:
    assert held_behind_dead_letter("hold", "k1", {"k1"})
    assert not held_behind_dead_letter("hold", "k2", {"k1"})
    assert not held_behind_dead_letter("skip", "k1", {"k1"})


def test_config_defaults_and_url_conversion() -> None:
    cfg = RelayConfig(
        database_url="postgresql+psycopg://u:p@h:5/db", kafka_bootstrap_servers="k:9092"
    )
    assert cfg.batch_size == 1000
    assert cfg.lanes == 4
    assert cfg.on_dead_letter == "hold"
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
        {"on_dead_letter": "drop"},
        {"compression": "brotli"},
        {"outbox_table": "Outbox; DROP"},
        {"schema": "a-b"},
        {"shard_count": 0},
        {"lanes": 0},
        {"lanes": 65},
        {"request_timeout_ms": 2**31},  # Kafka carries it as an int32
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
    other = OutboundRecord(topic="t", key=b"other", value=b"{}", timestamp_ms=1, headers=[])
    pub.fail_next_sends(1, kerr.KafkaTimeoutError())
    (first, second, third) = await pub.send_many([rec, rec, other])
    with pytest.raises(PublishError) as failed:
        await first
    assert failed.value.kind == "KafkaTimeoutError" and failed.value.fault is Fault.TRANSIENT
    with pytest.raises(PublishError) as held_back:
        await second  # behind a failed record of its key (partition): never sent
    assert not_sent(held_back.value) and not not_sent(failed.value)
    await third  # another key goes on
    (again,) = await pub.send_many([rec])
    await again
    big = OutboundRecord(topic="t", key=b"big", value=b"{}", timestamp_ms=1, headers=[])
    pub.reject_on_send(lambda r: r.key == b"big", kerr.MessageSizeTooLargeError())
    refused = pub.precheck(big)
    assert refused is not None and refused.fault is Fault.MESSAGE
    assert pub.precheck(rec) is None
    assert pub.records == [other, rec]


def test_kafka_publisher_precheck_refuses_records_above_max_request_size() -> None:
    from ledgerbox.relay import KafkaPublisher, OutboundRecord

    pub = KafkaPublisher("127.0.0.1:1")
    small = OutboundRecord(topic="t", key=b"k", value=b"{}", timestamp_ms=1, headers=[])
    huge = OutboundRecord(topic="t", key=b"k", value=b"x" * 1_100_000, timestamp_ms=1, headers=[])
    assert pub.precheck(small) is None
    refused = pub.precheck(huge)
    assert refused is not None and refused.fault is Fault.MESSAGE
