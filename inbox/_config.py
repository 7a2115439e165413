"""Configuration of an inbox consumer: typed, validated when built, units in the names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ledgerbox._core.backoff import Backoff
from ledgerbox._core.database_url import check_database_url
from ledgerbox._core.durations import check_duration
from ledgerbox._core.errors import ConfigurationError
from ledgerbox._core.identifiers import inbox_table_name, kafka_topic, named, sql_identifier
from ledgerbox._core.kafka import KafkaSettings, resolve_kafka
from ledgerbox._core.redis_url import check_redis_url

__all__ = [
    "DEFAULT_RETENTION_S",
    "STALLED_AFTER_S",
    "STOP_TIMEOUT_S",
    "ConsumerConfig",
    "OnUnhandled",
]

#: Default of ``ConsumerConfig.stalled_after_s``, in seconds: far longer than a healthy
#: batch (milliseconds to a few seconds with retries), short enough that a partition stalled
#: behind a forgotten transaction shows in health within a minute.
STALLED_AFTER_S = 30.0

#: Default of ``ConsumerConfig.stop_timeout_s``, in seconds: the longest a stop waits for
#: Kafka. A consumer stopped during a Kafka outage exits in about this long, far inside
#: Kubernetes' default 30 s grace period (before: never, until Kafka came back, when an
#: offset was left to commit: aiokafka retries a commit until it finds the coordinator).
STOP_TIMEOUT_S = 8.0

#: Default dedup window (inbox retention) and Kafka's default ``offsets.retention.minutes``
#: (7 days): a redelivery can come back as long as the group's committed offsets live.
DEFAULT_RETENTION_S = 7 * 24 * 3600.0

#: What a consumer does with an event whose type has no handler.
OnUnhandled = Literal["ignore", "dead_letter", "fail"]


@dataclass(frozen=True, kw_only=True)
class ConsumerConfig:
    """Settings of one :class:`inbox.InboxConsumer`.

    Parameters
    ----------
    group_id : str
        Kafka consumer group, and the inbox's dedup scope: one effect per (group, event id).
    topics : Sequence[str]
        Topics to subscribe to (at least one).
    database_url : str
        SQLAlchemy URL, ``postgresql+psycopg://...`` (used for the sync and async engines).
        TLS settings go in its query and reach psycopg as they are (``?sslmode=verify-full&
        sslrootcert=/etc/ssl/db-ca.pem``; docs/security.md). Its password is never logged.
    kafka_bootstrap_servers : str
        ``host:port[,host:port]``. Alone it means PLAINTEXT; ``kafka`` adds TLS and a login.
    kafka : KafkaSettings | None
        Where Kafka is and how to log in, for the consumer, its dead-letter producer and its
        checks (docs/security.md; :meth:`KafkaSettings.from_env` reads the ``ledgerbox
        consumer`` variables); ``None``: ``kafka_bootstrap_servers`` in PLAINTEXT. Give one
        of the two (both only if their servers agree).
    redis_url : str | None
        ``redis://...`` for the fast path (dedup hint, aggregate locks); ``None``: DB only.
        ``redis://user:password@host:6379/0`` logs in with an ACL user (or ``:password@``
        with ``requirepass``); ``rediss://`` is TLS. One that can never work (another
        scheme, a port outside 1..65535, a database that is not an integer) is refused here.
    redis_ssl_cafile : str | None
        PEM file of the CA that signed the Redis server's certificate, for ``rediss://``;
        ``None``: the system's CAs.
    inbox_table, schema : str, str | None
        Name and schema of the inbox table (validated SQL identifiers).
    dead_letter_topic : str | None
        Topic for poison records; ``None``: ``<source topic>.dlq``.
    lock_aggregates : bool
        Take a per-aggregate Redis lock around each message (needs ``redis_url``).
    max_attempts : int
        Attempts per message before it is dead-lettered (>= 1). Only attempts that failed
        for the message count (transient errors, undeclared handler exceptions); faults of
        the environment are retried without bound and never count (docs/inbox.md,
        "Errors and retries").
    retry_on : Sequence[type[BaseException]]
        Exception types a handler may raise that are worth retrying (up to
        ``max_attempts``). They may also make a database error of the data retryable, e.g.
        ``psycopg.errors.ForeignKeyViolation`` for a parent row that arrives later.
    dead_letter_on : Sequence[type[BaseException]]
        Exception types that mean the event can never be applied: dead-lettered after one
        attempt. An exception type in neither list is retried up to ``max_attempts``, then
        dead-lettered. Neither list can make a fault of the environment (connection,
        schema, privilege, read-only...) dead-letter an event, nor a serialization failure
        or version conflict skip its retries. The most specific listed class wins; a class
        in both lists is refused.
    on_unhandled : "ignore" | "dead_letter" | "fail"
        An event whose type has no handler: ``"ignore"`` (default) acknowledges it, with one
        WARNING per type and the counter ``ledgerbox_inbox_unhandled_total``;
        ``"dead_letter"`` sends it to the dead-letter topic (:class:`inbox.UnhandledEventError`);
        ``"fail"`` stops its partition like a fault of the environment (health ``down``
        naming the type) until a handler for it is registered.
    dedup_ttl_s : float
        TTL of the Redis "done" key, in seconds (default 1 day). A hint only: after it
        expires the DB inbox still recognises the duplicate.
    in_progress_ttl_ms : int | None
        TTL of the Redis "in progress" marker, in ms (default 5 s); ``None`` disables the
        marker. A worker that sees another's marker waits at most this long, then goes to the
        database anyway, so a crashed claimant never makes an event be skipped (C11).
    lock_ttl_ms : int
        TTL of the aggregate lock, in ms; renewed every third of it while the handler runs.
    lock_wait_ms : int | None
        How long to wait for a taken lock before a retry, in ms; ``None``: ``lock_ttl_ms``.
    retention_s : float
        Dedup window: inbox rows younger than this are never purged (default 7 days). Must
        be at least ``offset_retention_s``. Purge also keeps every row whose record Kafka can
        still redeliver to the group (docs/inbox.md, "Retention").
    offset_retention_s : float
        The group's redelivery horizon: how long the broker keeps the committed offsets of a
        group that stopped (Kafka ``offsets.retention.minutes``, default 7 days). A
        ``retention_s`` below it is refused.
    retry_base_s, retry_max_s : float
        Exponential backoff with full jitter between attempts, in seconds.
    redis_timeout_s : float
        Socket and connect timeout of Redis calls, in seconds: an outage costs at most this.
    redis_probe_interval_s : float
        While Redis is down, calls are skipped and it is probed this often, in seconds.
    auto_offset_reset : str
        ``"earliest"`` (default) or ``"latest"`` for a group without committed offsets.
    commit_interval_ms : int
        Offsets of finished records are committed at least this often, in ms (and always on
        revoke and stop). A crash before a commit only causes redeliveries, caught by the inbox.
    max_buffered_records : int
        Records buffered per partition before fetching from it is paused.
    batch_max_records : int
        Up to this many records already waiting on one partition are applied in ONE
        transaction (one multi-row inbox insert, handlers in offset order, one commit); any
        error rolls the batch back and its records are reprocessed one by one, with the
        usual retries and dead-lettering. 1 disables batching; it is also off with
        ``lock_aggregates`` (locks are per message).
    batch_across_partitions : bool
        A worker that starts a batch with room left takes in the records waiting on this
        consumer's idle partitions, each partition's in offset order (default True): under
        load one transaction instead of one per partition (measured: ~20% less consumer CPU
        and ~9% less PostgreSQL CPU at 1,000 events/s on 3 partitions; docs/inbox.md,
        "Across partitions"). A batch that rolls back, or a record that needs the per-message path,
        gives the other partitions' records back: each partition then runs its own, so a
        failing record holds up only its partition. False: one partition per transaction.
    assignment : Sequence[tuple[str, int]] | None
        Manual partition assignment (no group rebalancing) instead of subscribing to
        ``topics``; offsets are still committed to ``group_id``.
    client_id : str | None
        Kafka client id; defaults to ``ledgerbox-inbox-<group_id>``.
    stop_timeout_s : float
        Most a stop (SIGTERM, :meth:`inbox.InboxConsumer.stop`) waits for Kafka, in seconds
        (default :data:`STOP_TIMEOUT_S`, 8), counted from the stop: the final offset
        commit and the Kafka client's stop (leaving the group). The in-flight records
        finish first (database, not Kafka; a dead-letter send in flight gets
        ``stop_timeout_s`` of its own, also on a revoke, then the record is abandoned and
        delivered again after the restart); an offset Kafka did not take by then is not
        committed and its records are delivered again after the restart, recognised by the
        inbox (never applied twice). With Kafka up a stop finishes long before.
    stalled_after_s : float | None
        A partition whose batch has been running this long, in seconds (default
        :data:`STALLED_AFTER_S`, 30), turns health ``down`` naming the partition and the
        offset, until the batch ends: a handler that waits on a lock another transaction
        holds (a session idle in transaction, a migration queued for an exclusive lock), a
        slow call in a handler, retries that do not end. Nothing is cancelled: the batch
        goes on when the wait ends (to cancel lock waits, set PostgreSQL's ``lock_timeout``:
        docs/inbox.md, "A partition that stalls"). ``None``: no such check.

    Raises
    ------
    ledgerbox.ConfigurationError
        On an invalid value; among them a ``database_url`` that can never connect (not
        PostgreSQL, libpq cannot parse it, a port outside 1..65535): refused here, not
        retried, while a database server that is down is waited for
        (:mod:`ledgerbox._core.database_url`).
    """

    group_id: str
    topics: Sequence[str]
    # repr=False: a config in a log line or a traceback must not show a URL's password.
    database_url: str = field(repr=False)
    kafka_bootstrap_servers: str = ""
    kafka: KafkaSettings | None = None
    redis_url: str | None = field(default=None, repr=False)
    redis_ssl_cafile: str | None = None
    inbox_table: str = "inbox"
    schema: str | None = None
    dead_letter_topic: str | None = None
    lock_aggregates: bool = False
    max_attempts: int = 5
    retry_on: Sequence[type[BaseException]] = ()
    dead_letter_on: Sequence[type[BaseException]] = ()
    on_unhandled: OnUnhandled = "ignore"
    dedup_ttl_s: float = 86400.0
    in_progress_ttl_ms: int | None = 5000
    lock_ttl_ms: int = 10000
    lock_wait_ms: int | None = None
    retention_s: float = DEFAULT_RETENTION_S
    offset_retention_s: float = DEFAULT_RETENTION_S
    retry_base_s: float = 0.05
    retry_max_s: float = 5.0
    redis_timeout_s: float = 0.5
    redis_probe_interval_s: float = 1.0
    auto_offset_reset: str = "earliest"
    commit_interval_ms: int = 200
    max_buffered_records: int = 1000
    batch_max_records: int = 100
    batch_across_partitions: bool = True
    assignment: Sequence[tuple[str, int]] | None = None
    client_id: str | None = None
    redis_key_prefix: str = "ledgerbox:"
    stop_timeout_s: float = STOP_TIMEOUT_S
    stalled_after_s: float | None = STALLED_AFTER_S
    _backoff: Backoff = field(init=False, repr=False, compare=False)
    _kafka: KafkaSettings = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.group_id:
            raise ConfigurationError("group_id must not be empty")
        check_database_url(self.database_url, reader="sqlalchemy")  # never connects: not waited for
        if self.redis_url is not None:
            check_redis_url(self.redis_url)  # a Redis that is down is not found here
        object.__setattr__(self, "_kafka", resolve_kafka(self.kafka, self.kafka_bootstrap_servers))
        if self.redis_ssl_cafile is not None:
            if self.redis_url is None or not self.redis_url.startswith("rediss://"):
                raise ConfigurationError(
                    "redis_ssl_cafile needs a rediss:// redis_url (TLS)", setting="redis_ssl_cafile"
                )
            if not Path(self.redis_ssl_cafile).is_file():
                raise ConfigurationError(
                    f"redis_ssl_cafile is not a readable file: {self.redis_ssl_cafile}",
                    setting="redis_ssl_cafile",
                )
        if isinstance(self.topics, str):
            raise ConfigurationError("topics must be a list of topic names, not a string")
        object.__setattr__(self, "topics", tuple(self.topics))
        if not self.topics and not self.assignment:
            raise ConfigurationError("topics must name at least one topic")
        # Kafka refuses an illegal name only in each fetch's metadata, which looked like an
        # unreachable broker (a newcomer's review): refused here, as the writer refuses it.
        for topic in self.topics:
            kafka_topic(topic)
        if self.dead_letter_topic is not None:
            kafka_topic(self.dead_letter_topic)
        else:
            for topic in (*self.topics, *(t for t, _p in self.assignment or ())):
                if len(topic) + len(".dlq") > 249:  # Kafka's limit on a topic name
                    raise ConfigurationError(
                        f"topic {topic[:40]!r}... ({len(topic)} chars) leaves no room for its"
                        " dead-letter topic <topic>.dlq (249 chars at most): set"
                        " dead_letter_topic",
                        setting="dead_letter_topic",
                    )
        whole = {
            "max_attempts": self.max_attempts,
            "lock_ttl_ms": self.lock_ttl_ms,
            "commit_interval_ms": self.commit_interval_ms,
            "max_buffered_records": self.max_buffered_records,
            "batch_max_records": self.batch_max_records,
            "in_progress_ttl_ms": self.in_progress_ttl_ms,
            "lock_wait_ms": self.lock_wait_ms,
        }
        for name, value in whole.items():
            if value is not None and type(value) is not int:
                raise ConfigurationError(
                    f"{name} must be a whole number, got {value!r}", setting=name
                )
        named(inbox_table_name, self.inbox_table, "inbox table name", "inbox_table")
        if self.schema is not None:
            named(sql_identifier, self.schema, "schema", "schema")
        positive = {
            "max_attempts": self.max_attempts,
            "lock_ttl_ms": self.lock_ttl_ms,
            "commit_interval_ms": self.commit_interval_ms,
            "max_buffered_records": self.max_buffered_records,
            "batch_max_records": self.batch_max_records,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigurationError(f"{name} must be > 0, got {value}")
        if not isinstance(self.batch_across_partitions, bool):
            raise ConfigurationError(
                "batch_across_partitions must be True or False,"
                f" got {self.batch_across_partitions!r}"
            )
        # Every duration: finite, in its range (inf/nan parse as floats; a huge one overflows
        # the intervals PostgreSQL adds to now() and Redis' TTLs).
        for name in (
            "dedup_ttl_s",
            "retention_s",
            "offset_retention_s",
            "retry_base_s",
            "retry_max_s",
            "redis_timeout_s",
            "redis_probe_interval_s",
            "stop_timeout_s",
        ):
            check_duration(getattr(self, name), name, low_open=True)
        if self.in_progress_ttl_ms is not None and self.in_progress_ttl_ms <= 0:
            raise ConfigurationError("in_progress_ttl_ms must be > 0 or None")
        if self.stalled_after_s is not None:
            check_duration(self.stalled_after_s, "stalled_after_s", low_open=True)
        if self.lock_wait_ms is not None and self.lock_wait_ms < 0:
            raise ConfigurationError("lock_wait_ms must be >= 0 or None")
        if self.auto_offset_reset not in ("earliest", "latest"):
            raise ConfigurationError("auto_offset_reset must be 'earliest' or 'latest'")
        if self.lock_aggregates and self.redis_url is None:
            raise ConfigurationError("lock_aggregates needs redis_url")
        object.__setattr__(self, "_backoff", Backoff(self.retry_base_s, self.retry_max_s))
        if self.assignment is not None:
            object.__setattr__(
                self, "assignment", tuple((kafka_topic(t), int(p)) for t, p in self.assignment)
            )
        if self.retention_s < self.offset_retention_s:
            raise ConfigurationError(
                f"inbox retention_s={self.retention_s:g} is shorter than the group's "
                f"offset_retention_s={self.offset_retention_s:g}: an event redelivered after "
                "its inbox row was purged would be applied again; raise retention_s"
            )
        if self.on_unhandled not in ("ignore", "dead_letter", "fail"):
            raise ConfigurationError(
                f"on_unhandled must be 'ignore', 'dead_letter' or 'fail', got {self.on_unhandled!r}"
            )
        for name in ("retry_on", "dead_letter_on"):
            given = getattr(self, name)
            types_ = (given,) if isinstance(given, type) else tuple(given)
            for item in types_:
                if not (isinstance(item, type) and issubclass(item, BaseException)):
                    raise ConfigurationError(f"{name} must hold exception types, got {item!r}")
            object.__setattr__(self, name, types_)
        both = set(self.retry_on) & set(self.dead_letter_on)
        if both:
            names = ", ".join(sorted(t.__qualname__ for t in both))
            raise ConfigurationError(f"{names} cannot be in both retry_on and dead_letter_on")

    @property
    def kafka_settings(self) -> KafkaSettings:
        """The Kafka settings every Kafka client of the consumer uses: ``kafka``, or
        PLAINTEXT to ``kafka_bootstrap_servers``."""
        return self._kafka

    @property
    def backoff(self) -> Backoff:
        """The retry backoff built from ``retry_base_s`` / ``retry_max_s``."""
        return self._backoff

    @property
    def effective_lock_wait_ms(self) -> int:
        """``lock_wait_ms`` or, when ``None``, ``lock_ttl_ms``."""
        return self.lock_ttl_ms if self.lock_wait_ms is None else self.lock_wait_ms

    def dead_letter_topic_for(self, source_topic: str) -> str:
        """The dead-letter topic of records from ``source_topic``."""
        return self.dead_letter_topic or f"{source_topic}.dlq"
