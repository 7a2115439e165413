"""A lean HTTP/1.1 client for the demo's and the soak's load: keep-alive connections to one
``127.0.0.1:port``, JSON bodies, one request per connection at a time.

Why not httpx: its request path costs ~4 ms of CPU per request on this machine (measured in
the demo: 8.2 CPU seconds for ~2,000 POSTs), as much as the API it drives; this client costs
a few hundred microseconds, so the load generator no longer competes with the services for
the two cores (docs/performance.md, "Example services").
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import Any

__all__ = ["HttpError", "HttpPool"]


class HttpError(Exception):
    """A transport failure (connect, reset, timeout, malformed answer)."""


class HttpPool:
    """Keep-alive HTTP/1.1 connections to one ``127.0.0.1:port`` (JSON bodies only)."""

    def __init__(self, port: int, size: int, timeout_s: float = 15.0) -> None:
        self.port = port
        self.timeout_s = timeout_s
        self._idle: deque[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = deque()
        self._slots = asyncio.Semaphore(size)

    async def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """Send one request; returns ``(status, parsed JSON body or None)``.

        Raises
        ------
        HttpError
            On any transport failure or timeout (the connection is dropped).
        """
        async with self._slots:
            conn = self._idle.popleft() if self._idle else None
            try:
                if conn is None:
                    conn = await asyncio.wait_for(
                        asyncio.open_connection("127.0.0.1", self.port), self.timeout_s
                    )
                status, keep, data = await asyncio.wait_for(
                    self._exchange(conn, method, path, body, headers or {}), self.timeout_s
                )
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
                if conn is not None:
                    conn[1].transport.abort()
                raise HttpError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
            if keep:
                self._idle.append(conn)
            else:
                conn[1].close()
        try:
            return status, json.loads(data) if data else None
        except ValueError:
            return status, None

    async def _exchange(
        self,
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        method: str,
        path: str,
        body: Any,
        headers: dict[str, str],
    ) -> tuple[int, bool, bytes]:
        reader, writer = conn
        payload = b"" if body is None else json.dumps(body).encode()
        head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{self.port}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        if body is not None:
            head += ["Content-Type: application/json"]
        head += [f"Content-Length: {len(payload)}", "", ""]
        writer.write("\r\n".join(head).encode() + payload)
        await writer.drain()
        status_line = await reader.readuntil(b"\r\n")
        status = int(status_line.split(b" ", 2)[1])
        length, keep = 0, True
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection" and value.strip().lower() == "close":
                keep = False
            elif name == "transfer-encoding":
                raise ValueError("chunked answers are not supported")
        data = await reader.readexactly(length) if length else b""
        return status, keep, data

    def close(self) -> None:
        while self._idle:
            self._idle.popleft()[1].close()
