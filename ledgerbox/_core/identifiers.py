"""Validation of names that end up in SQL text or Kafka topic names."""

from __future__ import annotations

import re

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


def kafka_topic(value: str) -> str:
    """Return ``value`` if it is a legal Kafka topic name, else raise ``ConfigurationError``."""
    if not isinstance(value, str) or not _KAFKA_TOPIC.fullmatch(value) or value in {".", ".."}:
        raise ConfigurationError(
            f"topic {value!r} is not a legal Kafka topic name: [a-zA-Z0-9._-], 1 to 249 chars"
        )
    return value
