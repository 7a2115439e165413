"""What the console shows and where it listens: :class:`ServiceTarget` (one service) and
:class:`ConsoleConfig` (the services, the Kafka settings, the address, the token).

Validated when built (one line per problem, naming the setting): the console refuses to
listen on an address other than a loopback one without a token (docs/console.md, "Access";
the rule of every daemon endpoint: :func:`ledgerbox._core.endpoint.needs_token`).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ledgerbox._core.database_url import check_database_url
from ledgerbox._core.endpoint import DEFAULT_HOST, check_port, needs_token
from ledgerbox._core.errors import ConfigurationError
from ledgerbox._core.identifiers import check_service_names
from ledgerbox._core.kafka import KafkaSettings
from ledgerbox._core.redaction import Secret

__all__ = ["DEFAULT_PORT", "ConsoleConfig", "ServiceTarget", "load_services_file"]

#: Port of ``ledgerbox console`` unless ``--port`` says otherwise.
DEFAULT_PORT = 8090

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_SERVICE_KEYS = frozenset(
    {
        "name",
        "database_url",
        "database_url_env",
        "schema",
        "outbox_table",
        "inbox_table",
        "shard_count",
        "groups",
        "dlq_topics",
        "relay_metrics",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceTarget:
    """One service of the console: its database (outbox, relay and inbox tables), the
    consumer groups and dead-letter topics shown for it, where its relays serve metrics.

    Parameters
    ----------
    name : str
        Shown on the page and in the action URLs: letters, digits, ``_ . -`` (1..63).
    database_url : Secret | str
        SQLAlchemy URL of the service's database (``postgresql+psycopg://...``); never shown.
    schema : str | None
        Schema of the ledgerbox tables (``None``: the search path); a SQL identifier.
    outbox_table, inbox_table : str
        Table names (defaults ``outbox``, ``inbox``); SQL identifiers.
    shard_count : int
        The relays' ``shard_count`` (default 64, 1..4096): which lease rows make the status.
    groups : Sequence[str]
        Consumer groups whose lag per partition is shown (empty: no lag section).
    dlq_topics : Sequence[str]
        Dead-letter topics whose records are listed (``<topic>.dlq``; empty: no DLQ section).
    relay_metrics : Sequence[str]
        ``http(s)://host:port/metrics`` of the service's relays: the publish rate is the change
        of their ``ledgerbox_relay_published_total`` between two page loads (empty: not shown).

    Raises
    ------
    ledgerbox.ConfigurationError
        A bad name, table name, shard count or metrics URL, or a database URL that can
        never connect (not PostgreSQL, a port outside 1..65535: the daemons' check;
        ``.setting`` names it).
    """

    name: str
    database_url: Secret | str = field(repr=False)
    schema: str | None = None
    outbox_table: str = "outbox"
    inbox_table: str = "inbox"
    shard_count: int = 64
    groups: Sequence[str] = ()
    dlq_topics: Sequence[str] = ()
    relay_metrics: Sequence[str] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.database_url, Secret):
            object.__setattr__(self, "database_url", Secret(self.database_url))
        if not _NAME.match(self.name or ""):
            raise ConfigurationError(
                f"service name {self.name!r} must be 1..63 letters, digits, '_', '.' or '-'",
                setting="service_name",
            )
        if not self.url:
            raise ConfigurationError(
                f"service {self.name}: no database URL", setting="database_url"
            )
        try:  # the daemons' check, at start: a URL that can never connect is refused
            check_database_url(self.url, reader="sqlalchemy")
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"service {self.name}: {exc}", setting="database_url"
            ) from None
        check_service_names(self.outbox_table, self.inbox_table, self.schema)
        if not 1 <= self.shard_count <= 4096:
            raise ConfigurationError(
                f"service {self.name}: shard_count must be in 1..4096 (got {self.shard_count})",
                setting="shard_count",
            )
        for name in ("groups", "dlq_topics", "relay_metrics"):
            values = tuple(str(v).strip() for v in getattr(self, name) if str(v).strip())
            object.__setattr__(self, name, values)
        for url in self.relay_metrics:
            if not _metrics_url(url):
                raise ConfigurationError(
                    f"service {self.name}: relay_metrics {url!r} must be an "
                    "http(s)://host[:port]/metrics URL (a port in 1..65535)",
                    setting="relay_metrics",
                )

    @property
    def url(self) -> str:
        """The database URL (revealed: for the database driver only, never print it)."""
        assert isinstance(self.database_url, Secret)
        return self.database_url.reveal()


def _metrics_url(url: str) -> bool:
    # An http(s) URL with a host and, if any, a port in 1..65535 (urllib raises ValueError
    # for a port it cannot read or above 65535).
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port != 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsoleConfig:
    """The console's settings.

    Parameters
    ----------
    services : Sequence[ServiceTarget]
        At least one; names unique.
    kafka : KafkaSettings | None
        For the DLQ records and the consumer lag (``None``: those sections say "no Kafka
        settings").
    host : str
        Address to listen on (default ``127.0.0.1``). Any other than a loopback address needs
        ``token``.
    port : int
        TCP port (default 8090; 0: any free port, for tests).
    token : Secret | str | None
        When set, every request must carry it (``Authorization: Bearer <token>``, or the
        cookie the login form sets). Required when ``host`` is not a loopback address.
    allowed_hosts : Sequence[str]
        Extra ``Host`` header values accepted (besides the bound address, ``localhost`` and
        ``127.0.0.1``), e.g. the name behind which a proxy serves the console.

    Raises
    ------
    ledgerbox.ConfigurationError
        No service, duplicate names, a bad port, or a non-loopback host without a token
        (``.setting`` is ``"token"``).
    """

    services: Sequence[ServiceTarget]
    kafka: KafkaSettings | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    token: Secret | str | None = field(default=None, repr=False)
    allowed_hosts: Sequence[str] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "services", tuple(self.services))
        if self.token is not None and not isinstance(self.token, Secret):
            object.__setattr__(self, "token", Secret(self.token))
        if not self.services:
            raise ConfigurationError(
                "no service to show: give --database-url or --services-file",
                setting="database_url",
            )
        names = [s.name for s in self.services]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigurationError(
                f"service names must be unique ({', '.join(dup)} twice)", setting="services_file"
            )
        check_port(self.port, "port", zero="any free port")
        if needs_token(self.host) and not self.token_value:
            raise ConfigurationError(
                f"the console on {self.host} (not a loopback address) requires a token "
                "(or listen on 127.0.0.1)",
                setting="token",
            )
        if self.token_value is not None and len(self.token_value) < 16:
            raise ConfigurationError("token must be at least 16 characters", setting="token")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))

    @property
    def token_value(self) -> str | None:
        """The token (revealed, for comparison only), or ``None``."""
        return self.token.reveal() if isinstance(self.token, Secret) else None

    def service(self, name: str) -> ServiceTarget | None:
        """The service called ``name``, or ``None``."""
        return next((s for s in self.services if s.name == name), None)


def load_services_file(
    path: str | Path, environ: Mapping[str, str] | None = None
) -> list[ServiceTarget]:
    """The services of a TOML file: one ``[[service]]`` table each, with the keys of
    :class:`ServiceTarget`; ``database_url_env = "NAME"`` reads the URL from that variable
    instead (keeps passwords out of the file). Example in docs/console.md.

    Raises
    ------
    ledgerbox.ConfigurationError
        The file cannot be read or parsed, a key is unknown, a value has the wrong type or a
        named variable is unset (``.setting`` is ``"services_file"`` or the field).
    """
    env = os.environ if environ is None else environ
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigurationError(
            f"services file {path} cannot be read ({exc.strerror or type(exc).__name__})",
            setting="services_file",
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(
            f"services file {path} is not valid TOML ({exc})", setting="services_file"
        ) from None
    tables = data.get("service")
    if not isinstance(tables, list) or not tables:
        raise ConfigurationError(
            f"services file {path} has no [[service]] table", setting="services_file"
        )
    return [_service(path, i, t, env) for i, t in enumerate(tables, 1)]


def _service(path: str | Path, index: int, table: Any, env: Mapping[str, str]) -> ServiceTarget:
    # Every refusal names the file, the service (its number, and its name when it has one)
    # and the key: the value is the file's, so the fix is there, not in a flag.
    where = f"services file {path}, service {index}"
    if not isinstance(table, dict):
        raise ConfigurationError(f"{where}: not a table", setting="services_file")
    if isinstance(table.get("name"), str):
        where = f"{where} ({table['name']!r})"
    unknown = sorted(set(table) - _SERVICE_KEYS)
    if unknown:
        raise ConfigurationError(
            f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_SERVICE_KEYS))})",
            setting="services_file",
        )
    values = dict(table)
    variable = values.pop("database_url_env", None)
    if variable is not None:
        if "database_url" in values:
            raise ConfigurationError(
                f"{where}: give database_url or database_url_env, not both",
                setting="services_file",
            )
        if not env.get(str(variable)):
            raise ConfigurationError(
                f"{where}: variable {variable} (database_url_env) is not set",
                setting="services_file",
            )
        values["database_url"] = env[str(variable)]
    for key in ("groups", "dlq_topics", "relay_metrics"):
        if key in values and (
            not isinstance(values[key], list) or not all(isinstance(v, str) for v in values[key])
        ):
            raise _wrong_type(where, key, "a list of strings", values[key])
    count = values.get("shard_count", 64)
    if not isinstance(count, int) or isinstance(count, bool):
        raise _wrong_type(where, "shard_count", "an integer", count)
    for key in ("name", "database_url", "schema", "outbox_table", "inbox_table"):
        if key in values and not isinstance(values[key], str):
            raise _wrong_type(where, key, "a string", values[key])
    if "name" not in values or "database_url" not in values:
        raise ConfigurationError(
            f"{where}: name and database_url (or database_url_env) are required",
            setting="services_file",
        )
    try:
        return ServiceTarget(**values)
    except ConfigurationError as exc:  # the value is the file's: name it, not a flag
        said = str(exc).removeprefix(f"service {values['name']}: ")  # `where` names it
        raise ConfigurationError(f"{where}: {said}", setting="services_file") from None


def _wrong_type(where: str, key: str, kind: str, value: object) -> ConfigurationError:
    # Before: 'shard_count must be an integer (got 64); set --shard-count ...': the flag's
    # default, and a flag that changes nothing. A URL's value is never shown, only its type.
    shown = f"a {type(value).__name__}" if key == "database_url" else repr(value)
    return ConfigurationError(
        f"{where}: {key} must be {kind} (got {shown})", setting="services_file"
    )
