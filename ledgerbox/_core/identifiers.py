"""Validation of names that end up in SQL text or Kafka topic names."""

from __future__ import annotations

import re

from ledgerbox._core.errors import ConfigurationError

_SQL_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
# Kafka's own rule (kafka.common.internals.Topic): legal chars and max length 249.
_KAFKA_TOPIC = re.compile(r"^[a-zA-Z0-9._-]{1,249}$")


def sql_identifier(value: str, what: str) -> str:
    """Return ``value`` if it is a safe unquoted PostgreSQL identifier, else raise.

    Only lower-case ASCII letters, digits and ``_`` are accepted, at most 63 bytes
    (PostgreSQL's ``NAMEDATALEN - 1``), so the name means the same quoted or unquoted and
    can be embedded in DDL such as trigger functions without escaping.

    Raises
    ------
    ConfigurationError
        If the name does not match ``[a-z_][a-z0-9_]{0,62}``.
    """
    if not isinstance(value, str) or not _SQL_IDENTIFIER.match(value):
        raise ConfigurationError(
            f"{what} {value!r} is not a valid SQL identifier: "
            "use [a-z_][a-z0-9_]*, at most 63 chars"
        )
    return value


def kafka_topic(value: str) -> str:
    """Return ``value`` if it is a legal Kafka topic name, else raise ``ConfigurationError``."""
    if not isinstance(value, str) or not _KAFKA_TOPIC.match(value) or value in {".", ".."}:
        raise ConfigurationError(
            f"topic {value!r} is not a legal Kafka topic name: [a-zA-Z0-9._-], 1 to 249 chars"
        )
    return value
