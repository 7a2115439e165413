"""How ``scripts/services.sh`` tells that a cluster broker it launched is ready: a line
"has been unfenced" (or "Kafka Server started") logged since the launch, wherever log4j has
put it. A busy broker logs 20 MB in minutes and log4j then renames server.log to server.log.1:
CI once waited 90 s for a broker that had been ready for minutes, because the readiness
check read server.log from the byte offset it had at the launch and the line was in
server.log.1 (soak-short, ``services.sh start-broker 1: not ready after 90s``).

The function is run from the sourced script (bash and awk only, no service).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import time
from pathlib import Path

from tests._services import SERVICES_SCRIPT

READY = "has been unfenced|Kafka Server started"
UNFENCED = "INFO [BrokerLifecycleManager id=1] The broker has been unfenced. (kafka.server.x)"


def _logged_since_start(state: Path, pattern: str = READY) -> bool:
    proc = subprocess.run(
        [
            "bash",
            "-c",
            f'source "{SERVICES_SCRIPT}"; node_logged_since_start broker 1 "$1"',
            "-",
            pattern,
        ],
        env=dict(os.environ, OUTBOX_SERVICES_DIR=str(state)),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode == 0


def _logs(state: Path) -> Path:
    logs = state / "kafka-cluster" / "broker-1" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return logs


def _line(stamp: str, text: str) -> str:
    return f"[{stamp}] {text}\n"


def test_the_ready_line_is_found_after_log4j_rolled_it_into_server_log_1(tmp_path: Path) -> None:
    logs = _logs(tmp_path)
    (logs / ".start-time").write_text("2026-12-01 23:33:48,000\n")
    time.sleep(0.05)
    (logs / "server.log.1").write_text(
        _line("2026-12-01 23:33:40,000", "INFO earlier run, before the kill (kafka.x)")
        + _line("2026-12-01 23:33:50,967", UNFENCED)
    )
    (logs / "server.log").write_text(
        _line("2026-12-01 23:34:10,521", "INFO ISR updated (kafka.cluster.Partition)")
    )
    assert _logged_since_start(tmp_path)


def test_a_ready_line_of_an_earlier_launch_does_not_count(tmp_path: Path) -> None:
    logs = _logs(tmp_path)
    (logs / ".start-time").write_text("2026-12-01 23:33:48,000\n")
    time.sleep(0.05)
    (logs / "server.log").write_text(
        _line("2026-12-01 23:30:02,100", UNFENCED)  # the launch before: then killed
        + _line("2026-12-01 23:33:49,000", "INFO Loaded 130 logs in 2800ms (kafka.log.LogManager)")
        + "  at the broker has been unfenced (a continuation line is not a stamped line)\n"
    )
    assert not _logged_since_start(tmp_path)
    with (logs / "server.log").open("a") as f:
        f.write(
            _line(
                "2026-12-01 23:33:51,059",
                "INFO [KafkaRaftServer nodeId=1] Kafka Server started (k)",
            )
        )
    assert _logged_since_start(tmp_path)


def test_a_rolled_file_last_written_before_the_launch_is_not_read(tmp_path: Path) -> None:
    logs = _logs(tmp_path)
    old = logs / "server.log.2"
    old.write_text(_line("2099-01-01 00:00:00,000", UNFENCED))  # stamped late, written early
    past = time.time() - 3600
    os.utime(old, (past, past))
    (logs / ".start-time").write_text("2026-12-01 23:33:48,000\n")
    (logs / "server.log").write_text(_line("2026-12-01 23:33:49,000", "INFO starting (kafka.x)"))
    assert not _logged_since_start(tmp_path)


def test_no_launch_recorded_means_not_ready(tmp_path: Path) -> None:
    logs = _logs(tmp_path)
    (logs / "server.log").write_text(_line("2026-12-01 23:33:51,059", UNFENCED))
    assert not _logged_since_start(tmp_path)


def test_a_line_starting_with_a_bracket_but_no_stamp_does_not_count(tmp_path: Path) -> None:
    # Before: any line starting with "[" was taken as stamped, and "[B..." compares later
    # than every "[2026-..." stamp: a multi-line message quoting the ready line (or a line of
    # an earlier launch in another layout) made a broker that was not ready count as ready.
    logs = _logs(tmp_path)
    (logs / ".start-time").write_text("2026-12-01 23:33:48,000\n")
    time.sleep(0.05)
    (logs / "server.log").write_text(
        _line("2026-12-01 23:33:49,000", "INFO a message of two lines: (kafka.x)")
        + "[BrokerLifecycleManager id=1] The broker has been unfenced (quoted)\n"
        + "[2026-12-01T23:40:00,000] INFO The broker has been unfenced. (another layout)\n"
    )
    assert not _logged_since_start(tmp_path)
    with (logs / "server.log").open("a") as f:
        f.write(_line("2026-12-01 23:33:51,059", UNFENCED))
    assert _logged_since_start(tmp_path)


def test_a_broker_launched_without_a_start_stamp_gets_its_process_start(tmp_path: Path) -> None:
    # A broker still running from a script before .start-time existed: `up` found it running,
    # wrote no stamp, and waited 90 s for a line it could never match (reviewer, F8a). Its
    # launch is now its process's start (/proc), the stamp's mtime set to it.
    logs = _logs(tmp_path)
    stamp = logs / ".start-time"
    proc = subprocess.run(
        [
            "bash",
            "-c",
            f'source "{SERVICES_SCRIPT}"; proc_start_stamp $$ "$1"; echo $$',
            "-",
            stamp,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    pid = int(proc.stdout.strip())
    text = stamp.read_text().strip()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,000", text), text
    started = dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,000").replace(tzinfo=dt.UTC)
    now = dt.datetime.now(dt.UTC)
    assert dt.timedelta(0) <= now - started < dt.timedelta(hours=1), (pid, started, now)
    assert abs(stamp.stat().st_mtime - started.timestamp()) < 1
    # The broker's log, written since, is read: its ready line counts.
    (logs / "server.log").write_text(
        _line((started - dt.timedelta(seconds=5)).strftime("%Y-%m-%d %H:%M:%S,000"), UNFENCED)
    )
    assert not _logged_since_start(tmp_path)  # before the process started: an earlier launch
    with (logs / "server.log").open("a") as f:
        f.write(_line(now.strftime("%Y-%m-%d %H:%M:%S,%f")[:23], UNFENCED))
    assert _logged_since_start(tmp_path)
