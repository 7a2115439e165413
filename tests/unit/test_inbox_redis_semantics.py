"""In-memory dedup store and aggregate lock keep the Redis semantics; the Redis gate degrades
and recovers once per outage."""

from __future__ import annotations

import logging
import uuid

import pytest

from ledgerbox.inbox import AggregateLock, DedupStore, RedisUnavailableError
from ledgerbox.inbox._gate import RedisGate
from ledgerbox.inbox._metrics import REDIS_DEGRADED
from ledgerbox.inbox.testing import InMemoryAggregateLock, InMemoryDedupStore, ManualClock


async def test_protocols_are_implemented() -> None:
    assert isinstance(InMemoryDedupStore(), DedupStore)
    assert isinstance(InMemoryAggregateLock(), AggregateLock)


async def test_dedup_done_key_expires_and_claim_is_exclusive_with_ttl() -> None:
    clock = ManualClock()
    store = InMemoryDedupStore(clock)
    event = uuid.uuid4()
    assert not await store.is_done("g", event)
    await store.mark_done("g", event, ttl_s=10)
    assert await store.is_done("g", event) and not await store.is_done("other", event)
    clock.advance(10)
    assert not await store.is_done("g", event)  # a hint only: the DB still knows

    assert await store.claim("g", event, "w1", ttl_ms=2000)
    assert not await store.claim("g", event, "w2", ttl_ms=2000)
    await store.unclaim("g", event, "w2")  # not the owner: no effect
    assert not await store.claim("g", event, "w2", ttl_ms=2000)
    clock.advance(2.0)  # w1 crashed: its claim expires, the event is never hidden (C11)
    assert await store.claim("g", event, "w2", ttl_ms=2000)
    await store.unclaim("g", event, "w2")
    assert await store.claim("g", event, "w3", ttl_ms=2000)
    await store.unclaim("g", event, "w3")
    await store.mark_done("g", event, ttl_s=10)
    assert not await store.claim("g", event, "w4", ttl_ms=2000)  # done: nothing to claim


async def test_lock_c09_semantics_and_growing_fencing_tokens() -> None:
    clock = ManualClock()
    lock = InMemoryAggregateLock(clock)
    a = await lock.acquire("order:17", ttl_ms=1000)
    assert a is not None
    assert await lock.acquire("order:17", ttl_ms=1000) is None
    clock.advance(1.2)  # A stalls past its TTL
    b = await lock.acquire("order:17", ttl_ms=1000)
    assert b is not None and b.fencing_token > a.fencing_token
    assert await lock.release(a) is False and await lock.renew(a, 1000) is False
    assert lock.holder("order:17") == b.token
    assert await lock.acquire("order:17", ttl_ms=1000) is None
    clock.advance(0.9)
    assert await lock.renew(b, 1000) is True
    clock.advance(0.9)
    assert await lock.acquire("order:17", ttl_ms=1000) is None  # renewed: still B's
    assert await lock.release(b) is True
    c = await lock.acquire("order:17", ttl_ms=1000)
    assert c is not None and c.fencing_token > b.fencing_token


async def test_unavailable_store_raises_the_typed_error() -> None:
    store, lock = InMemoryDedupStore(), InMemoryAggregateLock()
    store.available = lock.available = False
    with pytest.raises(RedisUnavailableError):
        await store.is_done("g", uuid.uuid4())
    with pytest.raises(RedisUnavailableError):
        await lock.acquire("x", 10)


async def test_gate_logs_once_per_outage_skips_redis_and_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    gate = RedisGate("unit-gate", probe_interval_s=1.0, clock=clock)
    store = InMemoryDedupStore()
    event = uuid.uuid4()
    caplog.set_level(logging.WARNING, logger="ledgerbox.inbox")
    store.available = False
    for _ in range(50):
        assert await gate.call(lambda: store.is_done("g", event), False) is False
    assert gate.degraded and REDIS_DEGRADED.labels("unit-gate")._value.get() == 1
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    assert not gate.usable()  # skipped until the probe interval passed
    store.available = True
    await gate.probe(store.ping)
    assert gate.degraded  # not yet due
    clock.advance(1.0)
    await gate.probe(store.ping)
    assert not gate.degraded and REDIS_DEGRADED.labels("unit-gate")._value.get() == 0
    assert await gate.call(lambda: store.claim("g", event, "w", 100), False) is True
    store.available = False
    await gate.call(lambda: store.ping(), None)
    assert gate.outages == 2


@pytest.mark.parametrize(
    "failure",
    [
        # uvloop (the daemons' loop), a write on a connection that was closed under the
        # client: CI's soak-short on a513e6a, payment-consumer-2 exited 1 with this one.
        RuntimeError(
            "unable to perform operation on <TCPTransport closed=True reading=False "
            "0x56326dfe6200>; the handler is closed"
        ),
        ConnectionResetError(104, "Connection reset by peer"),
        TimeoutError(),
    ],
    ids=["uvloop-closed-transport", "reset", "timeout"],
)
async def test_every_failure_of_the_redis_client_is_redis_unavailable(
    failure: BaseException,
) -> None:
    from ledgerbox.inbox._redis import _guard

    async def call() -> None:
        raise failure

    with pytest.raises(RedisUnavailableError, match=r"^redis: "):
        await _guard(call)
