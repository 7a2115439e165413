"""How to reach and log in to Kafka: ONE settings object for every Kafka client ledgerbox
creates (the relay's producer and admin client, the consumer, its dead-letter producer, the
startup checks and the ops commands).

:class:`KafkaSettings` is validated when built (one line per problem, naming the setting)
and turns into aiokafka's keyword arguments (:meth:`KafkaSettings.client_kwargs`). Secrets
are :class:`~ledgerbox._core.redaction.Secret`: nothing here prints them.

The same settings on the command line and in the environment, for every command that talks
to Kafka (:func:`cli_settings`, read by :mod:`ledgerbox._core.settings`): flag
``--kafka-<name>``, variable ``LEDGERBOX_<COMMAND>_KAFKA_<NAME>`` and the well-known
``KAFKA_<NAME>`` shared by every command; each secret also has a ``_file`` form
(``--kafka-sasl-password-file``, ``KAFKA_SASL_PASSWORD_FILE``) whose value is read from the
file (Docker and Kubernetes secrets). :meth:`KafkaSettings.from_env` reads them in an
application (a consumer's ``module:attribute``). The guide: docs/security.md.
"""

from __future__ import annotations

import dataclasses
import re
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ledgerbox._core.errors import ConfigurationError
from ledgerbox._core.redaction import Secret

if TYPE_CHECKING:
    from aiokafka.abc import AbstractTokenProvider

    from ledgerbox._core.settings import Setting

__all__ = [
    "DEFAULT_PORT",
    "KAFKA_SETTING_NAMES",
    "SASL_MECHANISMS",
    "SECURITY_PROTOCOLS",
    "KafkaSettings",
    "SaslMechanism",
    "SecurityProtocol",
    "cli_settings",
    "parse_server",
    "resolve_kafka",
    "server_list",
]

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"]

#: Kafka's ``security.protocol`` values (Kafka documentation, "Security").
SECURITY_PROTOCOLS: tuple[str, ...] = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
#: The SASL mechanisms ledgerbox supports (aiokafka's, without GSSAPI).
SASL_MECHANISMS: tuple[str, ...] = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")


@dataclass(frozen=True, slots=True, kw_only=True)
class KafkaSettings:
    """Where Kafka is and how to log in; validated when built.

    Parameters
    ----------
    bootstrap_servers : str
        ``host:port[,host:port]``; a server without a port is on :data:`DEFAULT_PORT`
        (9092), as in every Kafka client; a malformed one is refused (:func:`parse_server`).
    security_protocol : "PLAINTEXT" | "SSL" | "SASL_PLAINTEXT" | "SASL_SSL"
        Kafka's ``security.protocol`` (default ``PLAINTEXT``). ``SSL``: TLS, optionally with
        a client certificate (mTLS); ``SASL_SSL``: TLS and a SASL login (managed Kafka:
        MSK, Confluent Cloud, Aiven); ``SASL_PLAINTEXT`` sends the login unencrypted.
    ssl_cafile : str | None
        PEM file of the CA(s) that signed the brokers' certificates; ``None``: the system's
        trusted CAs. The broker's name must match its certificate (hostname check is on).
    ssl_certfile, ssl_keyfile : str | None
        PEM client certificate and its private key, for mTLS (``ssl.client.auth=required``);
        the key may be inside ``ssl_certfile``.
    ssl_key_password : Secret | str | None
        Passphrase of an encrypted ``ssl_keyfile``.
    ssl_context : ssl.SSLContext | None
        A ready context instead of the ``ssl_*`` files (Python only).
    sasl_mechanism : "PLAIN" | "SCRAM-SHA-256" | "SCRAM-SHA-512" | "OAUTHBEARER" | None
        Required with the ``SASL_*`` protocols, refused with the others.
    sasl_username : str | None
        Login of ``PLAIN`` and ``SCRAM-*``.
    sasl_password : Secret | str | None
        Password of ``PLAIN`` and ``SCRAM-*``.
    token_provider : aiokafka.abc.AbstractTokenProvider | None
        ``OAUTHBEARER`` only: its ``async token()`` returns the current access token (cached
        and refreshed by the provider; Kafka KIP-255).

    Raises
    ------
    ledgerbox.ConfigurationError
        One line naming the setting (``.setting``: the field name) and why: an unknown
        protocol or mechanism, a SASL setting without a SASL protocol (or the reverse), a
        missing username/password/token provider, an ``ssl_*`` file that cannot be read, a
        key that does not match its certificate or passphrase. Never the value of a secret.
    """

    bootstrap_servers: str
    security_protocol: SecurityProtocol = "PLAINTEXT"
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_key_password: Secret | str | None = field(default=None, repr=False)
    ssl_context: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: Secret | str | None = field(default=None, repr=False)
    token_provider: AbstractTokenProvider | None = field(default=None, repr=False, compare=False)
    _context: ssl.SSLContext | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("ssl_key_password", "sasl_password"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Secret):
                object.__setattr__(self, name, Secret(value))
        servers = server_list(self.bootstrap_servers)
        if not servers:
            raise _bad("bootstrap_servers", "must not be empty")
        for server in servers:
            parse_server(server)  # a malformed address: refused here, once
        object.__setattr__(self, "bootstrap_servers", ",".join(servers))
        protocol = self.security_protocol
        if protocol not in SECURITY_PROTOCOLS:
            raise _bad("security_protocol", f"must be one of {', '.join(SECURITY_PROTOCOLS)}")
        self._check_sasl()
        self._check_ssl()

    def _check_sasl(self) -> None:
        sasl = self.security_protocol.startswith("SASL_")
        mechanism = self.sasl_mechanism
        if not sasl:
            for name in ("sasl_mechanism", "sasl_username", "sasl_password", "token_provider"):
                if getattr(self, name) is not None:
                    raise _bad(
                        name,
                        f"is a SASL setting but security_protocol is {self.security_protocol}: "
                        "use SASL_SSL (or SASL_PLAINTEXT)",
                    )
            return
        if mechanism is None:
            raise _bad(
                "sasl_mechanism",
                f"is required with {self.security_protocol}: {', '.join(SASL_MECHANISMS)}",
            )
        if mechanism not in SASL_MECHANISMS:
            raise _bad("sasl_mechanism", f"must be one of {', '.join(SASL_MECHANISMS)}")
        if mechanism == "OAUTHBEARER":
            if self.token_provider is None:
                raise _bad("token_provider", "is required with OAUTHBEARER")
            provider = self.token_provider
            if isinstance(provider, type) or not callable(getattr(provider, "token", None)):
                raise _bad("token_provider", "must be an aiokafka AbstractTokenProvider")
            for name in ("sasl_username", "sasl_password"):
                if getattr(self, name) is not None:
                    raise _bad(name, "is not used with OAUTHBEARER (the token provider logs in)")
            return
        if self.token_provider is not None:
            raise _bad("token_provider", f"is only used with OAUTHBEARER, not {mechanism}")
        if not self.sasl_username:
            raise _bad("sasl_username", f"is required with {mechanism}")
        if self.sasl_password is None or not self.sasl_password:
            raise _bad("sasl_password", f"is required with {mechanism}")

    def _check_ssl(self) -> None:
        tls = self.security_protocol in ("SSL", "SASL_SSL")
        files = ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_key_password")
        if not tls:
            for name in (*files, "ssl_context"):
                if getattr(self, name) is not None:
                    raise _bad(
                        name,
                        f"is a TLS setting but security_protocol is {self.security_protocol}: "
                        "use SSL or SASL_SSL",
                    )
            return
        if self.ssl_context is not None:
            for name in files:
                if getattr(self, name) is not None:
                    raise _bad(name, "cannot be combined with ssl_context")
            object.__setattr__(self, "_context", self.ssl_context)
            return
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise _bad("ssl_keyfile", "needs ssl_certfile (the client certificate)")
        if self.ssl_key_password is not None and self.ssl_certfile is None:
            raise _bad("ssl_key_password", "needs ssl_certfile and ssl_keyfile")
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise _bad(name, f"is not a readable file: {path}")
        object.__setattr__(self, "_context", self._build_context())

    def _build_context(self) -> ssl.SSLContext:
        # What aiokafka.helpers.create_ssl_context does (create_default_context: TLS 1.2+,
        # CERT_REQUIRED, hostname check, the system CAs when no CA file is given, for managed
        # Kafka with public certificates), step by step so that an error names its file,
        # and with a password callback always: OpenSSL would otherwise prompt on the terminal.
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ssl_cafile)
        except (ssl.SSLError, OSError) as exc:
            why = f"is not a PEM file of CA certificates ({_why(exc)})"
            raise _bad("ssl_cafile", why) from None
        if self.ssl_certfile is not None:
            password = self.ssl_key_password
            given = isinstance(password, Secret)

            def passphrase() -> str:
                return password.reveal() if isinstance(password, Secret) else ""

            try:
                context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile, passphrase)
            except (ssl.SSLError, OSError) as exc:
                if given:
                    why = "ssl_key_password does not open the key, or the key does not match"
                else:
                    why = "an encrypted key needs ssl_key_password; or the key does not match"
                raise _bad(
                    "ssl_keyfile" if self.ssl_keyfile else "ssl_certfile",
                    f"could not be loaded with ssl_certfile ({why}; {_why(exc)})",
                ) from None
        return context

    # -- use ------------------------------------------------------------------------------

    @property
    def tls(self) -> bool:
        """The connection is encrypted (``SSL`` or ``SASL_SSL``)."""
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def ssl(self) -> ssl.SSLContext | None:
        """The TLS context of every client (built once, when the settings were built)."""
        return self._context

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``AIOKafkaProducer``, ``AIOKafkaConsumer``,
        ``AIOKafkaAdminClient`` and ``aiokafka.conn.create_conn``: ``bootstrap_servers``,
        ``security_protocol``, ``ssl_context`` and the ``sasl_*`` ones. The password is
        revealed here, for aiokafka only: never log the result."""
        kwargs: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "security_protocol": self.security_protocol,
        }
        if self._context is not None:
            kwargs["ssl_context"] = self._context
        if self.sasl_mechanism is not None:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            if self.sasl_mechanism == "OAUTHBEARER":
                kwargs["sasl_oauth_token_provider"] = self.token_provider
            else:
                password = self.sasl_password
                assert isinstance(password, Secret)
                kwargs["sasl_plain_username"] = self.sasl_username
                kwargs["sasl_plain_password"] = password.reveal()
        return kwargs

    def describe(self) -> str:
        """One line for logs, without secrets: ``127.0.0.1:9094 (SASL_SSL, SCRAM-SHA-512 as
        'relay')``, ``k1:9092 (PLAINTEXT)``."""
        how: list[str] = [self.security_protocol]
        if self.sasl_mechanism == "OAUTHBEARER":
            how.append("OAUTHBEARER token")
        elif self.sasl_mechanism is not None:
            how.append(f"{self.sasl_mechanism} as {self.sasl_username!r}")
        if self.ssl_certfile is not None:
            how.append("client certificate")
        return f"{self.bootstrap_servers} ({', '.join(how)})"

    def hosts(self) -> list[tuple[str, int]]:
        """``(host, port)`` of each bootstrap server (:func:`parse_server`: port
        :data:`DEFAULT_PORT` when none is given)."""
        return [parse_server(item) for item in self.bootstrap_servers.split(",")]

    def with_bootstrap(self, bootstrap_servers: str) -> KafkaSettings:
        """The same login against other bootstrap servers."""
        return dataclasses.replace(self, bootstrap_servers=bootstrap_servers)

    # -- from the command line and the environment ---------------------------------------

    @classmethod
    def from_values(cls, values: Mapping[str, Any], *, bootstrap_servers: str) -> KafkaSettings:
        """The settings from a command's resolved values (keys :data:`KAFKA_SETTING_NAMES`;
        a missing key counts as unset): ``_file`` forms read, the token provider imported.

        Raises
        ------
        ledgerbox.ConfigurationError
            One line; ``.setting`` is the command's setting name (``kafka_sasl_password``).
        """
        given = {name: values.get(name) for name in KAFKA_SETTING_NAMES}
        secrets: dict[str, Secret | None] = {}
        for name in ("kafka_sasl_password", "kafka_ssl_key_password"):
            value, path = given[name], given[name + "_file"]
            if value is not None and path is not None:
                raise ConfigurationError(
                    f"{name} and {name}_file are both set: keep one", setting=name
                )
            if path is not None:
                try:
                    value = Secret.from_file(path)
                except (OSError, UnicodeDecodeError) as exc:
                    why = getattr(exc, "strerror", None) or type(exc).__name__
                    raise ConfigurationError(
                        f"{name}_file {path!r} cannot be read: {why}", setting=name + "_file"
                    ) from None
            secrets[name] = None if value is None else Secret(value)
        provider = None
        if given["kafka_oauth_token_provider"] is not None:
            provider = _import_provider(given["kafka_oauth_token_provider"])
        try:
            return cls(
                bootstrap_servers=bootstrap_servers,
                security_protocol=given["kafka_security_protocol"] or "PLAINTEXT",
                ssl_cafile=given["kafka_ssl_cafile"],
                ssl_certfile=given["kafka_ssl_certfile"],
                ssl_keyfile=given["kafka_ssl_keyfile"],
                ssl_key_password=secrets["kafka_ssl_key_password"],
                sasl_mechanism=given["kafka_sasl_mechanism"],
                sasl_username=given["kafka_sasl_username"],
                sasl_password=secrets["kafka_sasl_password"],
                token_provider=provider,
            )
        except ConfigurationError as exc:
            raise ConfigurationError(str(exc), setting=_CLI_NAME.get(exc.setting or "")) from None

    @classmethod
    def from_env(
        cls, command: str = "consumer", *, bootstrap_servers: str | None = None
    ) -> KafkaSettings:
        """The settings from the environment variables of ``ledgerbox <command>``
        (``LEDGERBOX_CONSUMER_KAFKA_SASL_PASSWORD``, then ``KAFKA_SASL_PASSWORD``, ...), as the
        command itself reads them: for an application that builds its own config, such as
        the ``module:attribute`` of ``ledgerbox consumer run``.

        Parameters
        ----------
        command : str
            ``"consumer"`` or ``"relay"``: the variables' prefix.
        bootstrap_servers : str | None
            ``None``: ``LEDGERBOX_<COMMAND>_KAFKA_BOOTSTRAP_SERVERS`` or
            ``KAFKA_BOOTSTRAP_SERVERS``.

        Raises
        ------
        ledgerbox.ConfigurationError
            One line naming the setting and its variables (never a secret's value).
        """
        from ledgerbox._core.settings import CommandSettings, Setting, SettingsError

        bootstrap = Setting(
            "kafka_bootstrap_servers",
            str,
            required=bootstrap_servers is None,
            well_known=("KAFKA_BOOTSTRAP_SERVERS",),
            label="Kafka bootstrap servers",
        )
        settings = CommandSettings(command, [bootstrap, *cli_settings()])
        names = [bootstrap.name, *KAFKA_SETTING_NAMES]
        try:
            values = settings.resolve(names, {})
            return cls.from_values(
                values, bootstrap_servers=bootstrap_servers or values[bootstrap.name]
            )
        except (SettingsError, ConfigurationError) as exc:
            where = ""
            if exc.setting in settings.settings:
                where = "; set " + " or ".join(settings.env_names(exc.setting))
            raise ConfigurationError(f"{exc}{where}", setting=exc.setting) from None


#: KafkaSettings field -> the command-line setting that sets it.
_CLI_NAME = {
    "bootstrap_servers": "kafka_bootstrap_servers",
    "security_protocol": "kafka_security_protocol",
    "ssl_cafile": "kafka_ssl_cafile",
    "ssl_certfile": "kafka_ssl_certfile",
    "ssl_keyfile": "kafka_ssl_keyfile",
    "ssl_key_password": "kafka_ssl_key_password",
    "ssl_context": "kafka_ssl_cafile",
    "sasl_mechanism": "kafka_sasl_mechanism",
    "sasl_username": "kafka_sasl_username",
    "sasl_password": "kafka_sasl_password",
    "token_provider": "kafka_oauth_token_provider",
}

#: The command-line settings of :func:`cli_settings`, in order.
KAFKA_SETTING_NAMES: tuple[str, ...] = (
    "kafka_security_protocol",
    "kafka_ssl_cafile",
    "kafka_ssl_certfile",
    "kafka_ssl_keyfile",
    "kafka_ssl_key_password",
    "kafka_ssl_key_password_file",
    "kafka_sasl_mechanism",
    "kafka_sasl_username",
    "kafka_sasl_password",
    "kafka_sasl_password_file",
    "kafka_oauth_token_provider",
)


def cli_settings() -> list[Setting]:
    """The Kafka security settings of a command (:data:`KAFKA_SETTING_NAMES`), each with
    its well-known unprefixed variable (``KAFKA_SECURITY_PROTOCOL``...); the passwords are
    secret (their values are never printed). ``kafka_bootstrap_servers`` is the command's
    own setting."""
    from ledgerbox._core.settings import Setting

    def item(name: str, help_: str, **more: Any) -> Setting:
        return Setting(name, str, help=help_, well_known=(name.upper(),), **more)

    return [
        item(
            "kafka_security_protocol",
            "Kafka security.protocol",
            default="PLAINTEXT",
            choices=SECURITY_PROTOCOLS,
        ),
        item("kafka_ssl_cafile", "PEM file of the brokers' CA (unset: the system's CAs)"),
        item("kafka_ssl_certfile", "PEM client certificate, for mTLS"),
        item("kafka_ssl_keyfile", "PEM private key of the client certificate"),
        item("kafka_ssl_key_password", "Passphrase of an encrypted key file", secret=True),
        item("kafka_ssl_key_password_file", "File holding the key passphrase"),
        item("kafka_sasl_mechanism", "SASL mechanism (SASL_* protocols)", choices=SASL_MECHANISMS),
        item("kafka_sasl_username", "SASL username (PLAIN, SCRAM-*)"),
        item("kafka_sasl_password", "SASL password (PLAIN, SCRAM-*)", secret=True),
        item("kafka_sasl_password_file", "File holding the SASL password"),
        item(
            "kafka_oauth_token_provider",
            "module:attribute of an aiokafka AbstractTokenProvider (or of a no-argument "
            "factory of one), for OAUTHBEARER",
        ),
    ]


def resolve_kafka(kafka: KafkaSettings | None, bootstrap_servers: str | None) -> KafkaSettings:
    """The Kafka settings of a daemon's config that has both a ``kafka`` object and the plain
    ``kafka_bootstrap_servers`` string (the relay's and the consumer's configs).

    Returns ``kafka`` when given, else plaintext settings for ``bootstrap_servers``.

    Raises
    ------
    ConfigurationError
        ``setting="kafka_bootstrap_servers"``: neither is given (an unset variable must never
        mean a default broker: issue 12), ``bootstrap_servers`` names no ``host:port``, or
        both are given and name different servers.
    """
    if kafka is None:
        if not bootstrap_servers:
            raise ConfigurationError(
                "kafka_bootstrap_servers must not be empty (or give kafka=KafkaSettings(...))",
                setting="kafka_bootstrap_servers",
            )
        try:
            return KafkaSettings(bootstrap_servers=bootstrap_servers)
        except ConfigurationError as exc:
            raise ConfigurationError(str(exc), setting="kafka_bootstrap_servers") from None
    if server_list(bootstrap_servers) not in ([], server_list(kafka.bootstrap_servers)):
        raise ConfigurationError(
            "kafka_bootstrap_servers and kafka.bootstrap_servers differ: give one",
            setting="kafka_bootstrap_servers",
        )
    return kafka


def _import_provider(reference: str) -> AbstractTokenProvider:
    from ledgerbox._core.references import first_line, import_reference

    setting = "kafka_oauth_token_provider"
    target: Any = import_reference(reference, setting)
    if isinstance(target, type) or (
        not callable(getattr(target, "token", None)) and callable(target)
    ):
        try:
            target = target()  # a class or a factory
        except Exception as exc:
            raise ConfigurationError(
                f"kafka_oauth_token_provider {reference!r}: building the provider raised "
                f"{first_line(exc)}",
                setting=setting,
            ) from None
    if not callable(getattr(target, "token", None)):
        raise ConfigurationError(
            f"kafka_oauth_token_provider {reference!r} is not an AbstractTokenProvider "
            "(no async token() method)",
            setting=setting,
        )
    provider: AbstractTokenProvider = target
    return provider


def server_list(bootstrap_servers: str | None) -> list[str]:
    """The servers of a ``host:port[,host:port]`` text, stripped; empty entries (a comma at
    either end, ``,,``) are ignored by every command and config, as by the Kafka clients."""
    return [s.strip() for s in (bootstrap_servers or "").split(",") if s.strip()]


#: The port of a bootstrap server given without one (``kafka1`` is ``kafka1:9092``), as
#: aiokafka and the other Kafka clients default it.
DEFAULT_PORT = 9092

_HOST = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


def parse_server(server: str) -> tuple[str, int]:
    """``(host, port)`` of one bootstrap server, by aiokafka's rules: ``host``, ``host:port``,
    ``[ipv6]``, ``[ipv6]:port`` or a bare IPv6 literal; no port means :data:`DEFAULT_PORT`.

    Raises
    ------
    ledgerbox.ConfigurationError
        ``setting="bootstrap_servers"``: not one of those forms (``bogus:host:x``, a URL), a
        host name with characters no host name has, or a port that is not an integer in
        1..65535. (Before, aiokafka raised ``ValueError`` or ``OverflowError`` from inside
        every command and the relay stayed up reporting "down".)
    """
    item = server.strip()
    host, port = item, str(DEFAULT_PORT)
    if item.startswith("["):
        inside, closed, rest = item[1:].partition("]")
        host = inside
        if not closed or not _ipv6(inside) or (rest and not rest.startswith(":")):
            raise _bad_server(server)
        if rest:
            port = rest[1:]
    elif ":" in item and not _ipv6(item):
        host, _, port = item.rpartition(":")
        if ":" in host:
            raise _bad_server(server)
    if not (_ipv6(host) or _HOST.match(host)):
        raise _bad_server(server)
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise _bad_server(server)
    return host, int(port)


def _ipv6(text: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6, text)
    except (OSError, ValueError):
        return False
    return True


def _bad_server(server: str) -> ConfigurationError:
    return _bad(
        "bootstrap_servers",
        f"has {server.strip()!r}, not host[:port] (a port is an integer in 1..65535, "
        f"{DEFAULT_PORT} when left out; IPv6: [::1]:9092)",
    )


def _why(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__


def _bad(setting: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"kafka {setting} {why}", setting=setting)
