"""The ops console in a real headless Chromium (Debian's package, driven by Playwright) on
real PostgreSQL and Kafka, with the real relay and the real console as subprocesses and a
real inbox consumer: an event the broker refuses (larger than the topic's
``max.message.bytes``) is dead-lettered and holds its key; the page shows it and the held
key; a dismissed confirm dialog changes nothing; the cause is fixed, replay is clicked and
confirmed; the event and the two held behind it are published in order and applied ONCE
each; the audit trail names the console's actor. Screenshots go to ``.artifacts/console/``
(git-ignored; ``LEDGERBOX_CONSOLE_SCREENSHOT=<path>`` also writes the one of the dead event
there: how docs/console.png is made).

Run with ``make test-browser`` (it installs chromium with scripts/browser.sh); not part of
``make test``. Without chromium or Playwright this test FAILS (it never skips).
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncSession

from ledgerbox.inbox import ConsumerConfig, HandlerContext, InboxConsumer
from ledgerbox.outbox import EventEnvelope, OutboxWriter, TopicRouter
from tests import _relay_support as rs
from tests._inbox_support import poll
from tests._services import delete_at_session_end

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / ".artifacts" / "console"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: The topic refuses records above this (bytes); the dead event is ~3x larger, incompressible.
SMALL_LIMIT = 2048

metadata = sa.MetaData()
applied = sa.Table(
    "console_applied",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("event_id", sa.Text, nullable=False),
    sa.Column("order_id", sa.Text, nullable=False),
    sa.Column("seq", sa.Integer, nullable=False),
)


class Poison(Exception):
    """The handler's bug of the test: dead-lettered at once (``dead_letter_on``)."""


def chromium() -> str:
    """The chromium executable (scripts/browser.sh installs it); fails, never skips."""
    path = os.environ.get("LEDGERBOX_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).is_file():
        pytest.fail(f"no chromium at {path}: run `bash scripts/browser.sh` (make test-browser)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def set_max_message_bytes(bootstrap: str, topic: str, value: int, *, create: bool) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    client = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=30000)
    await client.start()
    try:
        configs = {"max.message.bytes": str(value)}
        if create:
            await client.create_topics(
                [NewTopic(topic, num_partitions=1, replication_factor=1, topic_configs=configs)]
            )
        else:
            await client.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs)])
    finally:
        await client.close()


def order(
    writer: OutboxWriter, order_id: str, seq: int, *, big: bool = False, poison: bool = False
) -> EventEnvelope:
    payload: dict[str, Any] = {"order_id": order_id, "seq": seq, "poison": poison}
    if big:  # random bytes: lz4 cannot shrink them under the topic's limit
        payload["blob"] = base64.b64encode(os.urandom(SMALL_LIMIT * 3)).decode()
    return writer.event(
        event_type="OrderPlaced",
        aggregate_type="order",
        aggregate_id=order_id,
        aggregate_version=seq,
        payload=payload,
        idempotency_key=f"{order_id}:{seq}:{uuid.uuid4().hex}",
    )


def outbox_status(engine: Engine, topic: str) -> list[tuple[str, int, int]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT partition_key, aggregate_version, status FROM outbox"
                " WHERE topic = :t ORDER BY id"
            ),
            {"t": topic},
        ).all()
    return [(str(k), int(v), int(s)) for k, v, s in rows]


def applied_rows(engine: Engine) -> list[tuple[str, int, str]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(applied.c.order_id, applied.c.seq, applied.c.event_id).order_by(applied.c.id)
        ).all()
    return [(r[0], r[1], r[2]) for r in rows]


def start_console(database_url: str, kafka: str, port: int, metrics_port: int, group: str,
                  topic: str) -> subprocess.Popen[bytes]:  # fmt: skip
    env = {
        **os.environ,
        "LEDGERBOX_CONSOLE_DATABASE_URL": database_url,
        "LEDGERBOX_CONSOLE_KAFKA_BOOTSTRAP_SERVERS": kafka,
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ledgerbox",
            "console",
            "--service-name",
            "orders",
            "--port",
            str(port),
            "--groups",
            group,
            "--dlq-topics",
            f"{topic}.dlq",
            "--relay-metrics",
            f"http://127.0.0.1:{metrics_port}/metrics",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def wait_http(url: str, proc: subprocess.Popen[bytes], within_s: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise AssertionError(f"the console exited with {proc.returncode}: {err}")
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} did not answer within {within_s} s")
            await asyncio.sleep(0.2)


@pytest_asyncio.fixture
async def consumer_running(database_url: str, kafka_bootstrap: str) -> AsyncIterator[Any]:
    started: list[tuple[InboxConsumer, asyncio.Task[None]]] = []

    async def start(topic: str, group: str, fixed: dict[str, bool]) -> InboxConsumer:
        consumer = InboxConsumer(
            ConsumerConfig(
                group_id=group,
                topics=[topic],
                database_url=database_url,
                kafka_bootstrap_servers=kafka_bootstrap,
                commit_interval_ms=20,
                dead_letter_on=[Poison],
            )
        )

        @consumer.handler("OrderPlaced")
        async def apply(ctx: HandlerContext[AsyncSession], event: EventEnvelope) -> None:
            if event.payload.get("poison") and not fixed["handler"]:
                raise Poison(f"order {event.payload['order_id']} cannot be applied yet")
            await ctx.session.execute(
                sa.insert(applied).values(
                    event_id=str(event.event_id),
                    order_id=event.payload["order_id"],
                    seq=event.payload["seq"],
                )
            )

        started.append((consumer, asyncio.create_task(consumer.run())))
        return consumer

    yield start
    for consumer, _ in started:
        consumer.stop()
    for _, task in started:
        await asyncio.wait_for(task, 60)


@pytest.mark.timeout(240)
async def test_console_shows_a_dead_event_and_its_replay_is_applied_once(
    database_url: str, engine: Engine, kafka_bootstrap: str, consumer_running: Any
) -> None:
    from playwright.async_api import async_playwright

    started = time.monotonic()
    executable = chromium()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    metadata.create_all(engine)
    topic = f"console-{uuid.uuid4().hex[:12]}"
    group = f"console-g-{uuid.uuid4().hex[:8]}"
    delete_at_session_end(kafka_bootstrap, topic, f"{topic}.dlq")
    await set_max_message_bytes(kafka_bootstrap, topic, SMALL_LIMIT, create=True)
    writer = OutboxWriter(TopicRouter(default=topic), source="/console-test")
    metrics_port, console_port = free_port(), free_port()
    relay = rs.relay_process(database_url, kafka_bootstrap, "--metrics-port", str(metrics_port))
    console = start_console(database_url, kafka_bootstrap, console_port, metrics_port, group, topic)
    base = f"http://127.0.0.1:{console_port}"
    try:
        fixed = {"handler": False}
        await consumer_running(topic, group, fixed)
        dead = order(writer, "order-1", 1, big=True)
        rs.stage(engine, writer, [dead])

        async def is_dead() -> bool:
            return outbox_status(engine, topic) == [("order-1", 1, 2)]

        await poll(is_dead, "the oversized event dead-lettered", within_s=60)
        rs.stage(engine, writer, [order(writer, "order-1", 2), order(writer, "order-1", 3)])
        rs.stage(engine, writer, [order(writer, "order-2", 1)])
        # The inbox side: the handler cannot apply order-3 (until "fixed"): dead-lettered to
        # the DLQ with the group's header.
        poisoned = order(writer, "order-3", 1, poison=True)
        rs.stage(engine, writer, [poisoned])

        async def held_and_other_applied() -> bool:
            statuses = [s for _, _, s in outbox_status(engine, topic)]
            return statuses == [2, 3, 3, 0, 0] and [(o, s) for o, s, _ in applied_rows(engine)] == [
                ("order-2", 1)
            ]

        await poll(held_and_other_applied, "order-1 held behind its dead event, order-2 applied")
        await wait_http(f"{base}/healthz", console)

        async with async_playwright() as pw:
            profile = tempfile.mkdtemp(prefix="ledgerbox-chromium-")
            browser = await pw.chromium.launch_persistent_context(
                profile,
                executable_path=executable,
                headless=True,
                args=CHROMIUM_FLAGS,
                viewport={"width": 1400, "height": 1000},
            )
            try:
                page = await browser.new_page()
                response = await page.goto(base + "/")
                assert response is not None and response.status == 200
                await asyncio.sleep(1.0)
                await page.reload()  # a second reading of the relay's counter: the rate
                section = page.locator("#service-orders")
                dlq_row = section.locator("table.dlq-records tr[data-ref]")
                deadline = time.monotonic() + 60
                while not await dlq_row.count():
                    assert time.monotonic() < deadline, "no DLQ record on the page within 60 s"
                    await asyncio.sleep(0.5)
                    await page.goto(base + "/")
                row = section.locator(f'table.dead-events tr[data-id="{_dead_id(engine, topic)}"]')
                await row.wait_for()
                assert "order-1" in await row.inner_text()
                assert "MessageSizeTooLarge" in await row.inner_text()
                held = section.locator('table.held-keys tr[data-key="order-1"]')
                assert "2" in await held.locator("td").nth(3).inner_text(), "2 held behind"
                assert await page.locator("#orders-dead-count .value").inner_text() == "1"
                assert await page.locator("#orders-held-count .value").inner_text() == "2"
                lag = section.locator(f'table.lag[data-group="{group}"]')
                await lag.wait_for()
                shot = ARTIFACTS / "01-dead-event-and-dlq-record.png"
                await page.screenshot(path=str(shot), full_page=True)
                docs_shot = os.environ.get("LEDGERBOX_CONSOLE_SCREENSHOT")
                if docs_shot:
                    await page.screenshot(path=docs_shot, full_page=True)

                # The confirm dialog: dismissed, nothing happens.
                dialogs: list[str] = []
                answer = {"accept": False}

                async def on_dialog(dialog: Any) -> None:
                    dialogs.append(dialog.message)
                    await (dialog.accept() if answer["accept"] else dialog.dismiss())

                page.on("dialog", on_dialog)
                await row.locator("button.replay").click()
                await asyncio.sleep(0.5)
                assert len(dialogs) == 1 and "Replay dead event" in dialogs[0]
                assert "2 events held behind it" in dialogs[0]
                assert outbox_status(engine, topic)[0][2] == 2, "dismissed: still dead"
                assert _audit_count(engine) == 0

                # Fix the cause (the topic takes 1 MiB records again), then replay for real.
                await set_max_message_bytes(kafka_bootstrap, topic, 1 << 20, create=False)
                answer["accept"] = True
                async with page.expect_navigation():
                    await row.locator("button.replay").click()
                flash_box = page.locator("#flash")
                if not await flash_box.count():
                    raise AssertionError(f"no result shown after replay: {await page.content()}")
                flash = await flash_box.inner_text()
                assert "replay" in flash and "audit #" in flash, flash
                await page.screenshot(path=str(ARTIFACTS / "02-replayed.png"), full_page=True)

                async def all_applied() -> bool:
                    return len(applied_rows(engine)) >= 4

                await poll(all_applied, "the replayed event and the held ones applied", 90)
                await asyncio.sleep(1.0)  # a duplicate delivery would land within this
                rows = applied_rows(engine)
                assert [(o, s) for o, s, _ in rows if o != "order-3"] == [
                    ("order-2", 1),
                    ("order-1", 1),
                    ("order-1", 2),
                    ("order-1", 3),
                ], "each applied once, order-1 in its order"
                assert rows[1][2] == str(dead.event_id), "replayed with its original event id"
                assert [s for _, _, s in outbox_status(engine, topic)] == [0, 0, 0, 0, 0]

                # The inbox side: the page lists order-3's DLQ record with its group; the bug
                # fixed, replay from the page runs the handler once more, for this group only.
                await page.goto(base + "/")
                text = await dlq_row.inner_text()
                assert group in text and str(poisoned.event_id) in text and "Poison" in text
                await page.screenshot(path=str(ARTIFACTS / "03-dlq-record.png"), full_page=True)
                assert [o for o, _, _ in applied_rows(engine)].count("order-3") == 0
                fixed["handler"] = True
                async with page.expect_navigation():
                    await dlq_row.locator("button.replay").click()
                assert "Replay" in dialogs[-1] and group in dialogs[-1]
                flash = await page.locator("#flash").inner_text()
                assert "consumer.dlq.replay" in flash, flash

                async def dlq_applied() -> bool:
                    return [o for o, _, _ in applied_rows(engine)].count("order-3") >= 1

                await poll(dlq_applied, "the replayed DLQ record applied", 60)
                await asyncio.sleep(1.0)
                rows = applied_rows(engine)
                assert [(o, e) for o, _, e in rows if o == "order-3"] == [
                    ("order-3", str(poisoned.event_id))
                ], "applied once, with its event id"

                await page.goto(base + "/")
                assert "no dead event" in await section.inner_text()
                assert "no key is held" in await section.inner_text()
                assert not await dlq_row.count(), "a replayed DLQ record is no longer listed"
                assert await page.locator("#orders-dead-count .value").inner_text() == "0"
                assert "total" in await lag.inner_text(), await section.inner_text()
                total = await lag.locator("tr").last.locator("th").last.inner_text()
                assert total == "0", "the group consumed everything"
                await page.screenshot(path=str(ARTIFACTS / "04-after-replays.png"), full_page=True)
            finally:
                await browser.close()
                shutil.rmtree(profile, ignore_errors=True)
        actor = _audit_actors(engine)
        assert actor == ["console:127.0.0.1", "console:127.0.0.1"], actor
    finally:
        rs.stop_process(console)
        rs.stop_process(relay)
    duration = time.monotonic() - started
    print(f"console browser test: {duration:.1f} s, screenshots in {ARTIFACTS}")


def _dead_id(engine: Engine, topic: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT id FROM outbox WHERE topic = :t AND status = 2"), {"t": topic}
            ).scalar_one()
        )


def _audit_count(engine: Engine) -> int:
    return len(_audit_actors(engine))


def _audit_actors(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return [
            str(a)
            for a in conn.execute(
                sa.text("SELECT actor FROM ledgerbox_ops_audit ORDER BY id")
            ).scalars()
        ]
