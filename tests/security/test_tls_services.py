"""PostgreSQL over TLS (``sslmode=verify-full`` in the URL reaches libpq in the relay and psycopg
under SQLAlchemy in the consumer, and the server sees TLS connections) and Redis with an ACL
user, ``requirepass`` and ``rediss://`` (docs/security.md, "PostgreSQL", "Redis")."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from ledgerbox.inbox import ConsumerConfig, RedisDedupStore, RedisUnavailableError
from ledgerbox.inbox._checks import check_consumer
from ledgerbox.inbox._redis import redis_client
from ledgerbox.relay import RelayConfig, StoreError
from ledgerbox.relay._pgstore import pg_store_factory
from tests.security import _support as s

pytestmark = pytest.mark.timeout(120)

TLS_QUERY = (
    "SELECT s.ssl, s.version FROM pg_stat_ssl AS s JOIN pg_stat_activity AS a USING (pid) "
    "WHERE a.application_name = :name"
)


def _admin_scalar(url: str, query: str, **params: str) -> object:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(query), params).one()
    finally:
        engine.dispose()


async def test_postgres_verify_full_is_tls_for_the_relay_and_the_consumer(
    sec: s.Secured, database_url: str, kafka_bootstrap: str
) -> None:
    url = f"{database_url}?sslmode=verify-full&sslrootcert={sec.ca}"
    config = RelayConfig(database_url=url, kafka_bootstrap_servers=kafka_bootstrap)
    role = f"tls{uuid.uuid4().hex[:6]}"
    store = pg_store_factory(config)(role)
    try:
        await store.ping()
        ssl, version = _admin_scalar(database_url, TLS_QUERY, name=f"ledgerbox-relay-{role}")  # type: ignore[misc]
    finally:
        await store.aclose()
    assert ssl is True and str(version).startswith("TLS"), version
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            query = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
            assert (await conn.execute(sa.text(query))).scalar_one() is True
    finally:
        await engine.dispose()
    consumer = ConsumerConfig(
        group_id="g", topics=["t"], database_url=url, kafka_bootstrap_servers=kafka_bootstrap
    )
    result = await check_consumer(consumer, check_topics=False, check_redis=False)
    assert result.state == "ok", result.line


async def test_postgres_refuses_a_server_certificate_it_cannot_verify(
    sec: s.Secured, database_url: str, kafka_bootstrap: str
) -> None:
    # The client certificate is not a CA: verify-full must fail, and say so without the URL.
    url = f"{database_url}?sslmode=verify-full&sslrootcert={sec.file('client.pem')}"
    config = RelayConfig(database_url=url, kafka_bootstrap_servers=kafka_bootstrap)
    store = pg_store_factory(config)("tlsbad")
    with pytest.raises(StoreError) as caught:
        await store.ping()
    await store.aclose()
    assert "certificate verify failed" in str(caught.value)
    assert "postgres@" not in str(caught.value) and ":postgres" not in str(caught.value)


@pytest.mark.parametrize("tls", [False, True], ids=["acl-user", "rediss"])
async def test_redis_logs_in_with_the_acl_user_and_over_tls(sec: s.Secured, tls: bool) -> None:
    url = sec.redis_url(tls=tls)
    client = redis_client(url, timeout_s=3, ca_file=sec.ca if tls else None)
    try:
        store = RedisDedupStore(client, f"sec:{uuid.uuid4().hex[:6]}:")
        await store.ping()
        event = uuid.uuid4()
        await store.mark_done("g", event, 30)
        assert await store.is_done("g", event)
        me = await client.execute_command("CLIENT", "INFO")
        text = me.decode() if isinstance(me, bytes) else str(me)
        port = sec.redis_tls_port if tls else sec.redis_auth_port
        assert f"laddr=127.0.0.1:{port} " in text and f"user={sec.user} " in text, text
    finally:
        await client.aclose()


async def test_redis_refusals_name_the_cause_never_the_password(sec: s.Secured) -> None:
    wrong = sec.redis_url(tls=False, password="not-the-redis-password")
    client = redis_client(wrong, timeout_s=3)
    with pytest.raises(RedisUnavailableError) as caught:
        await RedisDedupStore(client).ping()
    await client.aclose()
    assert "AuthenticationError" in str(caught.value)
    assert "not-the-redis-password" not in str(caught.value)
    # rediss:// without the CA: the server's certificate is not trusted.
    client = redis_client(sec.redis_url(tls=True), timeout_s=3)
    with pytest.raises(RedisUnavailableError) as caught:
        await RedisDedupStore(client).ping()
    await client.aclose()
    assert "certificate verify failed" in str(caught.value), caught.value
    assert sec.redis_password not in str(caught.value)


async def test_consumer_check_with_a_secured_redis(
    sec: s.Secured, database_url: str, kafka_bootstrap: str
) -> None:
    base = ["--database-url", database_url, "--kafka-bootstrap-servers", kafka_bootstrap]
    good = [*base, "--redis-url", sec.redis_url(tls=True), "--redis-ssl-cafile", sec.ca]
    code, out = await asyncio.to_thread(s.run, ["consumer", "check", *good], s.clean_env())
    assert (code, out.strip()) == (0, "ok"), out
    bad = [*base, "--redis-url", sec.redis_url(tls=False, password="not-the-redis-password")]
    code, out = await asyncio.to_thread(s.run, ["consumer", "check", *bad], s.clean_env())
    assert code == 1 and s.lines(out) == [
        "degraded: redis unreachable (redis: AuthenticationError: invalid username-password "
        "pair or user is disabled.): consumers stay correct on the database alone, slower; "
        "start redis or fix redis_url"
    ], out
