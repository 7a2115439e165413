"""PostgreSQL TLS settings in the database URL reach psycopg unchanged: in the relay (its libpq
URL) and in the consumer (SQLAlchemy hands the query to ``psycopg.connect``), so
``sslmode=verify-full`` and the certificate paths work as libpq documents them
(docs/security.md, "PostgreSQL"). The real TLS connection: tests/security/test_tls_services.py.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from ledgerbox.relay import RelayConfig
from ledgerbox.relay._pgstore import PgRelayStore

TLS = (
    "sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem&sslcert=/etc/ssl/c.crt"
    "&sslkey=/etc/ssl/c.key"
)


class _Refused(Exception):
    pass


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    async def fake_connect(*args: Any, **kwargs: Any) -> Any:
        seen.append((args, kwargs))
        raise _Refused

    monkeypatch.setattr(psycopg.AsyncConnection, "connect", fake_connect)
    return seen


async def test_the_relay_passes_the_url_query_to_libpq_unchanged(
    connects: list[tuple[tuple[Any, ...], dict[str, Any]]],
) -> None:
    config = RelayConfig(
        database_url=f"postgresql+psycopg://relay:pw@db.example:5432/app?{TLS}",
        kafka_bootstrap_servers="k:9092",
    )
    store = PgRelayStore(config, "main")
    with pytest.raises(_Refused):
        await store.ping()
    ((args, _kwargs),) = connects
    assert args == (f"postgresql://relay:pw@db.example:5432/app?{TLS}",)
    parsed = psycopg.conninfo.conninfo_to_dict(args[0])
    assert parsed["sslmode"] == "verify-full" and parsed["sslrootcert"] == "/etc/ssl/db-ca.pem"
    assert parsed["sslcert"] == "/etc/ssl/c.crt" and parsed["sslkey"] == "/etc/ssl/c.key"


async def test_the_consumer_engine_passes_the_url_query_to_psycopg(
    connects: list[tuple[tuple[Any, ...], dict[str, Any]]],
) -> None:
    engine = create_async_engine(f"postgresql+psycopg://app:pw@db.example:5432/app?{TLS}")
    try:
        with pytest.raises(_Refused):
            async with engine.connect():
                pass
    finally:
        await engine.dispose()
    ((args, kwargs),) = connects
    given = {**kwargs, **(psycopg.conninfo.conninfo_to_dict(args[0]) if args else {})}
    assert given["sslmode"] == "verify-full"
    assert given["sslrootcert"] == "/etc/ssl/db-ca.pem"
    assert (given["sslcert"], given["sslkey"]) == ("/etc/ssl/c.crt", "/etc/ssl/c.key")
