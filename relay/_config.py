"""Validated configuration of one relay process."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Literal

from ledgerbox._core.database_url import check_database_url, libpq_url
from ledgerbox._core.durations import check_duration
from ledgerbox._core.errors import ConfigurationError
from ledgerbox._core.identifiers import (
    named,
    outbox_notify_channel,
    outbox_table_name,
    sql_identifier,
)
from ledgerbox._core.kafka import KafkaSettings, resolve_kafka
from ledgerbox._core.names import DEFAULT_MAX_RECORD_BYTES, DEFAULT_SHARD_COUNT

__all__ = ["STOP_TIMEOUT_S", "Compression", "OnDeadLetter", "RelayConfig"]

#: Default of ``RelayConfig.stop_timeout_s``, in seconds: the longest a stop waits for Kafka.
#: With the defaults a relay stopped during a Kafka outage exits in about this long (the
#: database steps after it take well under a second), far inside Kubernetes' default
#: 30 s grace period (before: over 90 s, the confirmations' 65 s bound then a 35 s flush).
STOP_TIMEOUT_S = 8.0

Compression = Literal["lz4", "zstd", "gzip", "snappy", "none"]
OnDeadLetter = Literal["hold", "skip"]

#: Largest ``request_timeout_ms``: Kafka's requests carry their timeout as an int32.
INT32_MAX = 2**31 - 1

_COMPRESSIONS = ("lz4", "zstd", "gzip", "snappy", "none")
_ON_DEAD_LETTER = ("hold", "skip")


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """Configuration of a :class:`relay.Relay`; validated when built.

    Parameters
    ----------
    database_url : str
        SQLAlchemy form (``postgresql+psycopg://...``) or plain libpq form (``postgresql://``).
        TLS settings go in its query and reach libpq as they are (``?sslmode=verify-full&
        sslrootcert=/etc/ssl/db-ca.pem``; docs/security.md). Its password is never logged.
    kafka_bootstrap_servers : str
        ``host:port[,host:port]`` (9092 when a port is left out; a malformed address is
        refused). Alone it means PLAINTEXT; ``kafka`` adds TLS and a login.
    kafka : KafkaSettings | None
        Where Kafka is and how to log in (TLS, SASL; docs/security.md); ``None``:
        ``kafka_bootstrap_servers`` in PLAINTEXT. Give one of the two (both only if their
        servers agree). The command line sets it with the ``--kafka-*`` flags.
    outbox_table : str
        The outbox table (default ``outbox``); a SQL identifier.
    schema : str | None
        Schema of the outbox table (``None``: the search path); a SQL identifier.
    batch_size : int
        Most events claimed, published and marked per batch (default 1000).
    lanes : int
        Most concurrent claim -> publish -> mark pipelines inside this relay (default 4,
        1..64). One runs while the relay keeps up; all of them while there is a backlog. The
        running lanes split the owned shards by ``shard % n``: a shard belongs to exactly one
        lane, so rows of one key are still handed to the producer in id order by one pipeline
        (G3). Each running lane holds two database connections (claim, mark); a lane's
        connections are closed when the relay goes back to one lane.
    poll_interval_s : float
        Polling fallback when no NOTIFY arrives, in seconds (default 1.0, at least 0.01).
    lease_ttl_s : float
        Lifetime of a shard lease without renewal, in seconds (default 5.0).
    heartbeat_interval_s : float
        Pause between heartbeats (member row + lease renewal), in seconds (default 1.0);
        must be below ``lease_ttl_s / 2``.
    compression : {"lz4", "zstd", "gzip", "snappy", "none"}
        Kafka record batch compression (lz4/zstd/snappy need ``cramjam``, a dependency).
    on_dead_letter : {"hold", "skip"}
        What happens to later events of a partition key after one of its events was
        dead-lettered: ``"hold"`` (default) keeps them pending until an operator replays or discards
        the dead one (per-key order, G3); ``"skip"`` publishes them.
    retention_s : float
        Age (by ``created_at``) past which the leader deletes a published row, in seconds
        (default 7 days).
    relay_id : str | None
        Name of this relay in the lease tables; ``None``: ``host-pid-random``.
    shard_count : int
        Number of shards; must equal the writers' ``OutboxTable.shard_count`` (default 64).
    claim_linger_ms : int
        Most a claim waits for more events to gather, in milliseconds (default 20, 0..50):
        in a stream of events a lane claims at most once per linger instead of once per
        NOTIFY, the linger growing with the lane's event rate up to this bound (reached at
        1,000 events/s; at 100 events/s it is a tenth); no wait when the previous claim
        started longer ago (a lone event goes out at once) or came back full
        (docs/relay.md, "Wake-up and pacing").
    linger_ms : int
        Producer linger, in milliseconds (default 0). The relay hands the producer complete
        record batches (one per partition per claimed batch), so waiting for more records
        only adds latency: measured commit -> broker append p50 41 ms with 5 ms vs 17 ms with
        0 (bench/e2e_latency.py, 1,000 events/s). While a request is in flight further
        batches queue and go out together anyway.
    producer_batch_bytes : int
        Producer ``max_batch_size`` per partition, in bytes (default 256 KiB).
    max_request_bytes : int
        Largest Kafka record the relay sends (the producer's ``max_request_size``), in bytes
        (default 1 MiB, aiokafka's and the brokers' default). A larger record is
        dead-lettered. To publish larger events raise it together with the topics'
        ``max.message.bytes`` and the writers' ``OutboxWriter(max_record_bytes=...)``
        (docs/outbox.md, "Size limits").
    request_timeout_ms : int
        Producer request timeout, in milliseconds: a send not confirmed by then failed
        (default 30,000).
    cleanup_interval_s : float
        Pause between two cleanups of published rows by the leader, in seconds (default 60).
    cleanup_batch_size : int
        Rows per cleanup ``DELETE`` (default 1000, 1..100000).
    cleanup_pause_s : float
        Pause between two cleanup ``DELETE`` statements, in seconds (default 0.05).
    backoff_max_s : float
        Ceiling of the retry backoff, in seconds (default 10).
    stop_timeout_s : float
        Most a stop (SIGTERM, :meth:`Relay.stop`) waits for Kafka, in seconds (default
        :data:`STOP_TIMEOUT_S`, 8): for the delivery confirmations of the batches in flight
        and for the producer's flush. What Kafka has not confirmed by then is not persisted
        and is sent again after the restart (duplicates with the same event id, never a
        loss). With Kafka up a stop finishes long before (docs/relay.md, "Failures").

    Raises
    ------
    ledgerbox.ConfigurationError
        If a value is out of range (every duration: a finite number of seconds, at most
        10 years: :func:`ledgerbox._core.durations.check_duration`) or a name is not a SQL
        identifier; its ``setting`` names the field. A ``database_url`` that can never
        connect (not PostgreSQL, libpq cannot parse it, a port outside 1..65535) is refused
        here, not retried; a database server that is down is waited for
        (:mod:`ledgerbox._core.database_url`).
    """

    # repr=False: a config in a log line or a traceback must not show the URL's password.
    database_url: str = field(repr=False)
    kafka_bootstrap_servers: str = ""
    kafka: KafkaSettings | None = field(default=None, metadata={"setting": False})
    outbox_table: str = "outbox"
    schema: str | None = None
    batch_size: int = 1000
    lanes: int = 4
    poll_interval_s: float = 1.0
    lease_ttl_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    compression: Compression = "lz4"
    on_dead_letter: OnDeadLetter = "hold"
    retention_s: float = 7 * 86400.0
    relay_id: str | None = None
    shard_count: int = DEFAULT_SHARD_COUNT
    claim_linger_ms: int = 20
    linger_ms: int = 0
    producer_batch_bytes: int = 262_144
    max_request_bytes: int = DEFAULT_MAX_RECORD_BYTES
    request_timeout_ms: int = 30_000
    cleanup_interval_s: float = 60.0
    cleanup_batch_size: int = 1000
    cleanup_pause_s: float = 0.05
    backoff_max_s: float = 10.0
    stop_timeout_s: float = STOP_TIMEOUT_S
    _resolved_id: str = field(init=False, repr=False, compare=False, default="")
    _kafka: KafkaSettings | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        _check(bool(self.database_url), "database_url", "must not be empty")
        check_database_url(self.database_url)  # one that can never connect: not waited for
        object.__setattr__(self, "_kafka", resolve_kafka(self.kafka, self.kafka_bootstrap_servers))
        named(outbox_table_name, self.outbox_table, "outbox table name", "outbox_table")
        if self.schema is not None:
            named(sql_identifier, self.schema, "schema", "schema")
        # The pair's NOTIFY channel (the relay LISTENs on it): else 'relay down: run ledgerbox
        # migrate', and migrate refused the pair.
        named(
            lambda table, _: outbox_notify_channel(table, self.schema),
            self.outbox_table,
            "outbox table name",
            "outbox_table",
        )
        _check(1 <= self.batch_size <= 100_000, "batch_size", "must be in 1..100000")
        _check(1 <= self.lanes <= 64, "lanes", "must be in 1..64")
        # Every duration: finite, in its range (inf/nan parse as floats: a relay that never
        # polls, never renews; a huge one overflows datetime and PostgreSQL intervals).
        check_duration(self.poll_interval_s, "poll_interval_s", low_open=True)
        # Below 10 ms an idle relay busy-polls (1e-9 s: half a core, a newcomer's review);
        # NOTIFY wakes it at once anyway.
        _check(self.poll_interval_s >= 0.01, "poll_interval_s", "must be >= 0.01 (10 ms)")
        check_duration(self.lease_ttl_s, "lease_ttl_s", low_open=True)
        check_duration(
            self.heartbeat_interval_s,
            "heartbeat_interval_s",
            low_open=True,
            high=self.lease_ttl_s / 2,
        )
        _check(self.compression in _COMPRESSIONS, "compression", f"must be one of {_COMPRESSIONS}")
        _check(self.on_dead_letter in _ON_DEAD_LETTER, "on_dead_letter", "must be 'hold' or 'skip'")
        check_duration(self.retention_s, "retention_s")
        _check(1 <= self.shard_count <= 32767, "shard_count", "must be in 1..32767")
        _check(0 <= self.claim_linger_ms <= 50, "claim_linger_ms", "must be in 0..50")
        _check(0 <= self.linger_ms <= 10_000, "linger_ms", "must be in 0..10000")
        _check(self.producer_batch_bytes >= 1024, "producer_batch_bytes", "must be >= 1024")
        _check(
            1024 <= self.max_request_bytes <= INT32_MAX,
            "max_request_bytes",
            f"must be in 1024..{INT32_MAX}",
        )
        _check(
            1000 <= self.request_timeout_ms <= INT32_MAX,  # Kafka's int32 milliseconds
            "request_timeout_ms",
            f"must be in 1000..{INT32_MAX}",
        )
        check_duration(self.cleanup_interval_s, "cleanup_interval_s", low_open=True)
        _check(1 <= self.cleanup_batch_size <= 100_000, "cleanup_batch_size", "must be 1..100000")
        check_duration(self.cleanup_pause_s, "cleanup_pause_s")
        check_duration(self.backoff_max_s, "backoff_max_s", low=0.1)
        check_duration(self.stop_timeout_s, "stop_timeout_s", low_open=True, high=600.0)
        if self.relay_id is not None:
            _check(0 < len(self.relay_id) <= 200, "relay_id", "must have 1..200 characters")
        resolved = self.relay_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        object.__setattr__(self, "_resolved_id", resolved)

    @property
    def member_id(self) -> str:
        """``relay_id``, or the generated ``host-pid-random`` name when it was ``None``."""
        return self._resolved_id

    @property
    def kafka_settings(self) -> KafkaSettings:
        """The Kafka settings every client of the relay uses: ``kafka``, or PLAINTEXT to
        ``kafka_bootstrap_servers``."""
        assert self._kafka is not None
        return self._kafka

    @property
    def database_label(self) -> str:
        """``host:port/database`` of ``database_url``, for logs (never the user or password)."""
        rest = self.database_url.partition("://")[2]
        host_and_db = rest.rpartition("@")[2]
        return host_and_db.split("?", 1)[0] or "(default)"

    @property
    def libpq_url(self) -> str:
        """``database_url`` without SQLAlchemy's ``+driver`` suffix, for psycopg."""
        return libpq_url(self.database_url)


def _check(ok: bool, setting: str, rule: str) -> None:
    if not ok:
        raise ConfigurationError(f"{setting} {rule}", setting=setting)
