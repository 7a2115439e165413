"""In-memory implementations of the inbox's edges, for unit tests (yours and ours).

They keep the semantics of the real ones (TTL, compare-and-delete, fencing tokens that only
grow) on an injectable clock, and can simulate an outage: set ``available = False`` and every
call raises :class:`inbox.RedisUnavailableError`, as the Redis implementations do.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ledgerbox.inbox._errors import RedisUnavailableError
from ledgerbox.inbox._redis import LockLease, new_token
from ledgerbox.outbox import EventEnvelope
from ledgerbox.outbox._envelope import dumps_payload
from ledgerbox.outbox._wire import envelope_headers

__all__ = [
    "FakeRecord",
    "InMemoryAggregateLock",
    "InMemoryDeadLetterPublisher",
    "InMemoryDedupStore",
    "ManualClock",
    "kafka_parts",
    "record_for",
]


class ManualClock:
    """A clock for tests: ``now_s()`` returns what you set; ``advance(seconds)`` moves it."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now = start_s

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``."""
        self.now += seconds


class _Expiring:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.values: dict[str, tuple[str, float | None]] = {}

    def get(self, key: str) -> str | None:
        item = self.values.get(key)
        if item is None:
            return None
        value, expires_at = item
        if expires_at is not None and self.clock() >= expires_at:
            del self.values[key]
            return None
        return value

    def set(self, key: str, value: str, ttl_s: float | None, *, nx: bool = False) -> bool:
        if nx and self.get(key) is not None:
            return False
        self.values[key] = (value, None if ttl_s is None else self.clock() + ttl_s)
        return True

    def delete(self, key: str) -> None:
        self.values.pop(key, None)


class InMemoryDedupStore:
    """:class:`inbox.DedupStore` in a dict, with TTLs on ``clock`` (seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._data = _Expiring(clock)
        self.available = True

    def _check(self) -> None:
        if not self.available:
            raise RedisUnavailableError("in-memory dedup store is switched off")

    async def is_done(self, group: str, event_id: uuid.UUID) -> bool:
        self._check()
        return self._data.get(f"done:{group}:{event_id}") is not None

    async def mark_done(self, group: str, event_id: uuid.UUID, ttl_s: float) -> None:
        self._check()
        self._data.set(f"done:{group}:{event_id}", "1", ttl_s)

    async def done_among(self, group: str, event_ids: list[uuid.UUID]) -> set[uuid.UUID]:
        self._check()
        return {e for e in event_ids if self._data.get(f"done:{group}:{e}") is not None}

    async def mark_done_many(self, group: str, event_ids: list[uuid.UUID], ttl_s: float) -> None:
        self._check()
        for e in event_ids:
            self._data.set(f"done:{group}:{e}", "1", ttl_s)

    async def claim(self, group: str, event_id: uuid.UUID, owner: str, ttl_ms: int) -> bool:
        self._check()
        if self._data.get(f"done:{group}:{event_id}") is not None:
            return False  # as the Redis store: a done event is not claimed
        return self._data.set(f"busy:{group}:{event_id}", owner, ttl_ms / 1000, nx=True)

    async def unclaim(self, group: str, event_id: uuid.UUID, owner: str) -> None:
        self._check()
        key = f"busy:{group}:{event_id}"
        if self._data.get(key) == owner:
            self._data.delete(key)

    async def ping(self) -> None:
        self._check()


class InMemoryAggregateLock:
    """:class:`inbox.AggregateLock` in a dict, with TTLs on ``clock`` (seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._locks = _Expiring(clock)
        self._fences: dict[str, int] = {}
        self.available = True

    def _check(self) -> None:
        if not self.available:
            raise RedisUnavailableError("in-memory aggregate lock is switched off")

    async def acquire(self, name: str, ttl_ms: int) -> LockLease | None:
        self._check()
        token = new_token()
        if not self._locks.set(name, token, ttl_ms / 1000, nx=True):
            return None
        fence = self._fences.get(name, 0) + 1
        self._fences[name] = fence
        return LockLease(name=name, token=token, fencing_token=fence)

    async def renew(self, lease: LockLease, ttl_ms: int) -> bool:
        self._check()
        if self._locks.get(lease.name) != lease.token:
            return False
        self._locks.set(lease.name, lease.token, ttl_ms / 1000)
        return True

    async def release(self, lease: LockLease) -> bool:
        self._check()
        if self._locks.get(lease.name) != lease.token:
            return False
        self._locks.delete(lease.name)
        return True

    async def ping(self) -> None:
        self._check()

    def holder(self, name: str) -> str | None:
        """The owner token currently stored for ``name`` (``None``: free)."""
        return self._locks.get(name)


@dataclass
class InMemoryDeadLetterPublisher:
    """:class:`inbox.DeadLetterPublisher` that keeps records in ``records``."""

    records: list[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]]]] = field(
        default_factory=list
    )

    async def publish(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]],
    ) -> None:
        self.records.append((topic, key, value, list(headers)))

    async def aclose(self) -> None:
        return None


@dataclass(frozen=True)
class FakeRecord:
    """The fields of ``aiokafka.ConsumerRecord`` that :meth:`InboxConsumer.process_record` reads."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]] = ()


def kafka_parts(event: EventEnvelope) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """The Kafka key, value and headers the relay writes for ``event``."""
    headers = envelope_headers(event)
    return event.partition_key.encode("utf-8"), dumps_payload(event.payload), headers


def record_for(event: EventEnvelope, *, partition: int = 0, offset: int = 0) -> FakeRecord:
    """A :class:`FakeRecord` carrying ``event`` as the relay would publish it."""
    key, value, headers = kafka_parts(event)
    return FakeRecord(event.topic, partition, offset, key, value, tuple(headers))
