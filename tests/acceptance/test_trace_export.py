"""`ledgerbox relay run` exports its batch span when the OTEL_* variables ask for it
(docs/observability.md, "Export"); a bad exporter setting is one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sqlalchemy import Engine

from tests import _relay_support as rs
from tests._inbox_support import poll
from tests._services import TopicFactory


async def test_relay_run_writes_its_send_span_to_the_file_exporter(
    tmp_path: Path,
    engine: Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: TopicFactory,
) -> None:
    rs.reset_relay_tables(engine)
    topic = await new_topic.acreate("trace-export", partitions=1)
    writer = rs.writer_for(topic)
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    rs.stage(engine, writer, [rs.event(writer, "k", 1, headers={"traceparent": traceparent})])
    spans = tmp_path / "spans.jsonl"
    env = {
        "OTEL_TRACES_EXPORTER": "ledgerbox_file",
        "LEDGERBOX_OTEL_FILE": str(spans),
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    proc = rs.relay_process(database_url, kafka_bootstrap, env=env)
    try:

        async def published() -> bool:
            return rs.pending_count(engine) == 0

        await poll(published, "the relay published the event")
    finally:
        assert rs.stop_process(proc) == 0
    found = [json.loads(line) for line in spans.read_text().splitlines()]
    sends = [s for s in found if s["name"] == f"send {topic}"]
    assert len(sends) == 1, [s["name"] for s in found]
    (send,) = sends
    assert send["kind"] == "SpanKind.PRODUCER"
    assert send["resource"]["attributes"]["service.name"] == "ledgerbox-relay"
    assert [link["context"]["trace_id"] for link in send["links"]] == [
        "0x4bf92f3577b34da6a3ce929d0e0e4736"
    ]


def test_an_unknown_exporter_is_one_line_and_exit_2(database_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ledgerbox.relay", "run"],
        env={
            "PATH": "/usr/bin:/bin",
            "DATABASE_URL": database_url,
            "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
            "OTEL_TRACES_EXPORTER": "nope",
        },
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "unknown exporter 'nope'" in lines[0], lines
