"""The soak's fault proxy on real sockets (127.0.0.1): every fault does what it says.

Each test runs an echo server behind one link and measures what a client sees: bytes and
half-close pass unchanged; latency and jitter delay without reordering; bandwidth is capped;
reset is a TCP RST; a black-hole accepts and holds (no answer, no refusal) and delivers the
held bytes in order once cleared; refuse is a real ECONNREFUSED; the control port and CLI
drive the same operations. Bounded: every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from example_services.demo._procs import free_port
from example_services.soak.proxy import FaultProxy, Link, LinkSpec, ProxyControl, parse_link, serve
from tests._services import REPO_ROOT

pytestmark = pytest.mark.timeout(60)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
    except OSError:
        pass
    finally:
        writer.close()


@pytest_asyncio.fixture
async def link() -> AsyncIterator[Link]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    target = server.sockets[0].getsockname()[1]
    proxy = FaultProxy([LinkSpec("echo", free_port(), "127.0.0.1", target)])
    await proxy.start()
    try:
        yield proxy.links["echo"]
    finally:
        await proxy.stop()
        server.close()


async def _connect(link: Link) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", link.spec.listen_port), timeout=5
    )


async def _roundtrip(link: Link, payload: bytes) -> bytes:
    reader, writer = await _connect(link)
    writer.write(payload)
    writer.write_eof()
    data = await asyncio.wait_for(reader.read(), timeout=20)
    writer.close()
    return data


async def test_bytes_and_half_close_pass_unchanged(link: Link) -> None:
    payload = bytes(range(256)) * 4000  # 1 MB, many chunks
    assert await _roundtrip(link, payload) == payload
    assert link.stats.bytes_up == len(payload) == link.stats.bytes_down


async def test_latency_delays_each_direction_and_clear_removes_it(link: Link) -> None:
    link.set(latency_ms=150)
    reader, writer = await _connect(link)
    started = time.monotonic()
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), timeout=5) == b"ping"
    rtt = time.monotonic() - started
    assert 0.3 <= rtt < 1.5, f"round trip {rtt:.3f} s with 150 ms each way"
    await link.clear()
    started = time.monotonic()
    writer.write(b"pong")
    assert await asyncio.wait_for(reader.readexactly(4), timeout=5) == b"pong"
    assert time.monotonic() - started < 0.1
    writer.close()


async def test_jitter_never_reorders_bytes(link: Link) -> None:
    link.set(latency_ms=40, jitter_ms=40)
    reader, writer = await _connect(link)
    messages = [f"{i:05d}".encode() for i in range(100)]
    for message in messages:
        writer.write(message)
        await writer.drain()
        await asyncio.sleep(0.002)  # separate chunks, each with its own random delay
    got = await asyncio.wait_for(reader.readexactly(5 * len(messages)), timeout=10)
    assert got == b"".join(messages)
    writer.close()


async def test_bandwidth_caps_bytes_per_second(link: Link) -> None:
    link.set(bandwidth_bps=200_000)
    payload = b"x" * 200_000
    started = time.monotonic()
    assert await _roundtrip(link, payload) == payload
    took = time.monotonic() - started
    # 200 kB up and 200 kB down, each direction capped at 200 kB/s, pipelined: >= ~1 s.
    assert 0.9 <= took < 10, f"{took:.2f} s"


async def test_reset_sends_rst_and_link_keeps_accepting(link: Link) -> None:
    reader, writer = await _connect(link)
    writer.write(b"a")
    assert await asyncio.wait_for(reader.readexactly(1), timeout=5) == b"a"
    assert link.reset() == 1
    with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)) as caught:
        await asyncio.wait_for(reader.readexactly(1), timeout=5)
    assert isinstance(caught.value, ConnectionResetError), repr(caught.value)
    writer.close()
    assert await _roundtrip(link, b"again") == b"again"


async def test_blackhole_holds_without_answer_or_refusal_then_delivers_in_order(
    link: Link,
) -> None:
    old_reader, old_writer = await _connect(link)
    link.blackhole()
    new_reader, new_writer = await _connect(link)  # accepted: not refused
    old_writer.write(b"held-1")
    new_writer.write(b"held-2")
    for reader in (old_reader, new_reader):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), timeout=0.7)
    assert link.stats.bytes_up == 0
    await link.clear()
    assert await asyncio.wait_for(old_reader.readexactly(6), timeout=5) == b"held-1"
    assert await asyncio.wait_for(new_reader.readexactly(6), timeout=5) == b"held-2"
    for writer in (old_writer, new_writer):
        writer.close()


async def test_refuse_is_connection_refused_until_cleared(link: Link) -> None:
    reader, writer = await _connect(link)
    await link.refuse()
    with pytest.raises(ConnectionResetError):
        writer.write(b"x")
        await writer.drain()
        await asyncio.wait_for(reader.readexactly(1), timeout=5)
    with pytest.raises(ConnectionRefusedError):
        await _connect(link)
    await link.clear()
    assert await _roundtrip(link, b"back") == b"back"


async def test_a_refusing_target_is_refused_by_the_link_until_it_is_back() -> None:
    target_port = free_port()
    proxy = FaultProxy([LinkSpec("dead", free_port(), "127.0.0.1", target_port)])
    await proxy.start()
    link = proxy.links["dead"]
    try:
        reader, writer = await _connect(link)  # accepted before the proxy knows
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(reader.readexactly(1), timeout=10)
        writer.close()
        assert link.stats.upstream_failures == 1
        with pytest.raises(ConnectionRefusedError):
            await _connect(link)  # from now on refused, like the target itself
        server = await asyncio.start_server(_echo, "127.0.0.1", target_port)
        try:
            for _ in range(100):
                if link.status()["listening"]:
                    break
                await asyncio.sleep(0.05)
            assert await _roundtrip(link, b"up again") == b"up again"
            assert link.stats.target_down_periods == 1
        finally:
            server.close()
    finally:
        await proxy.stop()


async def test_control_port_selects_links_by_prefix_and_reports_errors() -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    target = server.sockets[0].getsockname()[1]
    specs = [LinkSpec(f"kafka-{i}", free_port(), "127.0.0.1", target) for i in (1, 2)]
    specs.append(LinkSpec("pg", free_port(), "127.0.0.1", target))
    port, stop = free_port(), asyncio.Event()
    serving = asyncio.create_task(serve(specs, port, stop))
    ctl = ProxyControl(port)
    try:
        for _ in range(50):
            try:
                await ctl.status()
                break
            except OSError:
                await asyncio.sleep(0.05)
        await ctl.latency("kafka", 120, 10)
        await ctl.bandwidth("pg", 5000)
        status = await ctl.status()
        assert status["kafka-1"]["faults"]["latency_ms"] == 120
        assert status["kafka-2"]["faults"]["jitter_ms"] == 10
        assert status["pg"]["faults"] == {
            "latency_ms": 0.0,
            "jitter_ms": 0.0,
            "bandwidth_bps": 5000,
            "mode": "pass",
        }
        await ctl.blackhole("*")
        assert {s["faults"]["mode"] for s in (await ctl.status()).values()} == {"blackhole"}
        await ctl.clear()
        assert {s["faults"]["mode"] for s in (await ctl.status()).values()} == {"pass"}
        with pytest.raises(RuntimeError, match="no link matches"):
            await ctl.reset("redis")
        with pytest.raises(RuntimeError, match="jitter"):
            await ctl.latency("pg", 10, 50)
    finally:
        stop.set()
        await asyncio.wait_for(serving, timeout=5)
        server.close()


def test_cli_serves_and_answers_ctl() -> None:
    port, listen = free_port(), free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "example_services.soak.proxy", "serve"),
            *("--control-port", str(port), "--link", f"x={listen}:1"),
        ],
        cwd=REPO_ROOT,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            out = subprocess.run(
                [
                    *(sys.executable, "-m", "example_services.soak.proxy", "ctl"),
                    *("--control-port", str(port), "latency", "x", "--ms", "30"),
                ],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["links"] == ["x"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_parse_link() -> None:
    assert parse_link("pg=9412:5463") == LinkSpec("pg", 9412, "127.0.0.1", 5463)
    assert parse_link("k=1:localhost:2") == LinkSpec("k", 1, "localhost", 2)
    with pytest.raises(ValueError, match="expected"):
        parse_link("pg:9412")
