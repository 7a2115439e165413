"""A startup check's permanent verdict (a refused login) ends a daemon only once it held
for ``PERMANENT_CONFIRM_S``: CI's soak saw ``ledgerbox consumer run`` exit 2 with "database
... refused the login" during a PostgreSQL restart (the server took the password, then
closed the connection: libpq's account of a refused login). The policy is pure; the
consumer's and the relay's startup loops are driven here with their check replaced."""

from __future__ import annotations

from typing import Any

import pytest

from ledgerbox._core import faults
from ledgerbox._core.faults import PermanentVerdict
from ledgerbox.inbox import ConsumerConfig, InboxConsumer, StartupError
from ledgerbox.inbox import _consumer as consumer_module
from ledgerbox.inbox._checks import CheckResult
from ledgerbox.relay import RelayConfig
from ledgerbox.relay import _cli as relay_cli
from ledgerbox.relay._checks import CheckResult as RelayCheckResult
from ledgerbox.relay._checks import Problem

URL = "postgresql+psycopg://u:p@127.0.0.1:1/db"
REFUSED = "database at 127.0.0.1:1 refused the login of user 'u': fix database_url"


def test_a_permanent_verdict_holds_only_after_the_window_without_a_break() -> None:
    verdict = PermanentVerdict(window_s=2.0)
    assert not verdict.holds(True, 10.0)
    assert not verdict.holds(True, 11.9)
    assert not verdict.holds(False, 12.0)  # a different answer in between starts it again
    assert not verdict.holds(True, 12.5)
    assert not verdict.holds(True, 14.4)
    assert verdict.holds(True, 14.5)
    assert PermanentVerdict().window_s == faults.PERMANENT_CONFIRM_S == 2.0


def _consumer() -> InboxConsumer:
    return InboxConsumer(
        ConsumerConfig(
            group_id="g", topics=["t"], database_url=URL, kafka_bootstrap_servers="127.0.0.1:1"
        )
    )


async def test_the_consumer_starts_when_a_refused_login_does_not_repeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(faults, "PERMANENT_CONFIRM_S", 0.05)
    answers = [CheckResult("down", REFUSED, permanent=True, recheck=True), CheckResult("ok")]

    async def check(*_: Any, **__: Any) -> CheckResult:
        return answers.pop(0)

    monkeypatch.setattr(consumer_module, "check_consumer", check)
    consumer = _consumer()
    try:
        await consumer._until_ready()  # before: StartupError at the first answer
    finally:
        await consumer.aclose()
    assert answers == []


async def test_the_consumer_still_stops_on_a_refusal_that_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(faults, "PERMANENT_CONFIRM_S", 0.2)
    calls = 0

    async def check(*_: Any, **__: Any) -> CheckResult:
        nonlocal calls
        calls += 1
        return CheckResult("down", REFUSED, permanent=True, recheck=True)

    monkeypatch.setattr(consumer_module, "check_consumer", check)
    consumer = _consumer()
    try:
        with pytest.raises(StartupError, match="refused the login"):
            await consumer._until_ready()
    finally:
        await consumer.aclose()
    assert calls == 2  # one more look, not a storm of logins


async def test_an_unambiguous_refusal_is_not_rechecked(monkeypatch: pytest.MonkeyPatch) -> None:
    # Kafka's SaslAuthenticationFailed: one login only (a managed cluster may lock the
    # account after failed logins), exit at once.
    calls = 0

    async def check(*_: Any, **__: Any) -> CheckResult:
        nonlocal calls
        calls += 1
        return CheckResult("down", "kafka refused the login of SASL user", permanent=True)

    monkeypatch.setattr(consumer_module, "check_consumer", check)
    consumer = _consumer()
    try:
        with pytest.raises(StartupError, match="SASL"):
            await consumer._until_ready()
    finally:
        await consumer.aclose()
    assert calls == 1


class _Relay:
    built: list[RelayConfig] = []

    def __init__(self, config: RelayConfig, hooks: Any = None) -> None:
        _Relay.built.append(config)

    def stop(self) -> None:
        return None

    async def run(self) -> None:
        return None


async def test_the_relay_starts_when_a_refused_login_does_not_repeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = RelayCheckResult([Problem(True, REFUSED, recheck=True)], [])
    answers = [refused, RelayCheckResult([], ["database ok"])]

    async def check(_: RelayConfig) -> RelayCheckResult:
        return answers.pop(0)

    monkeypatch.setattr(relay_cli, "_check", check)
    monkeypatch.setattr(relay_cli, "Relay", _Relay)
    monkeypatch.setattr(faults, "PERMANENT_CONFIRM_S", 0.05)
    config = RelayConfig(database_url=URL, kafka_bootstrap_servers="127.0.0.1:1")
    await relay_cli._run(config, None)  # before: typer.Exit(2) at the first answer
    assert answers == [] and _Relay.built == [config]
