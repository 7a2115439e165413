"""Validation of names that end up in SQL text or Kafka topic names."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

from ledgerbox._core.errors import ConfigurationError

# Used with fullmatch: "^...$" with match() also accepted a final newline ("outbox\n").
_SQL_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")
# PostgreSQL's reserved key words (pg_get_keywords() catcode 'R' and 'T' of PostgreSQL 15, plus
# system_user, reserved since 16): a table or schema cannot be named by one of them unquoted
# (the grammar's ColId takes only unreserved and column-name key words), and ledgerbox's SQL
# (trigger DDL, the relay's and the writer's own statements) embeds names unquoted.
# tests/integration/test_migrations.py checks this set against the server's.
_RESERVED = """
all analyse analyze and any array as asc asymmetric authorization binary both case cast check
collate collation column concurrently constraint create cross current_catalog current_date
current_role current_schema current_time current_timestamp current_user default deferrable
desc distinct do else end except false fetch for foreign freeze from full grant group having
ilike in initially inner intersect into is isnull join lateral leading left like limit
localtime localtimestamp natural not notnull null offset on only or order outer overlaps
placing primary references returning right select session_user similar some symmetric
system_user table tablesample then to trailing true union unique user using variadic verbose
when where window with
"""
RESERVED_KEYWORDS: frozenset[str] = frozenset(_RESERVED.split())
# Kafka's own rule (kafka.common.internals.Topic): legal chars and max length 249.
_KAFKA_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")


def sql_identifier(value: str, what: str) -> str:
    """Return ``value`` if it is a safe unquoted PostgreSQL identifier, else raise.

    Only lower-case ASCII letters, digits and ``_`` are accepted, at most 63 bytes
    (PostgreSQL's ``NAMEDATALEN - 1``), and no reserved key word (``order``, ``user``,
    ``table``: :data:`RESERVED_KEYWORDS`), so the name means the same quoted or unquoted and
    can be embedded in DDL such as trigger functions without escaping.

    Raises
    ------
    ConfigurationError
        If the name does not match ``[a-z_][a-z0-9_]{0,62}`` or is a reserved key word.
    """
    if not isinstance(value, str) or not _SQL_IDENTIFIER.fullmatch(value):
        raise ConfigurationError(
            f"{what} {value!r} is not a valid SQL identifier: "
            "use [a-z_][a-z0-9_]*, at most 63 chars"
        )
    if value in RESERVED_KEYWORDS:
        raise ConfigurationError(
            f"{what} {value!r} is a reserved SQL key word: choose another name (e.g. {value}s)"
        )
    return value


#: PostgreSQL's longest identifier, in bytes (``NAMEDATALEN - 1``); the names here are ASCII.
MAX_IDENTIFIER_CHARS = 63

#: Every identifier ledgerbox derives from an outbox table's name: its constraints and indexes
#: (schema revisions 1 and 2), its id sequence, its NOTIFY trigger and function, the relay's
#: tables and their primary keys. The longest decides how long the name may be.
#: tests/integration/test_migrations.py checks this list against what a migration creates.
OUTBOX_DERIVED_NAMES = (
    "{}_pkey",
    "{}_id_seq",
    "uq_{}_idempotency_key",
    "uq_{}_event_id",
    "ix_{}_shard_txid",
    "ix_{}_held",
    "ix_{}_pending",
    "ix_{}_dead",
    "ix_{}_published_at",
    "{}_notify",
    "{}_relay_lease",
    "{}_relay_lease_pkey",
    "{}_relay_member",
    "{}_relay_member_pkey",
    "{}_relay_tick",
    "{}_relay_tick_pkey",
)
#: The same for an inbox table (its primary key is named in conflict classification).
INBOX_DERIVED_NAMES = ("{}_pkey", "ix_{}_first_seen_at")


def outbox_table_name(value: str, what: str = "outbox table name") -> str:
    """Return ``value`` if it can name an outbox table, else raise.

    :func:`sql_identifier`, and short enough that every identifier derived from it
    (:data:`OUTBOX_DERIVED_NAMES`, e.g. ``uq_<name>_idempotency_key``) fits PostgreSQL's 63
    bytes: at most 44 chars. A longer name used to pass every setting check and fail at
    ``ledgerbox migrate`` (SQLAlchemy's IdentifierError), or be truncated by PostgreSQL.

    Raises
    ------
    ConfigurationError
        If the name is not a valid identifier or is longer than 44 chars.
    """
    return _table_name(value, what, OUTBOX_DERIVED_NAMES)


def inbox_table_name(value: str, what: str = "inbox table name") -> str:
    """Return ``value`` if it can name an inbox table (as :func:`outbox_table_name`, with
    :data:`INBOX_DERIVED_NAMES`: at most 46 chars), else raise ``ConfigurationError``."""
    return _table_name(value, what, INBOX_DERIVED_NAMES)


def _table_name(value: str, what: str, derived: tuple[str, ...]) -> str:
    sql_identifier(value, what)
    longest = max(derived, key=len)
    name = longest.format(value)
    if len(name) > MAX_IDENTIFIER_CHARS:
        limit = MAX_IDENTIFIER_CHARS - (len(longest) - 2)
        raise ConfigurationError(
            f"{what} {value!r} is {len(value)} chars: ledgerbox derives {name!r} "
            f"({len(name)} chars) from it, over PostgreSQL's {MAX_IDENTIFIER_CHARS}: "
            f"use at most {limit} chars"
        )
    return value


def named(check: Callable[[str, str], str], value: str, what: str, setting: str) -> str:
    """``check(value, what)``, its ``ConfigurationError`` naming ``setting``, so that a
    command's one line names the flag and the variable (``; set --outbox-table or ...``)."""
    try:
        return check(value, what)
    except ConfigurationError as exc:
        raise ConfigurationError(str(exc), setting=setting) from None


def check_service_names(outbox_table: str, inbox_table: str, schema: str | None) -> None:
    """Check the outbox and inbox table names and the schema of one service (the console's
    services, ``ledgerbox.admin.Database``), each refusal naming its setting.

    Raises
    ------
    ConfigurationError
        ``setting`` is ``"outbox_table"``, ``"inbox_table"`` or ``"schema"``.
    """
    checks: list[tuple[Callable[[str, str], str], str | None, str]] = [
        (outbox_table_name, outbox_table, "outbox_table"),
        (inbox_table_name, inbox_table, "inbox_table"),
        (sql_identifier, schema, "schema"),
    ]
    for check, value, setting in checks:
        if value is not None:
            named(check, value, setting.replace("_", " "), setting)


def outbox_notify_channel(table: str, schema: str | None) -> str:
    """The LISTEN/NOTIFY channel of the outbox table ``table`` in ``schema`` (``None``: the
    search path): ``<table>_<schema or "default">_ledgerbox``, docs/outbox.md.

    Raises
    ------
    ConfigurationError
        If it is over PostgreSQL's 63 chars: ``pg_notify`` refuses it ("channel name too
        long"), so every INSERT would fail in the NOTIFY trigger. Checked where the pair is
        configured (``OutboxTable``, ``RelayConfig``, ``ledgerbox migrate``).
    """
    channel = f"{table}_{schema or 'default'}_ledgerbox"
    if len(channel) > MAX_IDENTIFIER_CHARS:
        raise ConfigurationError(
            f"outbox table name {table!r} and schema {schema!r} make the notify channel "
            f"{channel!r} {len(channel)} chars, over PostgreSQL's {MAX_IDENTIFIER_CHARS}: "
            "shorten the table or schema name"
        )
    return channel


#: First half of the wake gate's advisory lock key: "ledg" (a constant that makes a collision
#: with an application's own two-key advisory locks unlikely; one-key locks never collide).
WAKE_GATE_CLASS = 0x6C656467


def wake_gate_key(channel: str) -> tuple[int, int]:
    """The two ``int4`` advisory lock keys of the outbox ``channel``'s wake gate.

    ``(WAKE_GATE_CLASS, h)`` with ``h`` the BLAKE2b digest of the channel's UTF-8 bytes with
    ``digest_size=4``, big-endian, as a signed ``int4``: stable across Python and
    PostgreSQL versions (``hashtext`` is not promised to be). The trigger of revision 0004
    holds the pair as literals and the relay computes it: it is a contract, never to change
    (a test pins it; docs/relay.md, "Wake gate").
    """
    digest = hashlib.blake2b(channel.encode(), digest_size=4).digest()
    return WAKE_GATE_CLASS, int.from_bytes(digest, "big", signed=True)


def kafka_topic(value: str) -> str:
    """Return ``value`` if it is a legal Kafka topic name, else raise ``ConfigurationError``."""
    if not isinstance(value, str) or not _KAFKA_TOPIC.fullmatch(value) or value in {".", ".."}:
        raise ConfigurationError(
            f"topic {value!r} is not a legal Kafka topic name: [a-zA-Z0-9._-], 1 to 249 chars"
        )
    return value
