"""``ledgerbox console`` as a real process (uvicorn), no services needed: with a token, every
request without it gets 401 and the bearer token opens the page; a database that does not
answer is one line in its section, the page still loads; a port in use is one line and exit
2 (docs/console.md, "Access")."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
TOKEN = "acceptance-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def console(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    # A database port nothing listens on: every section fails at once with a refused connection.
    closed = free_port()
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ledgerbox",
            "console",
            "--database-url",
            f"postgresql+psycopg://ops:hunter2@127.0.0.1:{closed}/orders",
            "--service-name",
            "orders",
            *args,
        ],
        cwd=REPO,
        env={**os.environ, "DATABASE_URL": "", "KAFKA_BOOTSTRAP_SERVERS": "", **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_up(base: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (
            f"console exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"
        )
        try:
            if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "console did not start within 60 s"
        time.sleep(0.2)


@pytest.fixture
def with_token() -> Iterator[str]:
    port = free_port()
    proc = console("--port", str(port), env={"LEDGERBOX_CONSOLE_TOKEN": TOKEN})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(base, proc)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_token_is_required_on_every_request_when_set(with_token: str) -> None:
    assert httpx.get(with_token + "/").status_code == 401
    assert httpx.get(with_token + "/", headers={"Authorization": "Bearer nope"}).status_code == 401
    post = httpx.post(with_token + "/services/orders/dead/replay", data={"ids": "1"})
    assert post.status_code == 401
    page = httpx.get(with_token + "/", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert page.status_code == 200
    # The database does not answer: each section says so in one line; the URL never shows.
    assert "DatabaseError" in page.text or "StoreError" in page.text, page.text
    assert "hunter2" not in page.text


def test_a_port_in_use_is_one_line_and_exit_2() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = console("--port", str(port))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    last = err.strip().splitlines()[-1]
    assert f"cannot listen on 127.0.0.1:{port}" in last, err
    assert "hunter2" not in err


def test_a_port_in_use_is_the_first_and_only_line() -> None:
    """Reviewer finding: the start-up lines ("console on ...", uvicorn's "Started server
    process", "Application startup complete") were logged before the bind failed. The port
    is bound before anything is logged: stderr is the one line, with the fix."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = console("--port", str(port))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.strip().splitlines() == [
        f"ledgerbox console: cannot listen on 127.0.0.1:{port} (the port is in use): stop what "
        "holds it, or set another --port"
    ], err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--database-url", "mysql://u:hunter2@x/y"],
         "service default: database_url is not a PostgreSQL URL: give "),
        (["--database-url", "postgresql+psycopg://u:hunter2@x:70000/y"],
         "service default: database_url has a port that is not a TCP port"),
        (["--services-file", "{file}"],
         "services file {file}, service 1 ('a'): database_url is not a PostgreSQL URL: give "),
        (["--database-url", "postgresql+psycopg://u:hunter2@x/y", "--relay-metrics",
          "http://127.0.0.1:70000/metrics"],
         "service default: relay_metrics 'http://127.0.0.1:70000/metrics' must be an "
         "http(s)://host[:port]/metrics URL"),
    ],
    ids=["mysql", "port", "services-file", "relay-metrics-port"],
)  # fmt: skip
def test_a_url_that_can_never_work_is_refused_at_start_in_one_line(
    args: list[str], said: str, tmp_path: Path
) -> None:
    # Before: the console started and every section showed the error (README and
    # docs/console.md promise a refusal at start).
    file = tmp_path / "services.toml"
    file.write_text('[[service]]\nname = "a"\ndatabase_url = "mysql://x/y"\n')
    result = subprocess.run(
        [sys.executable, "-m", "ledgerbox", "console", "--port", str(free_port()),
         *(a.format(file=file) for a in args)],
        cwd=REPO, env={**os.environ, "DATABASE_URL": "", "KAFKA_BOOTSTRAP_SERVERS": ""},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("ledgerbox console: " + said.format(file=file)), lines[0]
    assert "hunter2" not in result.stderr + result.stdout


@pytest.mark.parametrize(("host", "shown"), [("127.0.0.1", "127.0.0.1"), ("::1", "[::1]")])
def test_the_start_line_names_the_port_bound_and_brackets_an_ipv6_host(
    host: str, shown: str
) -> None:
    # Before: --port 0 logged "console on http://127.0.0.1:0/", IPv6 "http://::1:8090/".
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    proc = console("--port", "0", "--host", host)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    start = f"console on http://{shown}:"
    assert start in line, line
    port = int(line.split(start, 1)[1].split("/", 1)[0])
    assert port != 0, line
