"""The values of the operator API: where to act (:class:`Database`), what to select
(:class:`DeadFilter`, :class:`DlqFilter`) and what comes back (frozen dataclasses, each with
``to_json()`` returning only JSON types: datetimes as ISO 8601 UTC text)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import getpass
from dataclasses import dataclass, field
from typing import Any

from ledgerbox._core.database_url import check_database_url, database_label
from ledgerbox._core.durations import check_duration
from ledgerbox._core.errors import ConfigurationError
from ledgerbox._core.identifiers import check_service_names
from ledgerbox.admin._errors import InvalidFilterError

__all__ = [
    "ActionResult",
    "AuditEntry",
    "Database",
    "DeadEvent",
    "DeadFilter",
    "DlqFilter",
    "DlqRecord",
    "HeldKey",
    "PartitionLag",
    "RelayStatus",
    "ShardOwner",
    "default_actor",
]

#: Largest ``limit`` a filter accepts.
MAX_LIMIT = 10_000


def default_actor() -> str:
    """The OS user running the command (``getpass.getuser()``), ``"unknown"`` if none."""
    try:
        return getpass.getuser() or "unknown"
    except (OSError, KeyError):  # no login name, no passwd entry (a container's uid)
        return "unknown"


def audit_actor(actor: str | None) -> str:
    """Who acts, for the audit row: ``actor``, or the OS user (:func:`default_actor`) when it
    is ``None``.

    Raises
    ------
    ledgerbox.admin.InvalidFilterError
        ``setting="actor"``: an empty or blank actor (``--actor "$WHO"`` with ``WHO`` unset),
        refused as an empty filter is: recording the OS user instead, or blanks, would
        hide who acted.
    """
    if actor is None:
        return default_actor()
    if not actor.strip():
        raise InvalidFilterError(
            f"the actor is empty ({actor!r}; an unset shell variable?): give a name, or leave "
            "--actor out (the OS user is recorded)",
            setting="actor",
        )
    return actor


def _jsonable(value: Any) -> Any:
    if isinstance(value, _Json):
        return value.to_json()
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).isoformat()
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


class _Json:
    """``to_json()``: the dataclass's fields as JSON types."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:
        """The fields by name; datetimes as ISO 8601 UTC text, tuples as lists."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class Database:
    """The service database holding the ledgerbox tables.

    Parameters
    ----------
    url : str
        SQLAlchemy / psycopg URL (``postgresql+psycopg://user:pw@host:5432/db`` or
        ``postgresql://...``).
    schema : str | None
        Schema of the ledgerbox tables; ``None``: the search path.
    outbox_table, inbox_table : str
        Table names (default ``outbox``, ``inbox``).

    Raises
    ------
    ledgerbox.ConfigurationError
        If ``url`` is not a PostgreSQL URL or can never connect (libpq cannot parse it, a
        port outside 1..65535; ``setting`` is ``"database_url"``; the message never shows
        the URL, which may hold a password) or a name is not a SQL identifier.
    """

    url: str = field(repr=False)
    schema: str | None = None
    outbox_table: str = "outbox"
    inbox_table: str = "inbox"

    def __post_init__(self) -> None:
        _check_url(self.url)
        check_service_names(self.outbox_table, self.inbox_table, self.schema)

    @property
    def label(self) -> str:
        """``host:port/db`` for messages (never the password)."""
        return database_label(self.url)


def _check_url(url: str) -> None:
    """Refuse what SQLAlchemy cannot parse or what is not PostgreSQL, before any engine is
    made (an engine would raise a bare ``ArgumentError`` or a missing-driver error)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        backend = make_url(url).get_backend_name()
    except (ArgumentError, ValueError):
        backend = None
    if backend not in ("postgresql", "postgres"):
        raise ConfigurationError(
            "the database URL is not a PostgreSQL URL: give "
            "postgresql+psycopg://user:password@host:5432/database "
            "(--database-url or DATABASE_URL)",
            setting="database_url",
        )
    try:
        check_database_url(url, reader="sqlalchemy")
    except ConfigurationError as exc:
        raise ConfigurationError(
            f"{exc} (--database-url or DATABASE_URL)", setting="database_url"
        ) from None


def _check_common(limit: int, older_than_s: float | None, texts: dict[str, str | None]) -> None:
    for name, value in texts.items():
        # An empty value is a mistake (an unset shell variable: --error "$ERR"), never a
        # choice: as a substring it would select every row, as an exact value none.
        if value == "":
            flag = "--" + name.replace("_", "-")
            raise InvalidFilterError(
                f"the {name} filter is empty ({value!r}; an unset shell variable?): give a "
                f"value, or leave {flag} out",
                setting=name,
            )
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidFilterError(
            f"limit must be between 1 and {MAX_LIMIT}, not {limit} (--limit)", setting="limit"
        )
    if older_than_s is not None:
        check_duration(older_than_s, "older_than_s", error=InvalidFilterError)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadFilter(_Json):
    """Which dead-lettered outbox rows (``status = 2``) to select; ``None``: any.

    Parameters
    ----------
    key : str | None
        Partition key, exact.
    event_type, topic : str | None
        Exact.
    older_than_s : float | None
        Rows created more than this many seconds ago (``>= 0``).
    error : str | None
        Substring of ``last_error``, case-insensitive.
    limit : int
        At most this many rows (1..10000), in id order.

    Raises
    ------
    ledgerbox.admin.InvalidFilterError
        A limit or age out of range, or an empty text filter (``setting`` names
        the field).
    """

    key: str | None = None
    event_type: str | None = None
    topic: str | None = None
    older_than_s: float | None = None
    error: str | None = None
    limit: int = 100

    def __post_init__(self) -> None:
        texts = {"key": self.key, "event_type": self.event_type, "topic": self.topic}
        _check_common(self.limit, self.older_than_s, {**texts, "error": self.error})


@dataclass(frozen=True, slots=True, kw_only=True)
class DlqFilter(_Json):
    """Which records of a dead-letter topic to select; ``None``: any.

    Parameters
    ----------
    dlq_topic : str
        The dead-letter topic to read (``<source topic>.dlq`` unless the consumer set
        ``dead_letter_topic``).
    group : str | None
        The ``ledgerbox_consumer_group`` header, exact.
    key : str | None
        The record key (UTF-8), exact.
    event_type : str | None
        The ``ce_type`` header, exact.
    older_than_s : float | None
        Records dead-lettered more than this many seconds ago.
    error : str | None
        Substring of the error type or message, case-insensitive.
    include_done : bool
        Also records already replayed or discarded (``--all``).
    limit : int
        At most this many records (1..10000), in (partition, offset) order.

    Raises
    ------
    ledgerbox.admin.InvalidFilterError
        An empty topic, an empty text filter, a limit or age out of range.
    """

    dlq_topic: str
    group: str | None = None
    key: str | None = None
    event_type: str | None = None
    older_than_s: float | None = None
    error: str | None = None
    include_done: bool = False
    limit: int = 100

    def __post_init__(self) -> None:
        if not self.dlq_topic:
            raise InvalidFilterError("dlq_topic must not be empty", setting="dlq_topic")
        texts = {"group": self.group, "key": self.key, "event_type": self.event_type}
        _check_common(self.limit, self.older_than_s, {**texts, "error": self.error})


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadEvent(_Json):
    """A dead-lettered outbox row (``status = 2``): the relay gave up publishing it.

    ``held_behind``: rows of the same key waiting behind it (``status = 3``) with
    ``on_dead_letter="hold"``. ``payload`` / ``headers`` (JSON text) are only set by
    :func:`ledgerbox.admin.show_dead_event`. Times are UTC.
    """

    id: int
    event_id: str
    key: str
    event_type: str
    topic: str
    shard: int
    attempts: int
    last_error: str | None
    created_at: dt.datetime
    occurred_at: dt.datetime
    held_behind: int
    payload: str | None = None
    headers: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldKey(_Json):
    """A partition key whose later rows wait behind a dead-lettered row.

    ``dead_id`` / ``dead_event_id``: its first dead-lettered row (replaying or discarding it
    releases the rows behind it); ``dead_count``: its dead-lettered rows; ``held``: rows
    waiting; ``since``: ``created_at`` of ``dead_id`` (UTC).
    """

    key: str
    dead_id: int
    dead_event_id: str
    dead_count: int
    held: int
    since: dt.datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class DlqRecord(_Json):
    """A record of a dead-letter topic, decoded from its headers.

    ``ref`` (``<dlq_topic>:<partition>:<offset>``) names it for replay and discard;
    ``group``: the consumer group that dead-lettered it (``None``: written before the header
    existed); ``state``: ``"dead"``, ``"replayed"`` or ``"discarded"``; header values and the
    key are UTF-8 text (undecodable bytes replaced); ``value`` only set by
    :func:`ledgerbox.admin.show_dlq_record`.
    """

    ref: str
    dlq_topic: str
    partition: int
    offset: int
    group: str | None
    source_topic: str | None
    source_partition: int | None
    source_offset: int | None
    event_id: str | None
    event_type: str | None
    key: str | None
    error_type: str | None
    error_message: str | None
    attempts: int | None
    dead_lettered_at: dt.datetime
    state: str
    headers: list[tuple[str, str]]
    value: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionLag(_Json):
    """A consumer group's lag on one partition, in records: ``high_watermark -
    committed`` (``committed`` ``None``: the group committed nothing there; the lag is then
    counted from the partition's first offset still in the log)."""

    topic: str
    partition: int
    committed: int | None
    high_watermark: int
    lag: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardOwner(_Json):
    """One lease row: ``shard`` (``-1``: the leader's), its ``owner`` (a relay id; ``None``
    when free), ``fence`` and whether the lease is ``live`` (not expired)."""

    shard: int
    owner: str | None
    fence: int
    live: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayStatus(_Json):
    """What ``ledgerbox relay status`` shows: ``pending`` events the shards' cursors have
    not passed, the age of the oldest in seconds (``None``: none pending), the
    ``dead_lettered`` and ``held`` counts, the lease ``owners`` by shard, the ``refused``
    shards ``(shard, reason)``, the ``held_keys`` (at most 20) and ``stray``: events waiting
    in shards outside ``0..shard_count-1``, which no relay publishes (the writers'
    ``OutboxTable.shard_count`` is larger; counted up to 10,000; not in ``pending``)."""

    pending: int
    oldest_pending_age_s: float | None
    dead_lettered: int
    held: int
    owners: list[ShardOwner]
    refused: list[tuple[int, str]]
    held_keys: list[HeldKey]
    stray: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionResult(_Json):
    """What an operator action did (or, with ``dry_run``, would do).

    ``action``: ``relay.dead.replay``, ``relay.dead.discard``, ``consumer.dlq.replay`` or
    ``consumer.dlq.discard``; ``ids``: the row ids (as text) or DLQ refs selected, in
    order; ``changed``: rows changed (0 on a dry run; a relay replay counts the held rows
    it released); ``audit_id``: the audit row written; ``at``: when (UTC, the database's
    clock).
    """

    action: str
    actor: str
    dry_run: bool
    ids: list[str]
    changed: int
    audit_id: int
    at: dt.datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditEntry(_Json):
    """One row of the audit table ``ledgerbox_ops_audit``: who did what, when."""

    id: int
    at: dt.datetime
    actor: str
    action: str
    dry_run: bool
    filters: dict[str, Any]
    ids: list[str]
    changed: int
