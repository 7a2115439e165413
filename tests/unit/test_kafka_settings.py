"""KafkaSettings (ledgerbox._core.kafka): validated when built with one line naming the
setting, aiokafka's keyword arguments for each security protocol, secrets that never print,
the ``--kafka-*`` flags / ``KAFKA_*`` variables / ``_file`` forms of the commands, and the
token provider hook (docs/security.md)."""

from __future__ import annotations

import os
import pickle
import ssl
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ledgerbox import ConfigurationError
from ledgerbox._core import settings as settings_module
from ledgerbox._core.kafka import KAFKA_SETTING_NAMES, KafkaSettings
from ledgerbox._core.redaction import Secret
from ledgerbox.inbox import ConsumerConfig
from ledgerbox.inbox import _cli as consumer_cli
from ledgerbox.relay import RelayConfig, RelayHooks
from ledgerbox.relay import _cli as relay_cli

PASSWORD = "s3cret-sasl-Pa55"
KEY_PASSWORD = "k3y-passphrase-77"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA and a client certificate with an encrypted key (openssl, as services.sh)."""
    d = tmp_path_factory.mktemp("pki")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", "/CN=test CA",
    )  # fmt: skip
    run(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "plain.key", "-out", "c.csr",
        "-subj", "/CN=client",
    )  # fmt: skip
    run(
        "x509", "-req", "-in", "c.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-out", "client.pem",
    )  # fmt: skip
    (d / "pw").write_text(KEY_PASSWORD + "\n")
    run(
        "pkcs8", "-topk8", "-v2", "aes-256-cbc", "-in", "plain.key", "-out", "client.key",
        "-passout", f"pass:{KEY_PASSWORD}",
    )  # fmt: skip
    (d / "garbage.pem").write_text("not a certificate\n")
    return {
        "ca": str(d / "ca.pem"),
        "cert": str(d / "client.pem"),
        "key": str(d / "client.key"),
        "plain_key": str(d / "plain.key"),
        "pw_file": str(d / "pw"),
        "garbage": str(d / "garbage.pem"),
    }


class Tokens:
    """A token provider for OAUTHBEARER (aiokafka's AbstractTokenProvider protocol)."""

    async def token(self) -> str:
        return "header.claims."


SCRAM: dict[str, Any] = {
    "bootstrap_servers": "k1:9094,k2:9094",
    "security_protocol": "SASL_SSL",
    "sasl_mechanism": "SCRAM-SHA-512",
    "sasl_username": "relay",
    "sasl_password": PASSWORD,
}


# -- validation ---------------------------------------------------------------------------


def test_plaintext_is_the_default_and_needs_only_the_servers() -> None:
    kafka = KafkaSettings(bootstrap_servers=" k1:9092 , k2:9092 ")
    assert kafka.bootstrap_servers == "k1:9092,k2:9092"
    assert kafka.client_kwargs() == {
        "bootstrap_servers": "k1:9092,k2:9092",
        "security_protocol": "PLAINTEXT",
    }
    assert kafka.ssl is None and not kafka.tls
    assert kafka.hosts() == [("k1", 9092), ("k2", 9092)]


def test_sasl_ssl_with_scram_uses_the_system_cas_and_passes_the_login() -> None:
    kafka = KafkaSettings(**SCRAM)
    kwargs = kafka.client_kwargs()
    assert kwargs["security_protocol"] == "SASL_SSL"
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kwargs["sasl_plain_username"] == "relay"
    assert kwargs["sasl_plain_password"] == PASSWORD
    context = kwargs["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname
    assert context.cert_store_stats()["x509_ca"] > 0 or os.environ.get("SSL_CERT_FILE")
    assert "sasl_oauth_token_provider" not in kwargs


def test_mtls_loads_the_client_certificate_and_its_encrypted_key(pki: dict[str, str]) -> None:
    kafka = KafkaSettings(
        bootstrap_servers="k:9093",
        security_protocol="SSL",
        ssl_cafile=pki["ca"],
        ssl_certfile=pki["cert"],
        ssl_keyfile=pki["key"],
        ssl_key_password=KEY_PASSWORD,
    )
    kwargs = kafka.client_kwargs()
    assert isinstance(kwargs["ssl_context"], ssl.SSLContext)
    assert "sasl_mechanism" not in kwargs
    assert "client certificate" in kafka.describe()


def test_oauthbearer_passes_the_token_provider() -> None:
    provider = Tokens()
    kafka = KafkaSettings(
        bootstrap_servers="k:9094",
        security_protocol="SASL_SSL",
        sasl_mechanism="OAUTHBEARER",
        token_provider=provider,  # type: ignore[arg-type]
    )
    kwargs = kafka.client_kwargs()
    assert kwargs["sasl_oauth_token_provider"] is provider
    assert "sasl_plain_password" not in kwargs
    assert kafka.describe() == "k:9094 (SASL_SSL, OAUTHBEARER token)"


@pytest.mark.parametrize(
    ("given", "setting", "says"),
    [
        ({"bootstrap_servers": " , "}, "bootstrap_servers", "must not be empty"),
        ({"security_protocol": "TLS"}, "security_protocol", "must be one of PLAINTEXT"),
        ({"sasl_mechanism": "PLAIN"}, "sasl_mechanism", "but security_protocol is PLAINTEXT"),
        ({"sasl_password": PASSWORD}, "sasl_password", "use SASL_SSL"),
        ({"ssl_cafile": "/etc/hosts"}, "ssl_cafile", "is a TLS setting"),
        ({"security_protocol": "SASL_SSL"}, "sasl_mechanism", "is required with SASL_SSL"),
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI"},
            "sasl_mechanism",
            "must be one of PLAIN",
        ),
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256"},
            "sasl_username",
            "is required with SCRAM-SHA-256",
        ),
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u"},
            "sasl_password",
            "is required with PLAIN",
        ),
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"},
            "token_provider",
            "is required with OAUTHBEARER",
        ),
        (
            {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "OAUTHBEARER",
                "token_provider": object(),
            },
            "token_provider",
            "AbstractTokenProvider",
        ),
        (
            {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "OAUTHBEARER",
                "token_provider": Tokens(),
                "sasl_password": PASSWORD,
            },
            "sasl_password",
            "is not used with OAUTHBEARER",
        ),
        ({"security_protocol": "SSL", "ssl_cafile": "/no/such/ca.pem"}, "ssl_cafile", "/no/such"),
        ({"security_protocol": "SSL", "ssl_keyfile": "/etc/hosts"}, "ssl_keyfile", "needs"),
    ],
)
def test_each_invalid_combination_is_one_line_naming_the_setting(
    given: dict[str, Any], setting: str, says: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        KafkaSettings(**{"bootstrap_servers": "k:9092", **given})
    assert caught.value.setting == setting
    message = str(caught.value)
    assert message.startswith(f"kafka {setting} ") and says in message, message
    assert "\n" not in message and PASSWORD not in message


def test_a_wrong_key_passphrase_or_an_unreadable_pem_fails_when_built(
    pki: dict[str, str],
) -> None:
    base: dict[str, Any] = {"bootstrap_servers": "k:9093", "security_protocol": "SSL"}
    with pytest.raises(ConfigurationError) as caught:
        KafkaSettings(
            **base,
            ssl_certfile=pki["cert"],
            ssl_keyfile=pki["key"],
            ssl_key_password="not-the-passphrase",
        )
    assert caught.value.setting == "ssl_keyfile"
    assert "ssl_key_password does not open the key" in str(caught.value)
    assert "not-the-passphrase" not in str(caught.value)
    # An encrypted key without its passphrase fails here, never with a terminal prompt.
    with pytest.raises(ConfigurationError, match="an encrypted key needs ssl_key_password"):
        KafkaSettings(**base, ssl_certfile=pki["cert"], ssl_keyfile=pki["key"])
    with pytest.raises(ConfigurationError, match="ssl_cafile is not a PEM file"):
        KafkaSettings(**base, ssl_cafile=pki["garbage"])


def test_secrets_never_print() -> None:
    kafka = KafkaSettings(**SCRAM)
    assert isinstance(kafka.sasl_password, Secret)
    for text in (repr(kafka), str(kafka), f"{kafka}", kafka.describe(), repr(kafka.sasl_password)):
        assert PASSWORD not in text
    assert str(kafka.sasl_password) == "***" and f"{kafka.sasl_password}" == "***"
    assert kafka.sasl_password == Secret(PASSWORD) and kafka == KafkaSettings(**SCRAM)
    with pytest.raises(TypeError):
        pickle.dumps(kafka.sasl_password)


# -- configs --------------------------------------------------------------------------------


def test_relay_and_consumer_configs_take_the_settings_or_the_short_form() -> None:
    url = "postgresql+psycopg://u:p@db/app"
    short = RelayConfig(database_url=url, kafka_bootstrap_servers="k:9092")
    assert short.kafka_settings == KafkaSettings(bootstrap_servers="k:9092")
    secured = RelayConfig(database_url=url, kafka=KafkaSettings(**SCRAM))
    assert secured.kafka_settings.security_protocol == "SASL_SSL"
    with pytest.raises(ConfigurationError, match="differ") as caught:
        RelayConfig(database_url=url, kafka_bootstrap_servers="x:1", kafka=KafkaSettings(**SCRAM))
    assert caught.value.setting == "kafka_bootstrap_servers"
    with pytest.raises(ConfigurationError) as caught:
        RelayConfig(database_url=url)
    assert caught.value.setting == "kafka_bootstrap_servers"
    consumer = ConsumerConfig(
        group_id="g", topics=["t"], database_url=url, kafka=KafkaSettings(**SCRAM)
    )
    assert consumer.kafka_settings.sasl_username == "relay"
    with pytest.raises(ConfigurationError):
        ConsumerConfig(group_id="g", topics=["t"], database_url=url)


@pytest.mark.parametrize("servers", ["k:9092,", ",k:9092", "k:9092,,", " k:9092 , "])
def test_empty_entries_of_the_bootstrap_servers_are_ignored_by_every_config(servers: str) -> None:
    # Before: the relay's CLI, which gives both kafka= and kafka_bootstrap_servers=, refused
    # 'k:9092,' with "kafka_bootstrap_servers and kafka.bootstrap_servers differ: give one",
    # while the consumer commands accepted it (KafkaSettings ignores empty entries).
    url = "postgresql+psycopg://u:p@db/app"
    kafka = KafkaSettings(bootstrap_servers=servers)
    assert kafka.bootstrap_servers == "k:9092"
    for given in ({"kafka": kafka}, {}):
        relay = RelayConfig(database_url=url, kafka_bootstrap_servers=servers, **given)
        consumer = ConsumerConfig(
            group_id="g", topics=["t"], database_url=url, kafka_bootstrap_servers=servers, **given
        )
        assert relay.kafka_settings.bootstrap_servers == "k:9092"
        assert consumer.kafka_settings.bootstrap_servers == "k:9092"
    with pytest.raises(ConfigurationError, match="differ"):
        RelayConfig(database_url=url, kafka_bootstrap_servers="k:9092,x:1", kafka=kafka)


# -- the command line -----------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith(("LEDGERBOX_", "KAFKA_")) or name in ("DATABASE_URL", "REDIS_URL"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(settings_module, "_WARNED", set())
    yield


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> list[RelayConfig]:
    seen: list[RelayConfig] = []

    async def fake_run(config: RelayConfig, hooks: RelayHooks | None) -> None:
        seen.append(config)

    monkeypatch.setattr(relay_cli, "_run", fake_run)
    return seen


def _relay(*args: str, env: dict[str, str] | None = None) -> Any:
    base = ["run", "--database-url", "postgresql://u:p@db/app"]
    return CliRunner(env=env).invoke(relay_cli.app, [*base, *args])


def test_every_command_that_talks_to_kafka_has_every_kafka_setting() -> None:
    for settings in (relay_cli.RELAY_SETTINGS, consumer_cli.CONSUMER_SETTINGS):
        for name in KAFKA_SETTING_NAMES:
            setting = settings.settings[name]
            assert settings.env_names(name)[-1] == name.upper(), name  # KAFKA_SASL_PASSWORD
            assert setting.secret == name.endswith("_password"), name
    relay = relay_cli.RELAY_SETTINGS
    assert relay.env_names("kafka_sasl_password_file") == (
        "LEDGERBOX_RELAY_KAFKA_SASL_PASSWORD_FILE",
        "KAFKA_SASL_PASSWORD_FILE",
    )


def test_relay_flags_build_the_kafka_settings(
    captured: list[RelayConfig], pki: dict[str, str]
) -> None:
    result = _relay(
        "--kafka-bootstrap-servers", "k:9094",
        "--kafka-security-protocol", "SASL_SSL",
        "--kafka-ssl-cafile", pki["ca"],
        "--kafka-sasl-mechanism", "SCRAM-SHA-512",
        "--kafka-sasl-username", "relay",
        "--kafka-sasl-password", PASSWORD,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    (config,) = captured
    kafka = config.kafka_settings
    assert (kafka.security_protocol, kafka.sasl_mechanism, kafka.sasl_username) == (
        "SASL_SSL",
        "SCRAM-SHA-512",
        "relay",
    )
    assert kafka.sasl_password == Secret(PASSWORD) and kafka.ssl_cafile == pki["ca"]


def test_well_known_variables_and_file_forms_set_the_secrets(
    captured: list[RelayConfig], pki: dict[str, str], tmp_path: Path
) -> None:
    secret_file = tmp_path / "sasl"
    secret_file.write_text(PASSWORD + "\n")  # a Docker secret ends with a newline
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": "k:9093",
        "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "KAFKA_SSL_CAFILE": pki["ca"],
        "KAFKA_SSL_CERTFILE": pki["cert"],
        "KAFKA_SSL_KEYFILE": pki["key"],
        "KAFKA_SSL_KEY_PASSWORD_FILE": pki["pw_file"],
        "KAFKA_SASL_MECHANISM": "PLAIN",
        "KAFKA_SASL_USERNAME": "well-known",
        "LEDGERBOX_RELAY_KAFKA_SASL_USERNAME": "prefixed",
        "KAFKA_SASL_PASSWORD_FILE": str(secret_file),
    }
    result = _relay(env=env)
    assert result.exit_code == 0, result.stderr
    kafka = captured[0].kafka_settings
    assert kafka.sasl_username == "prefixed"  # the command's own variable wins
    assert kafka.sasl_password == Secret(PASSWORD)
    assert kafka.ssl_key_password == Secret(KEY_PASSWORD)


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
             "KAFKA_SASL_USERNAME": "u"},
            "ledgerbox relay: kafka sasl_password is required with SCRAM-SHA-512; set "
            "--kafka-sasl-password, LEDGERBOX_RELAY_KAFKA_SASL_PASSWORD or KAFKA_SASL_PASSWORD",
        ),
        (
            {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "PLAIN",
             "KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": PASSWORD,
             "KAFKA_SASL_PASSWORD_FILE": "/run/secrets/kafka"},
            "ledgerbox relay: kafka_sasl_password and kafka_sasl_password_file are both set: "
            "keep one; set --kafka-sasl-password, LEDGERBOX_RELAY_KAFKA_SASL_PASSWORD or "
            "KAFKA_SASL_PASSWORD",
        ),
        (
            {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "PLAIN",
             "KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD_FILE": "/no/such/secret"},
            "ledgerbox relay: kafka_sasl_password_file '/no/such/secret' cannot be read: No such "
            "file or directory; set --kafka-sasl-password-file, "
            "LEDGERBOX_RELAY_KAFKA_SASL_PASSWORD_FILE or KAFKA_SASL_PASSWORD_FILE",
        ),
        (
            {"KAFKA_SASL_PASSWORD": PASSWORD},
            "ledgerbox relay: kafka sasl_password is a SASL setting but security_protocol is "
            "PLAINTEXT: use SASL_SSL (or SASL_PLAINTEXT); set --kafka-sasl-password, "
            "LEDGERBOX_RELAY_KAFKA_SASL_PASSWORD or KAFKA_SASL_PASSWORD",
        ),
    ],
)  # fmt: skip
def test_a_wrong_kafka_setting_exits_2_with_one_line_and_never_the_password(
    captured: list[RelayConfig], env: dict[str, str], line: str
) -> None:
    result = _relay(env={"KAFKA_BOOTSTRAP_SERVERS": "k:9094", **env})
    assert result.exit_code == 2 and not captured
    assert result.stderr.splitlines() == [line]
    assert PASSWORD not in result.output


def test_the_token_provider_hook_is_imported_at_start(
    captured: list[RelayConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_tokens.py").write_text(
        textwrap.dedent(
            """
            class Provider:
                async def token(self) -> str:
                    return "a.b."

            instance = Provider()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": "k:9094",
        "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "KAFKA_SASL_MECHANISM": "OAUTHBEARER",
    }
    for reference in ("my_tokens:instance", "my_tokens:Provider"):
        result = _relay("--kafka-oauth-token-provider", reference, env=env)
        assert result.exit_code == 0, result.stderr
        assert type(captured[-1].kafka_settings.token_provider).__name__ == "Provider"
    result = _relay("--kafka-oauth-token-provider", "my_tokens:nothing", env=env)
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        "ledgerbox relay: kafka_oauth_token_provider 'my_tokens:nothing' cannot be imported "
        "(AttributeError"
    ), line
    del sys.modules["my_tokens"]


def test_from_env_reads_the_consumer_variables(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret_file = tmp_path / "sasl"
    secret_file.write_text(PASSWORD)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "k:9094")
    monkeypatch.setenv("LEDGERBOX_CONSUMER_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("KAFKA_SASL_MECHANISM", "SCRAM-SHA-256")
    monkeypatch.setenv("KAFKA_SASL_USERNAME", "payments")
    monkeypatch.setenv("KAFKA_SASL_PASSWORD_FILE", str(secret_file))
    kafka = KafkaSettings.from_env("consumer")
    assert kafka.bootstrap_servers == "k:9094" and kafka.sasl_mechanism == "SCRAM-SHA-256"
    assert kafka.sasl_password == Secret(PASSWORD)
    monkeypatch.delenv("KAFKA_SASL_PASSWORD_FILE")
    with pytest.raises(ConfigurationError) as caught:
        KafkaSettings.from_env("consumer")
    assert str(caught.value) == (
        "kafka sasl_password is required with SCRAM-SHA-256; set "
        "LEDGERBOX_CONSUMER_KAFKA_SASL_PASSWORD or KAFKA_SASL_PASSWORD"
    )
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS")
    with pytest.raises(ConfigurationError, match="no Kafka bootstrap servers; set"):
        KafkaSettings.from_env("consumer")


def test_consumer_check_takes_the_kafka_flags(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[ConsumerConfig] = []

    async def fake_check(config: ConsumerConfig, **_: Any) -> Any:
        seen.append(config)
        from ledgerbox.inbox._checks import CheckResult

        return CheckResult("ok")

    monkeypatch.setattr(consumer_cli, "check_consumer", fake_check)
    result = CliRunner().invoke(
        consumer_cli.app,
        [
            "check", "--database-url", "postgresql+psycopg://u:p@db/app",
            "--kafka-bootstrap-servers", "k:9094", "--kafka-security-protocol", "SASL_SSL",
            "--kafka-sasl-mechanism", "SCRAM-SHA-512", "--kafka-sasl-username", "c",
            "--kafka-sasl-password", PASSWORD,
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert seen[0].kafka_settings.sasl_password == Secret(PASSWORD)


@pytest.mark.parametrize(
    ("servers", "hosts"),
    [
        ("k1:9094,k2:9095", [("k1", 9094), ("k2", 9095)]),
        ("k1", [("k1", 9092)]),  # no port: 9092, as aiokafka and every Kafka client
        ("[::1]:9093,[::1],::1", [("::1", 9093), ("::1", 9092), ("::1", 9092)]),
        ("10.0.0.7:1, b_2.example-net:65535", [("10.0.0.7", 1), ("b_2.example-net", 65535)]),
    ],
)  # fmt: skip
def test_bootstrap_servers_are_read_by_the_kafka_clients_rules(
    servers: str, hosts: list[tuple[str, int]]
) -> None:
    assert KafkaSettings(bootstrap_servers=servers).hosts() == hosts


@pytest.mark.parametrize(
    "servers",
    ["127.0.0.1:70000", "k:0", "bogus:host:x", "k:x", "k:", "http://k:9092", "k1:9092,k 2:9092",
     "[::1", "[zz]:9092", "[::1]x", "-k:9092"],
)  # fmt: skip
def test_a_malformed_bootstrap_server_is_refused_when_the_settings_are_built(servers: str) -> None:
    # Before: accepted here; aiokafka then raised OverflowError/ValueError inside every
    # command (a traceback) and `relay run` stayed up reporting "down".
    with pytest.raises(ConfigurationError, match=r"not host\[:port\]") as info:
        KafkaSettings(bootstrap_servers=servers)
    assert info.value.setting == "bootstrap_servers"
    with pytest.raises(ConfigurationError, match=r"not host\[:port\]") as info:
        RelayConfig(database_url="postgresql://h/db", kafka_bootstrap_servers=servers)
    assert info.value.setting == "kafka_bootstrap_servers"
