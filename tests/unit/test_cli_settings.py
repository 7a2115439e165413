"""Command-line settings: one flag and one environment variable per setting, derived from the
config (every RelayConfig field round-trips through both), deprecated names that still work
and warn once, one-line errors that never print a password (docs/configuration.md)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ledgerbox._core import settings as settings_module
from ledgerbox._core.migrate_settings import MIGRATE_SETTINGS, NAME_SETTINGS
from ledgerbox.console._cli import CONSOLE_SETTINGS
from ledgerbox.inbox import _cli as consumer_cli
from ledgerbox.relay import RelayConfig, RelayHooks
from ledgerbox.relay import _cli as relay_cli

REPO = Path(__file__).resolve().parents[2]
URL = "postgresql+psycopg://user:s3cret-pw@db.example:5432/app"

#: A valid value different from the default for every RelayConfig field.
SAMPLE: dict[str, Any] = {
    "database_url": URL,
    "kafka_bootstrap_servers": "k1:9092,k2:9092",
    "outbox_table": "events_out",
    "schema": "app",
    "batch_size": 7,
    "lanes": 3,
    "poll_interval_s": 0.25,
    "lease_ttl_s": 9.0,
    "heartbeat_interval_s": 2.0,
    "compression": "zstd",
    "on_dead_letter": "skip",
    "retention_s": 3600.0,
    "relay_id": "relay-7",
    "shard_count": 16,
    "claim_linger_ms": 2,
    "linger_ms": 5,
    "producer_batch_bytes": 2048,
    "max_request_bytes": 2_097_152,
    "request_timeout_ms": 4000,
    "cleanup_interval_s": 30.0,
    "cleanup_batch_size": 50,
    "cleanup_pause_s": 0.5,
    "backoff_max_s": 3.0,
    "stop_timeout_s": 4.0,
}
#: Every RelayConfig field that is a setting (``kafka`` is an object: its settings are the
#: ``kafka_*`` ones, tested in tests/unit/test_kafka_settings.py).
FIELDS = [
    f.name
    for f in dataclasses.fields(RelayConfig)
    if f.init and f.metadata.get("setting") is not False
]
RELAY = relay_cli.RELAY_SETTINGS


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No setting from the machine's environment, and the warn-once memory reset."""
    for name in list(os.environ):
        if name.startswith("LEDGERBOX_") or name in (
            "DATABASE_URL",
            "KAFKA_BOOTSTRAP_SERVERS",
            "REDIS_URL",
        ):
            monkeypatch.delenv(name)
    monkeypatch.setattr(settings_module, "_WARNED", set())
    yield


class _Captured:
    def __init__(self) -> None:
        self.configs: list[RelayConfig] = []
        self.hooks: list[RelayHooks | None] = []


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> _Captured:
    """``relay run`` builds its config as usual; the relay itself is not started."""
    seen = _Captured()

    async def fake_run(config: RelayConfig, hooks: RelayHooks | None) -> None:
        seen.configs.append(config)
        seen.hooks.append(hooks)

    monkeypatch.setattr(relay_cli, "_run", fake_run)
    return seen


def _relay(*args: str, env: dict[str, str] | None = None, kafka: bool = True) -> Any:
    """``relay run ARGS``; a Kafka address is added unless ARGS or ENV set one (it is
    required: no silent localhost default) or ``kafka`` is False."""
    given = " ".join(args) + " ".join(env or {})
    if kafka and "kafka-bootstrap" not in given and "KAFKA_BOOTSTRAP" not in given:
        args = (*args, "--kafka-bootstrap-servers", "k:9092")
    return CliRunner(env=env).invoke(relay_cli.app, ["run", *args])


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_the_sample_covers_every_relay_config_field() -> None:
    assert sorted(SAMPLE) == sorted(FIELDS), "a new RelayConfig field needs a sample value"
    RelayConfig(**SAMPLE)  # and the sample is valid


@pytest.mark.parametrize("field", FIELDS)
def test_every_relay_config_field_round_trips_through_its_flag(
    field: str, captured: _Captured
) -> None:
    args = ["--database-url", URL] if field != "database_url" else []
    result = _relay(*args, _flag(field), str(SAMPLE[field]))
    assert result.exit_code == 0, result.stderr
    (config,) = captured.configs
    assert getattr(config, field) == SAMPLE[field]


@pytest.mark.parametrize("field", FIELDS)
def test_every_relay_config_field_round_trips_through_its_env_var(
    field: str, captured: _Captured
) -> None:
    env = {"LEDGERBOX_RELAY_" + field.upper(): str(SAMPLE[field])}
    env.setdefault("LEDGERBOX_RELAY_DATABASE_URL", URL)
    result = _relay(env=env)
    assert result.exit_code == 0, result.stderr
    (config,) = captured.configs
    assert getattr(config, field) == SAMPLE[field]


def test_all_fields_at_once_through_flags_give_the_same_config(captured: _Captured) -> None:
    args = [part for f in FIELDS for part in (_flag(f), str(SAMPLE[f]))]
    assert _relay(*args).exit_code == 0
    (config,) = captured.configs
    expected = RelayConfig(**SAMPLE)
    assert {f: getattr(config, f) for f in FIELDS} == {f: getattr(expected, f) for f in FIELDS}


def test_a_flag_wins_over_the_env_and_the_prefixed_env_over_the_well_known(
    captured: _Captured,
) -> None:
    env = {
        "DATABASE_URL": "postgresql://well-known/db",
        "LEDGERBOX_RELAY_DATABASE_URL": "postgresql://prefixed/db",
        "KAFKA_BOOTSTRAP_SERVERS": "known:1",
        "LEDGERBOX_RELAY_BATCH_SIZE": "11",
    }
    assert _relay("--batch-size", "12", env=env).exit_code == 0
    assert _relay(env=env).exit_code == 0
    first, second = captured.configs
    assert first.batch_size == 12 and second.batch_size == 11
    assert first.database_url == "postgresql://prefixed/db"
    assert first.kafka_bootstrap_servers == "known:1"
    assert _relay(env={"DATABASE_URL": "postgresql://well-known/db"}).exit_code == 0
    assert captured.configs[-1].database_url == "postgresql://well-known/db"


def test_failsafe_06_the_kafka_address_has_no_silent_default(captured: _Captured) -> None:
    """Issue 12 line 2/6: an unset Kafka address silently meant 127.0.0.1:9092, so a relay
    with a forgotten variable talked to the wrong (or no) cluster. It is required now, and
    the error names every way to set it."""
    result = _relay(env={"DATABASE_URL": "postgresql://well-known/db"}, kafka=False)
    assert result.exit_code == 2 and not captured.configs
    (line,) = result.stderr.strip().splitlines()
    assert line == (
        "ledgerbox relay: no Kafka bootstrap servers; set --kafka-bootstrap-servers, "
        "LEDGERBOX_RELAY_KAFKA_BOOTSTRAP_SERVERS or KAFKA_BOOTSTRAP_SERVERS"
    )


def test_an_empty_variable_counts_as_unset(captured: _Captured) -> None:
    env = {"LEDGERBOX_RELAY_DATABASE_URL": URL, "LEDGERBOX_RELAY_SCHEMA": ""}
    assert _relay(env=env).exit_code == 0
    assert captured.configs[0].schema is None


def test_metrics_port_and_log_level_follow_the_scheme(captured: _Captured) -> None:
    names = {s: RELAY.env(s) for s in ("metrics_port", "log_level")}
    assert names == {
        "metrics_port": "LEDGERBOX_RELAY_METRICS_PORT",
        "log_level": "LEDGERBOX_RELAY_LOG_LEVEL",
    }
    env = {"LEDGERBOX_RELAY_DATABASE_URL": URL, "LEDGERBOX_RELAY_LOG_LEVEL": "loud"}
    result = _relay(env=env)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "ledgerbox relay: log_level must be DEBUG, INFO, WARNING or ERROR (got 'loud'); "
        "set --log-level or LEDGERBOX_RELAY_LOG_LEVEL"
    ]
    assert _relay("--database-url", URL, "--log-level", "warning").exit_code == 0


# -- deprecated names ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "args", "old", "new", "field", "value"),
    [
        (
            {"LEDGERBOX_RELAY_DB_SCHEMA": "app"},
            (),
            "LEDGERBOX_RELAY_DB_SCHEMA",
            "LEDGERBOX_RELAY_SCHEMA",
            "schema",
            "app",
        ),
        (
            {"LEDGERBOX_RELAY_ON_DEAD": "skip"},
            (),
            "LEDGERBOX_RELAY_ON_DEAD",
            "LEDGERBOX_RELAY_ON_DEAD_LETTER",
            "on_dead_letter",
            "skip",
        ),
        ({}, ("--on-dead", "skip"), "--on-dead", "--on-dead-letter", "on_dead_letter", "skip"),
    ],
)
def test_a_deprecated_name_works_and_warns_once(
    env: dict[str, str],
    args: tuple[str, ...],
    old: str,
    new: str,
    field: str,
    value: str,
    captured: _Captured,
) -> None:
    env = {**env, "LEDGERBOX_RELAY_DATABASE_URL": URL}
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} is deprecated, use {new}")):
        first = _relay(*args, env=env)
    second = _relay(*args, env=env)  # same process: no second warning
    assert first.exit_code == second.exit_code == 0, first.stderr
    assert first.stderr.splitlines() == [f"ledgerbox: {old} is deprecated, use {new}"]
    assert second.stderr == ""
    assert [getattr(c, field) for c in captured.configs] == [value, value]


def test_the_new_name_wins_over_the_deprecated_one(captured: _Captured) -> None:
    env = {
        "LEDGERBOX_RELAY_DATABASE_URL": URL,
        "LEDGERBOX_RELAY_DB_SCHEMA": "old",
        "LEDGERBOX_RELAY_SCHEMA": "new",
    }
    with pytest.warns(DeprecationWarning):
        assert _relay(env=env).exit_code == 0
    assert captured.configs[0].schema == "new"


def test_a_deprecated_name_prints_one_line_in_a_real_process() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("LEDGERBOX_") and k not in ("DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS")
    }
    env.update(
        LEDGERBOX_RELAY_DB_SCHEMA="app",
        LEDGERBOX_RELAY_DATABASE_URL=URL,
        KAFKA_BOOTSTRAP_SERVERS="k:9092",
    )
    done = subprocess.run(
        [sys.executable, "-m", "ledgerbox.relay", "run", "--batch-size", "0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "ledgerbox: LEDGERBOX_RELAY_DB_SCHEMA is deprecated, use LEDGERBOX_RELAY_SCHEMA",
        "ledgerbox relay: batch_size must be in 1..100000 (got 0); "
        "set --batch-size or LEDGERBOX_RELAY_BATCH_SIZE",
    ]


# -- errors ----------------------------------------------------------------------------------


def test_an_invalid_value_is_one_line_naming_flag_and_env_with_exit_2(captured: _Captured) -> None:
    result = _relay("--database-url", URL, "--batch-size", "0")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "ledgerbox relay: batch_size must be in 1..100000 (got 0); "
        "set --batch-size or LEDGERBOX_RELAY_BATCH_SIZE"
    ]
    assert captured.configs == []


def test_a_missing_database_url_names_every_way_to_set_it() -> None:
    result = _relay()
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "ledgerbox relay: no database URL; "
        "set --database-url, LEDGERBOX_RELAY_DATABASE_URL or DATABASE_URL"
    ]


def test_a_value_that_does_not_parse_names_the_variable_it_came_from() -> None:
    env = {"LEDGERBOX_RELAY_DATABASE_URL": URL, "LEDGERBOX_RELAY_LANES": "many"}
    result = _relay(env=env)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "ledgerbox relay: lanes must be an integer (got 'many' from LEDGERBOX_RELAY_LANES); "
        "set --lanes or LEDGERBOX_RELAY_LANES"
    ]
    flag = _relay("--database-url", URL, "--lease-ttl-s", "soon")
    assert flag.exit_code == 2
    assert flag.stderr.startswith("ledgerbox relay: lease_ttl_s must be a number (got 'soon')")


def test_errors_never_print_a_url_password() -> None:
    outputs = [
        _relay("--database-url", URL, "--heartbeat-interval-s", "9"),
        _relay("--database-url", URL, "--schema", "Bad-Name"),
        _relay("--database-url", ""),
        CliRunner(env={"LEDGERBOX_CONSUMER_REDIS_URL": "x"}).invoke(
            consumer_cli.app, ["check", "--database-url", URL]
        ),
    ]
    for result in outputs:
        assert result.exit_code == 2
        assert len(result.stderr.splitlines()) == 1, result.stderr
        assert "s3cret" not in result.stdout + result.stderr


def test_unknown_setting_names_are_refused_at_definition() -> None:
    with pytest.raises(TypeError):
        settings_module.settings_from_dataclass(RelayConfig, no_such_field={"secret": True})


# -- the scheme, the help and the docs -------------------------------------------------------


def test_every_relay_config_field_has_one_flag_one_env_var_and_help() -> None:
    for field in FIELDS:
        setting = RELAY.settings[field]
        assert setting.flag == _flag(field)
        assert RELAY.env(field) == "LEDGERBOX_RELAY_" + field.upper()
        assert setting.help, f"{field}: no help (RelayConfig docstring, Parameters)"
    assert RELAY.env_names("database_url") == ("LEDGERBOX_RELAY_DATABASE_URL", "DATABASE_URL")
    assert RELAY.env_names("kafka_bootstrap_servers")[-1] == "KAFKA_BOOTSTRAP_SERVERS"
    assert RELAY.settings["poll_interval_s"].unit == "s"
    assert RELAY.settings["linger_ms"].unit == "ms"
    assert RELAY.settings["producer_batch_bytes"].unit == "bytes"
    assert RELAY.settings["compression"].choices == ("lz4", "zstd", "gzip", "snappy", "none")


def test_run_help_lists_every_flag() -> None:
    result = CliRunner(env={"COLUMNS": "250"}).invoke(relay_cli.app, ["run", "--help"])
    assert result.exit_code == 0
    for field in FIELDS:
        assert _flag(field) in result.stdout, field
    assert "--on-dead " not in result.stdout, "deprecated flags are hidden"


def _doc_rows() -> list[str]:
    text = (REPO / "docs" / "configuration.md").read_text()
    return [line for line in text.splitlines() if line.startswith("|")]


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        (RELAY, list(RELAY.settings)),
        (consumer_cli.CONSUMER_SETTINGS, list(consumer_cli.CONSUMER_SETTINGS.settings)),
        (MIGRATE_SETTINGS, list(MIGRATE_SETTINGS.settings)),
        (CONSOLE_SETTINGS, list(CONSOLE_SETTINGS.settings)),
    ],
    ids=["relay", "consumer", "migrate", "console"],
)
def test_docs_configuration_has_a_row_per_setting_with_its_flag_and_env_vars(
    settings: settings_module.CommandSettings, names: list[str]
) -> None:
    rows = _doc_rows()
    for name in names:
        env_names = settings.env_names(name)
        flag = f"`{settings.settings[name].flag}`"
        if not env_names:  # a Setting.command_line one: the row says so instead
            assert settings.settings[name].command_line, name
            matching = [r for r in rows if flag in r and "command line only" in r]
            assert matching, f"docs/configuration.md: no command-line-only row for {name}"
            continue
        matching = [r for r in rows if flag in r and f"`{env_names[0]}`" in r]
        assert matching, f"docs/configuration.md: no row for {name} ({env_names[0]})"
        for env in env_names:
            assert f"`{env}`" in matching[0], (name, env)
    assert set(FIELDS) <= set(RELAY.settings)


# -- the other commands use the same scheme --------------------------------------------------


def test_consumer_settings_use_the_consumer_prefix_and_accept_the_old_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cs = consumer_cli.CONSUMER_SETTINGS
    assert cs.env("app") == "LEDGERBOX_CONSUMER_APP"
    assert cs.env_names("redis_url") == ("LEDGERBOX_CONSUMER_REDIS_URL", "REDIS_URL")
    monkeypatch.setenv("LEDGERBOX_INBOX_APP", "svc.consumer:consumer")
    monkeypatch.setenv("LEDGERBOX_CONSUMER_METRICS_PORT", "9109")
    with pytest.warns(DeprecationWarning, match="LEDGERBOX_INBOX_APP is deprecated"):
        values = cs.resolve(["app", "metrics_port", "log_level"], {})
    assert values == {"app": "svc.consumer:consumer", "metrics_port": 9109, "log_level": "INFO"}
    monkeypatch.delenv("LEDGERBOX_INBOX_APP")
    result = CliRunner().invoke(consumer_cli.app, ["run"])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (
        "ledgerbox consumer: no consumer app (module:attribute); "
        "set --app or LEDGERBOX_CONSUMER_APP"
    )


def test_migrate_settings_use_the_migrate_prefix_and_accept_the_old_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ledgerbox.migrations import Names

    assert [MIGRATE_SETTINGS.env(n) for n in NAME_SETTINGS] == [
        "LEDGERBOX_MIGRATE_SCHEMA",
        "LEDGERBOX_MIGRATE_OUTBOX_TABLE",
        "LEDGERBOX_MIGRATE_INBOX_TABLE",
    ]
    monkeypatch.setenv("LEDGERBOX_MIGRATE_SCHEMA", "app")
    monkeypatch.setenv("LEDGERBOX_OUTBOX_TABLE", "old_outbox")
    with pytest.warns(DeprecationWarning, match="LEDGERBOX_OUTBOX_TABLE is deprecated"):
        names = Names.resolve({}, {})
    assert names == Names(schema="app", outbox_table="old_outbox", inbox_table="inbox")
    assert Names.resolve({"inbox_table": "x_inbox"}, {}).inbox_table == "x_inbox", "-x wins"


def test_main_hands_hooks_to_the_run_command(captured: _Captured) -> None:
    hooks = RelayHooks()
    with pytest.raises(SystemExit) as done:
        relay_cli.main(
            ["run", "--database-url", URL, "--kafka-bootstrap-servers", "k:9092"], hooks=hooks
        )
    assert done.value.code == 0
    assert captured.hooks == [hooks]


def test_an_error_that_names_its_value_gets_no_second_got() -> None:
    """``ledgerbox console --port 99999`` said "port must be in 0..65535 (got 99999) (got
    99999)": a problem that already quotes the value (an int here) is printed once."""
    line = CONSOLE_SETTINGS.error_line(
        settings_module.ConfigurationError("port must be in 0..65535 (got 99999)", setting="port"),
        {"port": 99999},
    )
    assert line.count("(got ") == 1, line
    assert line.startswith("ledgerbox console: port must be in 0..65535 (got 99999); set "), line


def test_the_event_loop_setting_picks_the_loop_and_refuses_what_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio
    import sys

    from ledgerbox._core import event_loop
    from ledgerbox._core.settings import SettingsError

    assert event_loop.runner("asyncio") is asyncio.run
    with pytest.raises(SettingsError, match="event_loop must be one of auto, asyncio, uvloop"):
        event_loop.runner("libuv")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # importing it raises ImportError
    assert event_loop.runner("auto") is asyncio.run, "auto without uvloop: asyncio's loop"
    with pytest.raises(SettingsError, match=r"pip install 'ledgerbox\[uvloop\]'"):
        event_loop.runner("uvloop")


def test_auto_falls_back_to_asyncio_when_the_installed_uvloop_cannot_run_the_daemon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An uvloop older than 0.18 (no ``uvloop.run``; another package's pin, e.g. an old
    ``uvicorn[standard]``) or one that fails to import made the default ``auto`` crash with
    a traceback or refuse to start ("uvloop is not installed ... (got 'auto')"): ``auto``
    runs on asyncio's loop then, and ``uvloop`` says what is wrong in one line."""
    import asyncio
    import sys
    import types

    from ledgerbox._core import event_loop
    from ledgerbox._core.settings import SettingsError

    old = types.ModuleType("uvloop")
    old.__version__ = "0.17.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "uvloop", old)
    assert event_loop.runner("auto") is asyncio.run, "uvloop without run(): asyncio's loop"
    with pytest.raises(SettingsError, match=r"uvloop 0\.17\.0 is too old") as too_old:
        event_loop.runner("uvloop")
    assert "\n" not in str(too_old.value)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # found on the path, import fails
    assert event_loop.runner("auto") is asyncio.run, "a broken uvloop: asyncio's loop"
    with pytest.raises(SettingsError, match="uvloop cannot be imported"):
        event_loop.runner("uvloop")


def test_a_table_name_too_long_for_its_derived_names_is_refused_naming_the_flag(
    captured: _Captured,
) -> None:
    # Before: a 45-char outbox table passed the relay's settings ('relay down: tables ... do
    # not exist: run ledgerbox migrate'), and migrate then failed with SQLAlchemy's
    # IdentifierError on uq_<name>_idempotency_key, naming no setting.
    result = _relay("--database-url", URL, "--outbox-table", "o" * 45)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"ledgerbox relay: outbox table name {'o' * 45!r} is 45 chars: ledgerbox derives "
        f"'uq_{'o' * 45}_idempotency_key' (64 chars) from it, over PostgreSQL's 63: use at "
        "most 44 chars; set --outbox-table or LEDGERBOX_RELAY_OUTBOX_TABLE"
    ]
    assert captured.configs == []
    assert _relay("--database-url", URL, "--outbox-table", "o" * 44).exit_code == 0
    assert [c.outbox_table for c in captured.configs] == ["o" * 44]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--outbox-table", "order"], "--outbox-table or LEDGERBOX_CONSOLE_OUTBOX_TABLE"),
        (["--inbox-table", "i" * 47], "--inbox-table or LEDGERBOX_CONSOLE_INBOX_TABLE"),
        (["--schema", "user"], "--schema or LEDGERBOX_CONSOLE_SCHEMA"),
    ],
)
def test_the_console_refuses_a_bad_table_name_naming_the_flag(args: list[str], flag: str) -> None:
    from ledgerbox.console import _cli as console_cli

    result = CliRunner().invoke(console_cli.app, ["--database-url", URL, *args])
    assert result.exit_code == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("ledgerbox console: ") and line.endswith(f"; set {flag}"), line


def test_a_consumer_config_refuses_an_inbox_table_too_long_naming_the_setting() -> None:
    from ledgerbox._core.errors import ConfigurationError
    from ledgerbox.inbox import ConsumerConfig

    base: dict[str, Any] = {
        "database_url": URL,
        "group_id": "g",
        "topics": ["t"],
        "kafka_bootstrap_servers": "k:9092",
    }
    with pytest.raises(ConfigurationError, match=r"is 47 chars: .* use at most 46") as info:
        ConsumerConfig(**base, inbox_table="i" * 47)
    assert info.value.setting == "inbox_table"
    ConsumerConfig(**base, inbox_table="i" * 46)


def test_a_bad_table_name_in_the_consoles_services_file_names_the_file_not_a_flag(
    tmp_path: Path,
) -> None:
    # Before: 'ledgerbox console: outbox table ... use at most 44 chars (got 'outbox'); set
    # --outbox-table or LEDGERBOX_CONSOLE_OUTBOX_TABLE': the value came from the file, and
    # setting that flag changed nothing.
    from ledgerbox.console import _cli as console_cli

    path = tmp_path / "console.toml"
    path.write_text(
        f'[[service]]\nname = "pay"\ndatabase_url = "{URL}"\noutbox_table = "{"o" * 45}"\n'
    )
    result = CliRunner().invoke(console_cli.app, ["--services-file", str(path)])
    assert result.exit_code == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(
        f"ledgerbox console: services file {path}, service 1 ('pay'): outbox table "
    ), line
    assert "use at most 44 chars" in line and "--outbox-table" not in line, line
    assert line.endswith("; set --services-file or LEDGERBOX_CONSOLE_SERVICES_FILE"), line


def test_a_table_and_schema_whose_notify_channel_is_too_long_are_refused_naming_the_flag(
    captured: _Captured,
) -> None:
    # Before: the relay took the pair ('relay down: tables ... do not exist: run ledgerbox
    # migrate') and migrate then printed 'migrate failed: ConfigurationError: ...', naming
    # no flag; the NOTIFY channel <table>_<schema>_ledgerbox (65 chars here) is over 63.
    from ledgerbox.cli import app as ledgerbox_app

    pair = ["--outbox-table", "o" * 44, "--schema", "s" * 10]
    result = _relay("--database-url", URL, *pair)
    assert result.exit_code == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("ledgerbox relay: outbox table name ") and "65 chars" in line, line
    assert line.endswith("; set --outbox-table or LEDGERBOX_RELAY_OUTBOX_TABLE"), line
    assert captured.configs == []
    result = CliRunner().invoke(ledgerbox_app, ["migrate", "--database-url", URL, *pair])
    assert result.exit_code == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("ledgerbox migrate: outbox table name ") and "65 chars" in line, line
    assert line.endswith("; set --outbox-table or LEDGERBOX_MIGRATE_OUTBOX_TABLE"), line
    assert (
        _relay("--database-url", URL, "--outbox-table", "o" * 44, "--schema", "s" * 8).exit_code
        == 0
    )
    assert [c.schema for c in captured.configs] == ["s" * 8]


@pytest.mark.parametrize(
    ("line", "key", "got"),
    [
        ('shard_count = "many"', "shard_count", "an integer (got 'many')"),
        ("shard_count = true", "shard_count", "an integer (got True)"),
        ('groups = "payments"', "groups", "a list of strings (got 'payments')"),
        ("dlq_topics = [1]", "dlq_topics", "a list of strings (got [1])"),
        ("schema = 5", "schema", "a string (got 5)"),
    ],
)
def test_a_value_of_the_wrong_type_in_the_services_file_names_the_file_service_and_key(
    tmp_path: Path, line: str, key: str, got: str
) -> None:
    # Before: 'services file ..., service 1: shard_count must be an integer (got 64); set
    # --shard-count or LEDGERBOX_CONSOLE_SHARD_COUNT': the flag's default, and a flag that
    # changes nothing (the value is the file's).
    from ledgerbox.console import _cli as console_cli

    path = tmp_path / "console.toml"
    path.write_text(f'[[service]]\nname = "pay"\ndatabase_url = "{URL}"\n{line}\n')
    result = CliRunner().invoke(console_cli.app, ["--services-file", str(path)])
    assert result.exit_code == 2
    [out] = result.stderr.splitlines()
    assert out == (
        f"ledgerbox console: services file {path}, service 1 ('pay'): {key} must be {got}; "
        "set --services-file or LEDGERBOX_CONSOLE_SERVICES_FILE"
    ), out
