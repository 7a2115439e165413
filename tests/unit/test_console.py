"""The console without services: its access rules (loopback by default, a token required
elsewhere and then on every request, form tokens and same-origin posts, Host check), the
page over the in-memory source, actions through the source with the console's actor, and
the publish-rate meter (docs/console.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient

from ledgerbox._core.errors import ConfigurationError
from ledgerbox.admin import DeadEvent, DlqRecord, PartitionLag
from ledgerbox.console import ConsoleConfig, ServiceTarget, create_app, load_services_file
from ledgerbox.console._auth import COOKIE, Guard
from ledgerbox.console._source import RelayPanel, ShardOwners
from ledgerbox.console._view import RateMeter
from ledgerbox.console.testing import InMemorySource, ServiceData

TOKEN = "s3cret-token-of-the-ops-team"
URL = "postgresql+psycopg://u:hunter2@db.example:5432/orders"


def service(**kw: object) -> ServiceTarget:
    return ServiceTarget(
        name="orders",
        database_url=URL,
        groups=["payments"],
        dlq_topics=["orders.dlq"],
        **kw,  # type: ignore[arg-type]
    )


def dead(row_id: int, key: str, held: int = 0) -> DeadEvent:
    now = datetime.now(UTC)
    return DeadEvent(
        id=row_id,
        event_id=f"00000000-0000-0000-0000-{row_id:012d}",
        key=key,
        event_type="OrderPlaced",
        topic="orders",
        shard=3,
        attempts=1,
        last_error="MessageSizeTooLargeError: <script>alert(1)</script>",
        created_at=now - timedelta(seconds=30),
        occurred_at=now - timedelta(seconds=31),
        held_behind=held,
    )


def dlq_record(offset: int, group: str | None = "payments") -> DlqRecord:
    return DlqRecord(
        ref=f"orders.dlq:0:{offset}",
        dlq_topic="orders.dlq",
        partition=0,
        offset=offset,
        group=group,
        source_topic="orders",
        source_partition=0,
        source_offset=40 + offset,
        event_id="e-1",
        event_type="OrderPlaced",
        key="order-9",
        error_type="ValueError",
        error_message="amount must be positive",
        attempts=3,
        dead_lettered_at=datetime.now(UTC),
        state="dead",
        headers=[],
    )


def data() -> ServiceData:
    return ServiceData(
        status=RelayPanel(
            pending=7,
            oldest_pending_age_s=12.5,
            dead_lettered=1,
            held=2,
            owners=[ShardOwners("relay-a", "0-63", 64), ShardOwners("relay-a", "leader", 1)],
        ),
        dead=[dead(41, "order-7", held=2)],
        dlq={"orders.dlq": [dlq_record(5), dlq_record(6, group=None)]},
        lag={
            "payments": [
                PartitionLag(topic="orders", partition=0, committed=3, high_watermark=10, lag=7)
            ]
        },
    )


def client(config: ConsoleConfig, source: InMemorySource | None = None, **kw: str) -> TestClient:
    app = create_app(
        config, source or InMemorySource({"orders": data()}), guard=Guard(config, b"k" * 32)
    )
    return TestClient(app, base_url=kw.get("base_url", "http://127.0.0.1:8090"))


def form_token(html: str) -> str:
    match = re.search(r'name="csrf" value="([0-9a-f]+)"', html)
    assert match, "the page carries a form token"
    return match.group(1)


# -- settings and access ---------------------------------------------------------------------


def test_loopback_is_the_default_and_needs_no_token() -> None:
    config = ConsoleConfig(services=[service()])
    assert config.host == "127.0.0.1"
    page = client(config).get("/")
    assert page.status_code == 200
    assert "orders" in page.text


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "ops.example"])
def test_a_non_loopback_host_without_token_is_refused(host: str) -> None:
    with pytest.raises(ConfigurationError, match="requires a token") as info:
        ConsoleConfig(services=[service()], host=host)
    assert info.value.setting == "token"
    ConsoleConfig(services=[service()], host=host, token=TOKEN)  # with one: fine


def test_the_command_refuses_a_non_loopback_host_without_token_in_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ledgerbox", "console", "--database-url", URL, "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "LEDGERBOX_CONSOLE_TOKEN": ""},
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "requires a token" in lines[0] and "LEDGERBOX_CONSOLE_TOKEN" in lines[0]
    assert "hunter2" not in out.stderr


def test_with_a_token_every_request_needs_it() -> None:
    config = ConsoleConfig(services=[service()], host="0.0.0.0", token=TOKEN)
    c = client(config)
    assert c.get("/").status_code == 401
    assert c.get("/", headers={"Authorization": "Bearer wrong-token-xxxxxxxx"}).status_code == 401
    html = c.get("/", headers={"Accept": "text/html"})
    assert html.status_code == 401 and 'name="token"' in html.text, "browsers get the login form"
    assert c.post("/services/orders/dead/replay", data={"ids": "41"}).status_code == 401
    ok = c.get("/", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and "order-7" in ok.text
    assert c.get("/healthz").text == "ok", "the health probe needs no token and shows nothing"


def test_the_login_form_sets_a_session_cookie_that_is_not_the_token() -> None:
    config = ConsoleConfig(services=[service()], host="0.0.0.0", token=TOKEN)
    c = client(config)
    login = c.get("/login")
    csrf = form_token(login.text)
    wrong = c.post("/login", data={"csrf": csrf, "token": "nope"}, follow_redirects=False)
    assert wrong.status_code == 401
    good = c.post("/login", data={"csrf": csrf, "token": TOKEN}, follow_redirects=False)
    assert good.status_code == 303
    cookie = good.cookies[COOKIE]
    assert TOKEN not in cookie
    assert "httponly" in good.headers["set-cookie"].lower()
    assert "samesite=strict" in good.headers["set-cookie"].lower()
    assert c.get("/").status_code == 200, "the cookie opens the page"


def test_posts_need_the_form_token_and_the_same_origin() -> None:
    source = InMemorySource({"orders": data()})
    c = client(ConsoleConfig(services=[service()]), source)
    csrf = form_token(c.get("/").text)
    assert c.post("/services/orders/dead/replay", data={"ids": "41"}).status_code == 403
    foreign = c.post(
        "/services/orders/dead/replay",
        data={"ids": "41", "csrf": csrf},
        headers={"Origin": "http://evil.example"},
    )
    assert foreign.status_code == 403
    assert source.actions == [], "nothing was done"


def test_a_foreign_host_header_is_refused() -> None:
    c = client(ConsoleConfig(services=[service()]))
    assert c.get("/", headers={"Host": "rebind.evil.example:8090"}).status_code == 400
    assert c.get("/", headers={"Host": "localhost:8090"}).status_code == 200


# -- the page and the actions ------------------------------------------------------------------


def test_the_page_shows_every_section_escaped() -> None:
    page = client(ConsoleConfig(services=[service()])).get("/").text
    for text in ("pending", "12.5 s", "relay-a", "0-63", "order-7", "#41", "OrderPlaced"):
        assert text in page, text
    assert "<script>alert(1)</script>" not in page, "error text is escaped"
    assert "&lt;script&gt;" in page
    assert "orders.dlq:0:5" in page and "amount must be positive" in page
    assert re.search(r"<td class=\"num\">10</td><td class=\"num\">7</td>", page), "lag row"
    assert "data-confirm=" in page, "replay and discard ask first"
    assert "hunter2" not in page and "db.example" not in page, "no URL on the page"
    # The record without a group header cannot be replayed from the page.
    row = page.split('data-ref="orders.dlq:0:6"')[1].split("</tr>")[0]
    assert "disabled" in row


@pytest.mark.parametrize("value", ["\u00b2", "\u0663", "1\u00b9", "-5", "0", "99999", "x", ""])
def test_a_refresh_that_is_not_1_to_3600_ascii_digits_is_ignored(value: str) -> None:
    # Before: "?refresh=²" (a Unicode digit str.isdigit() accepts) answered 500 (ValueError).
    page = client(ConsoleConfig(services=[service()])).get("/", params={"refresh": value})
    assert page.status_code == 200
    assert 'http-equiv="refresh"' not in page.text


def test_a_refresh_of_ascii_digits_reloads_the_page() -> None:
    page = client(ConsoleConfig(services=[service()])).get("/?refresh=10")
    assert '<meta http-equiv="refresh" content="10">' in page.text


def test_replay_goes_through_the_source_with_the_console_actor() -> None:
    source = InMemorySource({"orders": data()})
    c = client(ConsoleConfig(services=[service()]), source)
    csrf = form_token(c.get("/").text)
    done = c.post(
        "/services/orders/dead/replay",
        data={"ids": "41", "csrf": csrf, "operator": "alice"},
        headers={"Origin": "http://127.0.0.1:8090"},
    )
    assert done.status_code == 200  # followed the 303 back to the page
    assert [a.action for a in source.actions] == ["relay.dead.replay"]
    assert source.actions[0].ids == ["41"]
    assert source.actions[0].actor == "console:alice@testclient"
    assert "replay 41" in done.text and "audit #1" in done.text
    assert "no dead event" in done.text


def test_an_action_error_is_one_line_on_the_page_and_changes_nothing() -> None:
    source = InMemorySource({"orders": data()})
    c = client(ConsoleConfig(services=[service()]), source)
    csrf = form_token(c.get("/").text)
    done = c.post("/services/orders/dead/discard", data={"ids": "999", "csrf": csrf})
    assert "dead discard refused: no dead event 999" in done.text
    assert source.actions == []
    dry = c.post(
        "/services/orders/dlq/replay", data={"refs": "orders.dlq:0:5", "csrf": csrf, "dry_run": "1"}
    )
    assert "dry run: would replay orders.dlq:0:5" in dry.text
    assert source.actions[-1].dry_run


def test_a_failing_section_shows_its_error_and_the_others_still_show() -> None:
    from ledgerbox import BrokerError
    from ledgerbox._core.faults import Fault

    broken = data()
    broken.fail["lag"] = BrokerError(
        "Kafka is unreachable at 127.0.0.1:1: start it", fault=Fault.TRANSIENT, kind="Unreachable"
    )
    page = client(ConsoleConfig(services=[service()]), InMemorySource({"orders": broken})).get("/")
    assert page.status_code == 200
    assert "Kafka is unreachable at 127.0.0.1:1" in page.text
    assert "order-7" in page.text


# -- settings files and the rate ----------------------------------------------------------------


def test_services_file(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "console.toml"
    path.write_text(
        '[[service]]\nname = "orders"\ndatabase_url_env = "ORDERS_DB"\ngroups = ["payments"]\n'
        '[[service]]\nname = "stock"\ndatabase_url = "postgresql+psycopg://h/stock"\n'
        "shard_count = 8\n"
    )
    services = load_services_file(path, {"ORDERS_DB": URL})
    assert [s.name for s in services] == ["orders", "stock"]
    assert services[0].url == URL and "hunter2" not in repr(services[0])
    assert services[1].shard_count == 8
    with pytest.raises(ConfigurationError, match="ORDERS_DB"):
        load_services_file(path, {})
    path.write_text('[[service]]\nname = "x"\ndatabase_url = "u"\nbogus = 1\n')
    with pytest.raises(ConfigurationError, match="unknown key 'bogus'"):
        load_services_file(path, {})


def test_rate_meter() -> None:
    now = [100.0]
    meter = RateMeter(lambda: now[0])
    assert meter.update("orders", 1000) is None, "first reading: unknown"
    now[0] += 10
    assert meter.update("orders", 1500) == pytest.approx(50.0)
    now[0] += 0.1
    assert meter.update("orders", 1600) == pytest.approx(50.0), "too close: the last rate"
    now[0] += 10
    assert meter.update("orders", 10) is None, "counter went back (relay restarted)"
    now[0] += 1000
    assert meter.update("orders", 20) is None, "too long ago"
    assert meter.update("orders", None) is None


def test_every_service_has_its_section_and_one_down_does_not_hide_the_other() -> None:
    from ledgerbox import DatabaseError
    from ledgerbox._core.faults import Fault

    stock = ServiceTarget(name="stock", database_url="postgresql+psycopg://h/stock")
    down = ServiceData()
    for section in ("status", "held", "dead"):
        down.fail[section] = DatabaseError(
            "the database is unreachable at h:5432/stock: start it", fault=Fault.ENVIRONMENT
        )
    source = InMemorySource({"orders": data(), "stock": down})
    page = client(ConsoleConfig(services=[service(), stock]), source).get("/").text
    orders = page.split('id="service-orders"')[1].split('id="service-stock"')[0]
    assert "order-7" in orders
    other = page.split('id="service-stock"')[1]
    assert other.count("the database is unreachable at h:5432/stock") == 3
    assert "no dead-letter topic configured" in other and "no consumer group configured" in other


def test_shard_ranges() -> None:
    from ledgerbox.console._source import shard_ranges

    assert shard_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert shard_ranges([]) == ""
    assert shard_ranges([3]) == "3"


async def test_the_sections_of_a_service_are_read_at_once() -> None:
    # A broker that never answers costs each Kafka read its request timeout (15 s): read one
    # after the other, the DLQ section then the lag section held the page for 30 s. Here the
    # DLQ read ends only once the lag read has begun, and the lag read once the relay status
    # read has: read in turn, the page never comes (the bound below is a deadlock detector).
    import asyncio

    from ledgerbox.console._view import gather

    started = {name: asyncio.Event() for name in ("status", "lag")}

    class Waiting(InMemorySource):
        async def relay_status(self, target: ServiceTarget) -> RelayPanel:
            started["status"].set()
            return await super().relay_status(target)

        async def dlq_records(self, target: ServiceTarget, dlq_topic: str) -> list[DlqRecord]:
            await started["lag"].wait()
            return await super().dlq_records(target, dlq_topic)

        async def lag(self, target: ServiceTarget, group: str) -> list[PartitionLag]:
            started["lag"].set()
            await started["status"].wait()
            return await super().lag(target, group)

    views = await asyncio.wait_for(
        gather(ConsoleConfig(services=[service()]), Waiting({"orders": data()}), RateMeter()),
        timeout=30,
    )
    (view,) = views
    assert view.dlq["orders.dlq"].value is not None and len(view.dlq["orders.dlq"].value) == 2
    assert view.lag["payments"].value == data().lag["payments"]
    assert view.status.value is not None and view.status.value.pending == 7
