"""Redaction (ledgerbox._core.redaction) and the endpoint binding rule (ledgerbox._core.endpoint):
URLs without passwords, URL passwords and password fields scrubbed (by position, never by
value) from every log record and printed line, metrics on 127.0.0.1 unless told otherwise
(docs/security.md)."""

from __future__ import annotations

import logging
import socket
import urllib.request
from typing import Any

import pytest

from ledgerbox import ConfigurationError
from ledgerbox._core import endpoint
from ledgerbox._core.redaction import (
    ScrubFilter,
    Secret,
    redact_url,
    scrub,
)
from ledgerbox.relay import RelayConfig


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "postgresql+psycopg://app:pa%40ss-W0rd@db:5432/app?sslmode=verify-full",
            "postgresql+psycopg://app:***@db:5432/app?sslmode=verify-full",
        ),
        ("rediss://ledgerbox:r3dis-pw@cache:6380/0", "rediss://ledgerbox:***@cache:6380/0"),
        ("redis://:only-pass@cache:6379/0", "redis://:***@cache:6379/0"),
        ("postgresql://db/app?user=a&password=qu3ry-pw", "postgresql://db/app?user=a&password=***"),
        ("postgresql://db:5432/app", "postgresql://db:5432/app"),
    ],
)
def test_redact_url_drops_every_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_scrub_masks_url_passwords_and_password_fields() -> None:
    text = (
        "a postgresql+psycopg://relay:Rel4y-db-pass@db/app b redis://:R3dis-pass@cache/0 "
        "c 'postgresql://u:pa@ss/w@h:5432/db' d host=h password=Pq-pw user=u "
        "e password='a b' f {'password': 'Dict-pw'} g Authorization: Bearer T0k"
    )
    assert scrub(text) == (
        "a postgresql+psycopg://relay:***@db/app b redis://:***@cache/0 "
        "c 'postgresql://u:***@h:5432/db' d host=h password=*** user=u "
        "e password=*** f {'password': '***'} g Authorization: Bearer ***"
    )


@pytest.mark.parametrize("password", ["postgres", "wrong", "server", "database", "app"])
def test_scrub_masks_by_position_never_by_value(password: str) -> None:
    # The password of the URL in use is not masked where it appears as another word: masking
    # it there said what it was (the user name, 'wrong', 'server') and mangled the message.
    RelayConfig(
        database_url=f"postgresql://postgres:{password}@db/app", kafka_bootstrap_servers="k:1"
    )
    line = (
        "the database server at 127.0.0.1:5433 refused the login of user 'postgres' to "
        "database 'app': a wrong or missing password"
    )
    assert scrub(line) == line
    assert scrub(f"postgresql://postgres:{password}@db/app") == "postgresql://postgres:***@db/app"


def test_a_secret_prints_as_stars_and_reveals_only_on_request(tmp_path: Any) -> None:
    secret = Secret("T0ken-value-123")
    assert (str(secret), repr(secret), f"{secret}", f"{secret:>20}") == (
        "***",
        "Secret('***')",
        "***",
        "***",
    )
    assert secret.reveal() == "T0ken-value-123"
    path = tmp_path / "s"
    path.write_text("fr0m-a-file\n")
    assert Secret.from_file(path).reveal() == "fr0m-a-file"


class _Pydanticish:
    def get_secret_value(self) -> str:
        return "py-secret-9"


def test_a_pydantic_secret_is_accepted() -> None:
    assert Secret(_Pydanticish()).reveal() == "py-secret-9"
    with pytest.raises(TypeError):
        Secret(12)


def test_the_scrub_filter_masks_messages_arguments_and_tracebacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("ledgerbox.test.redaction")
    caplog.handler.addFilter(ScrubFilter())
    try:
        logger.warning("connect to %s failed", "redis://u:L0gged-secret@h/0")
        try:
            raise RuntimeError("driver said password=L0gged-secret")
        except RuntimeError:
            logger.exception("boom")
    finally:
        caplog.handler.filters.clear()
    assert "L0gged-secret" not in caplog.text
    assert "redis://u:***@h/0" in caplog.text and "driver said password=***" in caplog.text


# -- HTTP endpoints ------------------------------------------------------------------------


def test_loopback_rule() -> None:
    assert endpoint.is_loopback("127.0.0.1") and endpoint.is_loopback("::1")
    assert endpoint.is_loopback("localhost") and endpoint.is_loopback("127.0.0.2")
    assert not endpoint.is_loopback("0.0.0.0") and not endpoint.is_loopback("10.1.2.3")
    assert endpoint.needs_token("0.0.0.0") and not endpoint.needs_token("127.0.0.1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_metrics_bind_127_0_0_1_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_start(port: int, addr: str = "0.0.0.0", **_: Any) -> None:
        seen.update(port=port, addr=addr)

    import prometheus_client

    monkeypatch.setattr(prometheus_client, "start_http_server", fake_start)
    endpoint.serve_metrics(9999)
    assert seen == {"port": 9999, "addr": "127.0.0.1"}


def test_metrics_really_listen_on_loopback_only_and_answer() -> None:
    port = _free_port()
    endpoint.serve_metrics(port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
    listening = _listening_addresses(port)
    assert listening == {"127.0.0.1"}, listening


def test_metrics_on_a_busy_port_is_one_configuration_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigurationError) as caught:
            endpoint.serve_metrics(port)
    assert caught.value.setting == "metrics_port"
    assert str(caught.value).startswith(f"metrics endpoint cannot listen on 127.0.0.1:{port}")


def _listening_addresses(port: int) -> set[str]:
    """Local addresses in LISTEN state on ``port``, from /proc/net/tcp (IPv4)."""
    found: set[str] = set()
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                raw = bytes.fromhex(address)[::-1]
                found.add(socket.inet_ntoa(raw))
    return found


@pytest.mark.parametrize("port", [70000, 65536, -1, 0])
def test_serve_metrics_refuses_a_port_outside_the_tcp_range_naming_metrics_port(port: int) -> None:
    from ledgerbox._core import endpoint
    from ledgerbox._core.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"metrics_port must be a TCP port in 1\.\.65535"):
        endpoint.serve_metrics(port)
