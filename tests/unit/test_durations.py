"""Every duration setting is a finite number of seconds in its range, checked when the
settings are read or the config is built, one line naming the flag (docs/configuration.md).

Before: ``--lease-ttl-s inf`` and ``--poll-interval-s inf`` were taken (a relay that never
renews, never polls); ``relay rebase --margin-s inf|1e300`` raised ``OverflowError`` from
``datetime`` and ``--margin-s -5`` ran; ``consumer purge --older-than-s inf`` reached
PostgreSQL as an interval it cannot hold."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from ledgerbox import ConfigurationError, admin
from ledgerbox._core import settings as settings_module
from ledgerbox.inbox import ConsumerConfig
from ledgerbox.inbox import _cli as consumer_cli
from ledgerbox.relay import RelayConfig
from ledgerbox.relay import _cli as relay_cli

#: ledgerbox._core.durations.MAX_DURATION_S: 10 years.
MAX_DURATION_S = 10 * 365 * 86400.0
URL = "postgresql+psycopg://user:s3cret-pw@127.0.0.1:1/app"
RELAY = relay_cli.RELAY_SETTINGS
#: Every number setting of every command that is a duration in seconds.
RELAY_DURATIONS = sorted(n for n, s in RELAY.settings.items() if s.type is float)
CONSUMER_DURATIONS = sorted(
    n for n, s in consumer_cli.CONSUMER_SETTINGS.settings.items() if s.type is float
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith("LEDGERBOX_") or name in ("DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(settings_module, "_WARNED", set())
    yield


@pytest.fixture
def relay_not_started(monkeypatch: pytest.MonkeyPatch) -> list[RelayConfig]:
    seen: list[RelayConfig] = []

    async def fake_run(config: RelayConfig, hooks: Any) -> None:
        seen.append(config)

    monkeypatch.setattr(relay_cli, "_run", fake_run)
    return seen


def test_the_number_settings_are_all_durations() -> None:
    # What this module covers: a new float setting is a duration too, or this says so.
    assert all(n.endswith("_s") for n in RELAY_DURATIONS + CONSUMER_DURATIONS)
    assert {"poll_interval_s", "lease_ttl_s", "margin_s", "older_than_s"} <= set(RELAY_DURATIONS)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
@pytest.mark.parametrize("name", RELAY_DURATIONS)
def test_relay_run_refuses_a_duration_that_is_not_finite_from_flag_and_variable(
    name: str, value: str, relay_not_started: list[RelayConfig]
) -> None:
    flag = "--" + name.replace("_", "-")
    base = ["run", "--database-url", URL, "--kafka-bootstrap-servers", "k:9092"]
    if name in ("margin_s", "older_than_s"):  # not settings of `run`
        return
    for args, env in (([flag, value], {}), ([], {RELAY.env(name): value})):
        result = CliRunner(env=env).invoke(relay_cli.app, [*base, *args])
        assert result.exit_code == 2, result.output
        [line] = result.stderr.splitlines()
        assert line.startswith(f"ledgerbox relay: {name} must be a finite number (got "), line
        assert line.endswith(f"; set {RELAY.where(name)}"), line
    assert relay_not_started == []


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("poll_interval_s", 1e300),
        ("lease_ttl_s", 1e300),
        ("retention_s", 1e12),
        ("cleanup_interval_s", 1e300),
        ("cleanup_pause_s", -1.0),
        ("backoff_max_s", 1e300),
        ("stop_timeout_s", 601.0),
        ("heartbeat_interval_s", 3.0),
    ],
)
def test_relay_run_refuses_a_duration_out_of_its_range(
    name: str, value: float, relay_not_started: list[RelayConfig]
) -> None:
    flag = "--" + name.replace("_", "-")
    result = CliRunner().invoke(
        relay_cli.app,
        ["run", "--database-url", URL, "--kafka-bootstrap-servers", "k:9092", flag, str(value)],
    )
    assert result.exit_code == 2, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith(f"ledgerbox relay: {name} must be "), line
    assert line.endswith(f"; set {RELAY.where(name)}"), line
    assert relay_not_started == []


@pytest.mark.parametrize("value", ["inf", "nan", "1e300", "-5", "-0.001"])
def test_relay_rebase_refuses_a_margin_that_is_not_a_duration(value: str) -> None:
    # URL: nothing listens on port 1; a refusal comes before any connection.
    result = CliRunner().invoke(
        relay_cli.app, ["rebase", "--database-url", URL, "--margin-s", value, "--dry-run"]
    )
    assert result.exit_code == 2, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("ledgerbox relay: margin_s must be "), line
    assert line.endswith("; set --margin-s or LEDGERBOX_RELAY_MARGIN_S"), line


@pytest.mark.parametrize("value", ["inf", "nan", "1e300", "1e12", "-1"])
def test_consumer_purge_refuses_an_age_that_is_not_a_duration(value: str) -> None:
    # Refused before the app is loaded: this app does not even exist.
    result = CliRunner().invoke(
        consumer_cli.app, ["purge", "--app", "nosuch:app", "--older-than-s", value]
    )
    assert result.exit_code == 2, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("ledgerbox consumer: older_than_s must be "), line
    assert line.endswith("; set --older-than-s or LEDGERBOX_CONSUMER_OLDER_THAN_S"), line


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e300, MAX_DURATION_S * 2])
@pytest.mark.parametrize(
    "name",
    ["poll_interval_s", "lease_ttl_s", "retention_s", "cleanup_interval_s", "cleanup_pause_s",
     "backoff_max_s", "stop_timeout_s"],
)  # fmt: skip
def test_relay_config_refuses_a_duration_that_is_not_finite_or_too_long(
    name: str, value: float
) -> None:
    with pytest.raises(ConfigurationError, match=f"^{name} must be ") as info:
        RelayConfig(database_url=URL, kafka_bootstrap_servers="k:9092", **{name: value})
    assert info.value.setting == name


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e300])
@pytest.mark.parametrize(
    "name",
    ["dedup_ttl_s", "retention_s", "offset_retention_s", "retry_base_s", "retry_max_s",
     "redis_timeout_s", "redis_probe_interval_s", "stop_timeout_s"],
)  # fmt: skip
def test_consumer_config_refuses_a_duration_that_is_not_finite_or_too_long(
    name: str, value: float
) -> None:
    with pytest.raises(ConfigurationError, match=f"^{name} must be ") as info:
        ConsumerConfig(
            group_id="g",
            topics=["t"],
            database_url=URL,
            kafka_bootstrap_servers="k:9092",
            **{name: value},
        )
    assert info.value.setting == name


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e12, -1.0])
def test_the_operator_filters_refuse_an_age_that_is_not_a_duration(value: float) -> None:
    with pytest.raises(admin.InvalidFilterError, match=r"^older_than_s must be >= 0"):
        admin.DeadFilter(older_than_s=value)
    with pytest.raises(admin.InvalidFilterError, match=r"^older_than_s must be >= 0"):
        admin.DlqFilter(dlq_topic="o.dlq", older_than_s=value)


def test_check_duration_bounds() -> None:
    from ledgerbox._core import durations
    from ledgerbox._core.durations import check_duration

    assert durations.MAX_DURATION_S == MAX_DURATION_S
    check_duration(0.0, "x")
    check_duration(MAX_DURATION_S, "x")
    with pytest.raises(ConfigurationError, match=r"^x must be > 0 and <= 600 seconds, a finite"):
        check_duration(0.0, "x", low_open=True, high=600.0)
    with pytest.raises(ConfigurationError, match=r"\(10 years\), a finite number \(got inf\)"):
        check_duration(math.inf, "x")


@pytest.mark.parametrize("value", [1e-9, 0.009])
def test_a_poll_interval_that_would_busy_poll_is_refused(value: float) -> None:
    """A newcomer's review: ``--poll-interval-s 1e-9`` was accepted and an idle relay used
    half a core; the fallback poll is bounded below at 10 ms (NOTIFY wakes it anyway)."""
    with pytest.raises(ConfigurationError, match=r"^poll_interval_s must be >= 0.01") as info:
        RelayConfig(database_url=URL, kafka_bootstrap_servers="k:9092", poll_interval_s=value)
    assert info.value.setting == "poll_interval_s"
    RelayConfig(database_url=URL, kafka_bootstrap_servers="k:9092", poll_interval_s=0.01)
