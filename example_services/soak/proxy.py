"""A userspace TCP fault proxy (asyncio): latency, jitter, bandwidth, resets, black-holes.

This kernel has no ``netem`` (``tc qdisc ... netem`` fails), so the soak puts this proxy
between the daemons and Kafka, PostgreSQL and Redis. One :class:`FaultProxy` serves several
named :class:`Link` objects; each listens on ``127.0.0.1:<listen_port>`` and forwards every
accepted connection to its target. Faults are set per link, and apply to current and new
connections:

- ``latency_ms`` + ``jitter_ms``: each chunk read is delivered ``latency +- jitter`` ms later
  (uniform jitter; delivery order is kept, as TCP keeps it: a chunk is never delivered before
  the one read before it).
- ``bandwidth_bps``: at most that many bytes per second per direction of each connection.
- ``reset()``: every current connection is closed with a TCP RST on both sides
  (``SO_LINGER`` 0); the link keeps accepting.
- ``blackhole()``: a partition that neither refuses nor answers. Nothing is forwarded in
  either direction; new connections are accepted and held without connecting upstream.
  Bytes are held, not thrown away: when the black-hole is cleared they flow on in order, as
  TCP retransmission delivers them once a real partition heals (dropping bytes inside a TCP
  stream would be stream corruption, which no network shows an application). A peer that
  gives up closes its end; the proxy passes the close on when the link heals.
- ``refuse()``: the listening socket is closed (the kernel answers RST to a SYN: connection
  refused) and current connections are reset; ``clear()`` listens again.
- ``clear()``: no fault.

A target that refuses the proxy's upstream connection (a stopped broker) makes the proxy reset
that client's connection and stop listening until the target accepts again (probed every
0.3 s): clients then see "connection refused", as they would without the proxy, instead of a
connect-then-reset per attempt (aiokafka retries every 50 ms; accepting each attempt only to
reset it cost the proxy a core).

Control: :class:`FaultProxy` in-process, or ``serve()`` with a JSON-lines control port and
:class:`ProxyControl` (async) / :func:`control` (sync) as clients. CLI::

    python -m example_services.soak.proxy serve --control-port 9420 \\
        --link pg=9412:127.0.0.1:5463 --link kafka-1=9406:127.0.0.1:9403
    python -m example_services.soak.proxy ctl --control-port 9420 latency kafka --ms 200 \\
        --jitter-ms 50
    python -m example_services.soak.proxy ctl --control-port 9420 clear '*'

A link selector is a link name, a prefix before ``-`` (``kafka`` selects ``kafka-1`` ...) or
``*`` (all). Only 127.0.0.1 is ever bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import socket
import struct
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = [
    "FaultProxy",
    "Link",
    "LinkFaults",
    "LinkSpec",
    "ProxyControl",
    "control",
    "parse_link",
    "serve",
]

HOST = "127.0.0.1"
CHUNK_BYTES = 65_536
#: Chunks queued per direction of a connection before the proxy stops reading (backpressure).
QUEUE_CHUNKS = 64
CONNECT_TIMEOUT_S = 5.0

Mode = Literal["pass", "blackhole", "refuse"]


@dataclass
class LinkFaults:
    """The faults of one link; the default is none.

    ``latency_ms``/``jitter_ms`` in milliseconds (>= 0, jitter <= latency keeps delays >= 0),
    ``bandwidth_bps`` in bytes per second per direction per connection (``None``: unlimited).
    """

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_bps: int | None = None
    mode: Mode = "pass"


@dataclass(frozen=True)
class LinkSpec:
    """``name`` listens on ``127.0.0.1:listen_port`` and forwards to ``target_host:target_port``."""

    name: str
    listen_port: int
    target_host: str
    target_port: int


def parse_link(text: str) -> LinkSpec:
    """``name=LISTEN_PORT:TARGET_PORT`` or ``name=LISTEN_PORT:TARGET_HOST:TARGET_PORT``.

    Raises
    ------
    ValueError
        If the text does not have that form.
    """
    name, sep, rest = text.partition("=")
    parts = rest.split(":")
    if not sep or not name or len(parts) not in (2, 3):
        raise ValueError(f"link {text!r}: expected name=LISTEN:[HOST:]PORT")
    host = parts[1] if len(parts) == 3 else HOST
    return LinkSpec(name, int(parts[0]), host, int(parts[-1]))


@dataclass
class _Stats:
    accepted: int = 0
    active: int = 0
    resets: int = 0
    upstream_failures: int = 0
    target_down_periods: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


def _rst(writer: asyncio.StreamWriter | None) -> None:
    """Close with a TCP RST (SO_LINGER on, 0 s), not a FIN."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Connection:
    """One proxied connection: two pumps (client -> target "up", target -> client "down")."""

    def __init__(self, link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.link = link
        self.client_reader = reader
        self.client_writer = writer
        self.upstream_writer: asyncio.StreamWriter | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    async def run(self) -> None:
        link = self.link
        up: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue(QUEUE_CHUNKS)
        # Read from the client at once (held while black-holed), connect upstream once passing.
        reading_up = asyncio.create_task(self._read(self.client_reader, up, "up"))
        self._tasks.append(reading_up)
        try:
            await link.passing()
            if self._closed:  # reset while held
                return
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(link.spec.target_host, link.spec.target_port),
                    CONNECT_TIMEOUT_S,
                )
            except (OSError, TimeoutError) as exc:
                link.stats.upstream_failures += 1
                self.abort()
                if isinstance(exc, ConnectionRefusedError):
                    link.target_refused()
                return
            self.upstream_writer = up_writer
            down: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue(QUEUE_CHUNKS)
            self._tasks += [
                asyncio.create_task(self._write(up, up_writer, "up")),
                asyncio.create_task(self._read(up_reader, down, "down")),
                asyncio.create_task(self._write(down, self.client_writer, "down")),
            ]
            await asyncio.gather(*self._tasks, return_exceptions=True)
        except OSError:
            self.abort()
        finally:
            self.close()

    async def _read(
        self, reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes | None]], _: str
    ) -> None:
        last_due = 0.0
        while True:
            try:
                chunk = await reader.read(CHUNK_BYTES)
            except OSError:
                self.abort()
                return
            faults = self.link.faults
            delay = faults.latency_ms
            if faults.jitter_ms:
                delay += random.uniform(-faults.jitter_ms, faults.jitter_ms)
            now = time.monotonic()
            last_due = max(last_due, now + max(0.0, delay) / 1000.0)
            await queue.put((last_due, chunk or None))
            if not chunk:
                return

    async def _write(
        self,
        queue: asyncio.Queue[tuple[float, bytes | None]],
        writer: asyncio.StreamWriter,
        direction: str,
    ) -> None:
        while True:
            due, chunk = await queue.get()
            await self.link.passing()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await self.link.passing()
            if chunk is None:
                with contextlib.suppress(OSError):
                    if writer.can_write_eof():
                        writer.write_eof()
                return
            bps = self.link.faults.bandwidth_bps
            if bps:
                await asyncio.sleep(len(chunk) / bps)
            try:
                writer.write(chunk)
                await writer.drain()
            except OSError:
                self.abort()
                return
            if direction == "up":
                self.link.stats.bytes_up += len(chunk)
            else:
                self.link.stats.bytes_down += len(chunk)

    def abort(self) -> None:
        """RST both sides and stop the pumps."""
        if self._closed:
            return
        _rst(self.client_writer)
        _rst(self.upstream_writer)
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        for writer in (self.client_writer, self.upstream_writer):
            if writer is not None:
                writer.transport.close()
        self.link.forget(self)


class Link:
    """One listening port forwarded to one target, with its faults (see the module doc)."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self.faults = LinkFaults()
        self.stats = _Stats()
        self._server: asyncio.Server | None = None
        self._conns: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._pass = asyncio.Event()
        self._pass.set()
        self._probe: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    async def start(self) -> None:
        """Listen (no-op if listening)."""
        if self._server is None:
            self._server = await asyncio.start_server(
                self._accept, HOST, self.spec.listen_port, reuse_address=True
            )

    async def stop(self) -> None:
        """Stop listening and reset every connection."""
        if self._probe is not None:
            self._probe.cancel()
        await self._close_server()
        self.reset()

    def target_refused(self) -> None:
        """The target refused a connection: refuse too until it accepts again."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._follow_target())

    async def _follow_target(self) -> None:
        self.stats.target_down_periods += 1
        await self._close_server()
        while True:
            await asyncio.sleep(0.3)
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.spec.target_host, self.spec.target_port), 2.0
                )
            except (OSError, TimeoutError):
                continue
            writer.close()
            break
        if self.faults.mode != "refuse":
            await self.start()

    async def passing(self) -> None:
        """Return once the link forwards (immediately unless black-holed or refusing)."""
        await self._pass.wait()

    def set(
        self,
        *,
        latency_ms: float | None = None,
        jitter_ms: float | None = None,
        bandwidth_bps: int | Literal[-1] | None = -1,
    ) -> None:
        """Set latency/jitter (ms) and/or the bandwidth (bytes/s; ``None`` unlimited).

        Raises
        ------
        ValueError
            On a negative value or a jitter above the latency.
        """
        latency = self.faults.latency_ms if latency_ms is None else float(latency_ms)
        jitter = self.faults.jitter_ms if jitter_ms is None else float(jitter_ms)
        if latency < 0 or jitter < 0 or jitter > latency:
            raise ValueError("need 0 <= jitter_ms <= latency_ms")
        if bandwidth_bps != -1:
            if bandwidth_bps is not None and bandwidth_bps <= 0:
                raise ValueError("bandwidth_bps must be > 0 (or None: unlimited)")
            self.faults.bandwidth_bps = bandwidth_bps
        self.faults.latency_ms, self.faults.jitter_ms = latency, jitter

    def blackhole(self) -> None:
        self.faults.mode = "blackhole"
        self._pass.clear()

    async def refuse(self) -> None:
        self.faults.mode = "refuse"
        self._pass.clear()
        await self._close_server()
        self.reset()

    def reset(self) -> int:
        """RST every current connection; returns how many."""
        conns = list(self._conns)
        for conn in conns:
            conn.abort()
        self.stats.resets += len(conns)
        return len(conns)

    async def clear(self) -> None:
        """No fault: no delay, no limit, forwarding, listening."""
        self.faults = LinkFaults()
        await self.start()
        self._pass.set()

    def status(self) -> dict[str, Any]:
        return {
            "listen_port": self.spec.listen_port,
            "target": f"{self.spec.target_host}:{self.spec.target_port}",
            "faults": asdict(self.faults),
            "listening": self._server is not None,
            "target_down": self._probe is not None and not self._probe.done(),
            **asdict(self.stats),
        }

    def forget(self, conn: _Connection) -> None:
        if conn in self._conns:
            self._conns.discard(conn)
            self.stats.active = len(self._conns)

    async def _close_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.faults.mode == "refuse":
            _rst(writer)
            return
        conn = _Connection(self, reader, writer)
        self._conns.add(conn)
        self.stats.accepted += 1
        self.stats.active = len(self._conns)
        await conn.run()


class FaultProxy:
    """Several links in one event loop; :meth:`select` resolves a link selector."""

    def __init__(self, specs: Iterable[LinkSpec]) -> None:
        self.links = {spec.name: Link(spec) for spec in specs}

    async def start(self) -> None:
        for link in self.links.values():
            await link.start()

    async def stop(self) -> None:
        for link in self.links.values():
            await link.stop()

    def select(self, selector: str) -> list[Link]:
        """Links named ``selector``, or ``selector-*``, or all for ``*``.

        Raises
        ------
        KeyError
            If no link matches.
        """
        chosen = [
            link
            for name, link in self.links.items()
            if selector in ("*", name) or name.startswith(f"{selector}-")
        ]
        if not chosen:
            raise KeyError(f"no link matches {selector!r} (links: {sorted(self.links)})")
        return chosen

    async def apply(self, command: dict[str, Any]) -> dict[str, Any]:
        """Run one control command (the JSON of the control port); returns the answer."""
        op = command.get("op")
        if op == "status":
            return {"ok": True, "links": {n: link.status() for n, link in self.links.items()}}
        links = self.select(str(command.get("link", "")))
        done = 0
        for link in links:
            if op == "set":
                link.set(
                    latency_ms=command.get("latency_ms"),
                    jitter_ms=command.get("jitter_ms"),
                    bandwidth_bps=command.get("bandwidth_bps", -1),
                )
            elif op == "blackhole":
                link.blackhole()
            elif op == "refuse":
                await link.refuse()
            elif op == "reset":
                done += link.reset()
            elif op == "clear":
                await link.clear()
            else:
                raise ValueError(f"unknown op {op!r}")
        return {"ok": True, "links": [link.name for link in links], "reset": done}


async def _control_client(
    proxy: FaultProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        while line := await reader.readline():
            try:
                answer = await proxy.apply(json.loads(line))
            except (KeyError, ValueError, TypeError) as exc:
                answer = {"ok": False, "error": str(exc)}
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def serve(specs: Iterable[LinkSpec], control_port: int, stop: asyncio.Event) -> None:
    """Run the proxy and its JSON-lines control port on 127.0.0.1 until ``stop`` is set."""
    proxy = FaultProxy(specs)
    await proxy.start()
    server = await asyncio.start_server(
        lambda r, w: _control_client(proxy, r, w), HOST, control_port, reuse_address=True
    )
    try:
        await stop.wait()
    finally:
        server.close()
        await proxy.stop()


@dataclass
class ProxyControl:
    """Async client of a proxy's control port (one short connection per command)."""

    port: int
    host: str = HOST
    timeout_s: float = 5.0
    calls: int = field(default=0, repr=False)

    async def call(self, op: str, link: str = "*", **params: Any) -> dict[str, Any]:
        """Send one command; returns the answer.

        Raises
        ------
        RuntimeError
            If the proxy answered ``ok: false``.
        OSError, TimeoutError
            If the control port does not answer.
        """
        self.calls += 1
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port), self.timeout_s
        )
        try:
            writer.write(json.dumps({"op": op, "link": link, **params}).encode() + b"\n")
            await writer.drain()
            answer: dict[str, Any] = json.loads(
                await asyncio.wait_for(reader.readline(), self.timeout_s)
            )
        finally:
            writer.close()
        if not answer.get("ok"):
            raise RuntimeError(f"proxy refused {op} {link}: {answer.get('error')}")
        return answer

    async def latency(self, link: str, latency_ms: float, jitter_ms: float = 0.0) -> None:
        await self.call("set", link, latency_ms=latency_ms, jitter_ms=jitter_ms)

    async def bandwidth(self, link: str, bandwidth_bps: int | None) -> None:
        await self.call("set", link, bandwidth_bps=bandwidth_bps)

    async def blackhole(self, link: str) -> None:
        await self.call("blackhole", link)

    async def refuse(self, link: str) -> None:
        await self.call("refuse", link)

    async def reset(self, link: str) -> int:
        return int((await self.call("reset", link))["reset"])

    async def clear(self, link: str = "*") -> None:
        await self.call("clear", link)

    async def status(self) -> dict[str, Any]:
        links: dict[str, Any] = (await self.call("status"))["links"]
        return links


def control(port: int, op: str, link: str = "*", **params: Any) -> dict[str, Any]:
    """Synchronous :meth:`ProxyControl.call` (for the CLI and for scripts)."""
    return asyncio.run(ProxyControl(port).call(op, link, **params))


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m example_services.soak.proxy")
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve", help="run the proxy until SIGTERM/SIGINT")
    srv.add_argument("--control-port", type=int, required=True)
    srv.add_argument("--link", action="append", type=parse_link, default=[], required=True)
    ctl = sub.add_parser("ctl", help="send one command to a running proxy")
    ctl.add_argument("--control-port", type=int, required=True)
    ctl.add_argument(
        "op", choices=("status", "latency", "bandwidth", "blackhole", "refuse", "reset", "clear")
    )
    ctl.add_argument("link", nargs="?", default="*")
    ctl.add_argument("--ms", type=float, default=0.0, help="latency, ms")
    ctl.add_argument("--jitter-ms", type=float, default=0.0)
    ctl.add_argument("--bps", type=int, default=None, help="bytes/s (omit: unlimited)")
    args = parser.parse_args(argv)
    if args.command == "serve":

        async def run() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, stop.set)
            await serve(args.link, args.control_port, stop)

        asyncio.run(run())
        return 0
    params: dict[str, Any] = {}
    op = args.op
    if op == "latency":
        op, params = "set", {"latency_ms": args.ms, "jitter_ms": args.jitter_ms}
    elif op == "bandwidth":
        op, params = "set", {"bandwidth_bps": args.bps}
    try:
        answer = control(args.control_port, op, args.link, **params)
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"proxy ctl: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
