"""A database server that vanishes without closing its connections (a host lost in a
failover, a dropped NAT entry) must not hold a connection ledgerbox opened for ever.

Nothing on this machine can drop packets (no netem, no netfilter), so what is checked is the
kernel state that makes the connection fail: the socket of each kind of connection has TCP
keepalive probes after 10 s of silence (every 5 s, 3 unanswered) and a 30 s user timeout
(``ledgerbox._core.database_url.TCP_ARGS``). Before, the consumers' engines had the kernel's
defaults (first probe after 2 hours: a query whose answer never came held the partition for
ever), and the URL's own settings must still win.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from ledgerbox._core.database_url import TCP_ARGS
from ledgerbox.inbox import ConsumerConfig, InboxConsumer
from ledgerbox.relay._pgstore import PgRelayStore
from tests import _relay_support as rs

_OPTIONS = {
    "keepalives_idle": socket.TCP_KEEPIDLE,
    "keepalives_interval": socket.TCP_KEEPINTVL,
    "keepalives_count": socket.TCP_KEEPCNT,
    "tcp_user_timeout": getattr(socket, "TCP_USER_TIMEOUT", 18),  # Linux: 18
}


def _tcp(fd: int) -> dict[str, int]:
    """What the kernel holds for the socket ``fd``: SO_KEEPALIVE and the TCP settings."""
    sock = socket.socket(fileno=socket.dup(fd))
    try:
        found = {"keepalives": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)}
        for name, option in _OPTIONS.items():
            found[name] = sock.getsockopt(socket.IPPROTO_TCP, option)
        return found
    finally:
        sock.close()


def _tcp_url(database_url: str) -> str:
    """The test database over TCP on 127.0.0.1 (a Unix socket has no TCP settings)."""
    url = sa.engine.make_url(database_url)
    return url.set(host="127.0.0.1").render_as_string(hide_password=False)


def _consumer(database_url: str, **extra: Any) -> InboxConsumer:
    return InboxConsumer(
        ConsumerConfig(
            group_id="dead-peer",
            topics=["dead-peer"],
            database_url=database_url,
            kafka_bootstrap_servers="127.0.0.1:9",
            **extra,
        )
    )


async def _async_fd(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        raw = await conn.get_raw_connection()
        return _tcp(raw.driver_connection.pgconn.socket)  # type: ignore[union-attr]


async def test_consumer_connections_notice_a_vanished_server(database_url: str) -> None:
    consumer = _consumer(_tcp_url(database_url))
    try:
        assert await _async_fd(consumer.async_engine) == TCP_ARGS
        with consumer.engine.connect() as conn:
            raw = conn.connection.driver_connection
            assert _tcp(raw.pgconn.socket) == TCP_ARGS  # type: ignore[union-attr]
    finally:
        await consumer.aclose()


async def test_relay_connections_notice_a_vanished_server(
    database_url: str, kafka_bootstrap: str
) -> None:
    store = PgRelayStore(rs.config(_tcp_url(database_url), kafka_bootstrap), "main")
    try:
        session = await store._connection()
        assert _tcp(session.pgconn.socket) == TCP_ARGS
    finally:
        await store.aclose()


@pytest.mark.parametrize("given", ["keepalives_idle=60", "tcp_user_timeout=5000"])
async def test_a_setting_in_the_database_url_wins(database_url: str, given: str) -> None:
    name, value = given.split("=")
    url = _tcp_url(database_url)
    consumer = _consumer(url + ("&" if "?" in url else "?") + given)
    try:
        assert await _async_fd(consumer.async_engine) == {**TCP_ARGS, name: int(value)}
    finally:
        await consumer.aclose()
