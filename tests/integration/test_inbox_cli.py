"""`ledgerbox consumer check` reports ok / degraded / down through its output and exit code."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check(*args: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGERBOX_INBOX_")}
    done = subprocess.run(
        [sys.executable, "-m", "ledgerbox.inbox", "check", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout.strip()


def state(result: tuple[int, str]) -> tuple[int, str]:
    """``(exit code, the state word)`` of one ``check`` run, which prints ONE line."""
    code, out = result
    assert len(out.splitlines()) == 1, out
    return code, out.split(":", 1)[0]


def test_check_ok_degraded_down(database_url: str, kafka_bootstrap: str, redis_url: str) -> None:
    base = ["--database-url", database_url, "--kafka-bootstrap-servers", kafka_bootstrap]
    assert check(*base, "--redis-url", redis_url) == (0, "ok")
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    assert state(check(*base, "--redis-url", dead_redis)) == (1, "degraded")
    dead_db = f"postgresql+psycopg://postgres:postgres@127.0.0.1:{free_port()}/app"
    down = check("--database-url", dead_db, "--kafka-bootstrap-servers", kafka_bootstrap)
    assert state(down) == (2, "down")
    assert "database at 127.0.0.1" in down[1] and "unreachable" in down[1]
