"""The load generator of the ``demo_pipeline`` benchmark: ``POST /orders`` open-loop.

``python -m bench._pipeline_load --port P --rate R --duration-s S --customers N --seed X
--out FILE`` sends ``R * S`` orders to the order API on ``127.0.0.1:P``, each with its own
``Idempotency-Key``, on a fixed schedule (request ``i`` is due at ``start + i / R``) that never
waits for answers: a request whose time came is sent on a free keep-alive connection, or on a
new one (at most ``--max-connections``; beyond that the request is counted as ``shed``). Its
latency is measured from the time it was DUE, so a stalled server cannot hide its queue
(no coordinated omission). ``--rate 0`` is the closed-loop maximum: ``--max-in-flight``
requests in flight all the time for ``S`` seconds.

Lean on purpose (the benchmark measures the services, not the client): raw HTTP/1.1 over
``asyncio.Protocol`` (uvloop when installed), request bytes built from a template, answers
parsed just enough to read the status and the order id. ~60-100 us of CPU per request here,
against ~4 ms for the demo's httpx client.

Writes to FILE a JSON object: ``sent``, ``answered``, ``shed``, ``errors``, ``statuses``
(code -> count), ``http_ms`` (latency of every answered request), ``order_ids`` (of the 2xx
answers), ``started_at`` / ``ended_at`` (epoch s), ``cpu_s`` (this process, user + system).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import time
import uuid
from collections import deque
from typing import Any

_ID_MARK = b'"id":"'


class _Conn(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, load: _Load) -> None:
        self.load = load
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.due = 0.0
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def send(self, request: bytes, due: float) -> None:
        assert self.transport is not None
        self.busy, self.due = True, due
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(buf[:end]).lower()
        at = head.find(b"content-length:")
        length = 0
        if at >= 0:
            eol = head.find(b"\r\n", at)
            length = int(head[at + 15 : eol if eol >= 0 else len(head)])
        if len(buf) < end + 4 + length:
            return
        status = int(head[9:12])
        body = bytes(buf[end + 4 : end + 4 + length])
        del buf[: end + 4 + length]
        self.busy = False
        self.load.answered(self, status, body)

    def connection_lost(self, exc: Exception | None) -> None:
        self.load.lost(self)


class _Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.loop = asyncio.get_running_loop()
        self.rng = random.Random(args.seed)
        self.customers = [f"c{i:03d}" for i in range(args.customers)]
        self.idle: deque[_Conn] = deque()
        self.conns: set[_Conn] = set()
        self.opening = 0
        self.sent = self.done = self.shed = self.errors = 0
        self.statuses: dict[int, int] = {}
        self.http_ms: list[float] = []
        self.order_ids: list[str] = []
        self.wake = asyncio.Event()
        self.host = f"127.0.0.1:{args.port}".encode()

    def request(self) -> bytes:
        rng = self.rng
        key = uuid.UUID(int=rng.getrandbits(128), version=4)
        body = b'{"customer_id":"%s","amount":"%d.%02d","currency":"EUR"}' % (
            rng.choice(self.customers).encode(),
            *divmod(rng.randint(500, 6000), 100),
        )
        return (
            b"POST /orders HTTP/1.1\r\nHost: %s\r\nIdempotency-Key: %s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (self.host, str(key).encode(), len(body), body)
        )

    def answered(self, conn: _Conn, status: int, body: bytes) -> None:
        self.done += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.http_ms.append((time.monotonic() - conn.due) * 1000.0)
        if status in (200, 201):
            at = body.find(_ID_MARK) + len(_ID_MARK)
            self.order_ids.append(body[at : at + 36].decode())
        self.idle.append(conn)
        self.wake.set()

    def lost(self, conn: _Conn) -> None:
        self.conns.discard(conn)
        if conn in self.idle:
            self.idle.remove(conn)
        if conn.busy:
            self.errors += 1
            self.done += 1
            self.wake.set()

    async def _connect(self) -> None:
        self.opening += 1
        try:
            # asyncio and uvloop both set TCP_NODELAY on the socket.
            _, conn = await self.loop.create_connection(
                lambda: _Conn(self), "127.0.0.1", self.args.port
            )
            self.conns.add(conn)
            self.idle.append(conn)
        except OSError:
            self.errors += 1
        finally:
            self.opening -= 1
            self.wake.set()

    async def send(self, due: float) -> bool:
        """Send one request due at ``due`` on an idle connection (opening one if allowed)."""
        while not self.idle:
            if len(self.conns) + self.opening >= self.args.max_connections:
                return False
            await self._connect()
        conn = self.idle.popleft()
        conn.send(self.request(), due)
        self.sent += 1
        return True

    async def open_loop(self) -> None:
        rate, total = self.args.rate, int(self.args.rate * self.args.duration_s)
        start = time.monotonic()
        for i in range(total):
            due = start + i / rate
            delay = due - time.monotonic()
            if delay > 0.0005:
                await asyncio.sleep(delay)
            if not await self.send(due):
                self.shed += 1

    async def closed_loop(self) -> None:
        end = time.monotonic() + self.args.duration_s
        while time.monotonic() < end:
            while self.sent - self.done < self.args.max_in_flight:
                if not await self.send(time.monotonic()):
                    break
            self.wake.clear()
            await self.wake.wait()

    async def finish(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.done < self.sent and time.monotonic() < deadline:
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                break
        for conn in list(self.conns):
            if conn.transport is not None:
                conn.transport.close()


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    load = _Load(args)
    for _ in range(min(args.max_connections, args.warm_connections)):
        await load._connect()
    started = time.time()
    if args.rate > 0:
        await load.open_loop()
    else:
        await load.closed_loop()
    ended = time.time()
    await load.finish(60.0)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "sent": load.sent,
        "answered": load.done - load.errors,
        "shed": load.shed,
        "errors": load.errors + (load.sent - load.done),
        "statuses": load.statuses,
        "http_ms": [round(v, 2) for v in load.http_ms],
        "order_ids": load.order_ids,
        "started_at": started,
        "ended_at": ended,
        "connections": len(load.conns),
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench._pipeline_load")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rate", type=float, required=True, help="orders/s; 0: closed loop")
    parser.add_argument("--duration-s", type=float, required=True)
    parser.add_argument("--customers", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-connections", type=int, default=256)
    parser.add_argument("--warm-connections", type=int, default=8)
    parser.add_argument("--max-in-flight", type=int, default=64, help="closed loop only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(_main(args))
    else:
        result = uvloop.run(_main(args))
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
