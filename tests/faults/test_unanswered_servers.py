"""A server that accepts the connection and never answers (a host that is down behind a
load balancer, a firewall that drops packets, a wrong port of another service): every
command and engine ledgerbox opens gives up after its timeout with ONE line naming the
server and the fix, instead of waiting for the kernel's TCP retries.

The server here is a real local socket that listens and never speaks; the commands run as a
user runs them (subprocesses, the console script). Before ``CONNECT_TIMEOUT_S``,
``ledgerbox consumer dlq list`` against such a database printed nothing for over 120 s
(killed by the test's timeout), ``migrate`` printed two lines with SQLAlchemy's link, and
``consumer lag`` against such a broker said ``KafkaConnectionError: KafkaConnectionError:
Unable to bootstrap from [('127.0.0.1', ..., <AddressFamily.AF_INET: 2>)]``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from ledgerbox.inbox import ConsumerConfig, InboxConsumer

LEDGERBOX = [sys.executable, "-m", "ledgerbox"]

#: Far under the kernel's ~127 s of SYN retries, far over CONNECT_TIMEOUT_S and Kafka's
#: 15 s request timeout: a command that waits for the kernel fails here.
GIVE_UP_S = 60

pytestmark = pytest.mark.timeout(GIVE_UP_S + 30)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never sends a byte."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1])
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        server.close()


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LEDGERBOX_", "PG"))}
    return subprocess.run(
        [*LEDGERBOX, *args],
        capture_output=True,
        text=True,
        timeout=GIVE_UP_S,
        env={**base, **env},
        check=False,
    )


@pytest.mark.parametrize(
    "command",
    [
        ["consumer", "dlq", "list", "--dlq-topic", "orders.dlq"],
        ["relay", "dead", "list"],
        ["migrate"],
    ],
    ids=["consumer-dlq-list", "relay-dead-list", "migrate"],
)
def test_a_command_gives_up_a_database_that_never_answers_in_one_line(
    command: list[str], silent_port: int
) -> None:
    where = f"127.0.0.1:{silent_port}"
    result = _run(
        *command,
        env={
            "DATABASE_URL": f"postgresql+psycopg://app:secret@{where}/app",
            # A broker that refuses at once: only the database is waited for.
            "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
        },
    )
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert f"the database at {where}/app is unreachable" in lines[0], lines
    assert f"start the server at {where}" in lines[0], lines
    assert "secret" not in result.stderr


def test_consumer_lag_gives_up_a_broker_that_never_answers_with_the_fix(
    silent_port: int,
) -> None:
    where = f"127.0.0.1:{silent_port}"
    result = _run("consumer", "lag", "--group", "payments", env={"KAFKA_BOOTSTRAP_SERVERS": where})
    assert result.returncode == 2, result
    assert result.stderr.splitlines() == [
        "ledgerbox consumer lag: reading the lag of group 'payments' failed: Kafka is "
        f"unreachable at {where} (no bootstrap server answered): start it, or fix "
        "--kafka-bootstrap-servers / KAFKA_BOOTSTRAP_SERVERS"
    ]


async def test_the_consumer_engines_give_up_a_database_that_never_answers(
    silent_port: int,
) -> None:
    # The engines a consumer builds for its handlers' transactions: a connection attempt
    # fails after CONNECT_TIMEOUT_S (the runner then retries it with backoff, health down)
    # instead of holding the record for the kernel's TCP retries.
    consumer = InboxConsumer(
        ConsumerConfig(
            group_id="unanswered",
            topics=["orders"],
            database_url=f"postgresql+psycopg://app:secret@127.0.0.1:{silent_port}/app",
            kafka_bootstrap_servers="127.0.0.1:1",
        )
    )
    try:
        with pytest.raises(sa.exc.OperationalError, match="timeout"):
            async with consumer.async_engine.connect():
                pass
        with pytest.raises(sa.exc.OperationalError, match="timeout"), consumer.engine.connect():
            pass
    finally:
        await consumer.aclose()
