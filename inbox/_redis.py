"""The Redis edges of the inbox: a dedup hint store and a per-aggregate lock with fencing.

Both are typed Protocols with a real implementation here and in-memory ones in
:mod:`inbox.testing`. Redis is never the source of truth (G6): the "done" key is written only
after the database commit, the "in progress" marker and the lock expire by Redis's own clock
(TTL; never compared across machines), and every Redis failure is translated here into
:class:`inbox.RedisUnavailableError`, which the consumer survives.

Lock recipe: Redis docs, "Distributed locks with Redis" (single instance: ``SET key token NX
PX ttl``; release and renew only if the value is still our token, atomically, in Lua).
Fencing tokens: Martin Kleppmann, "How to do distributed locking" (2016): the protected
resource refuses writes carrying a token lower than one it has seen.
"""

from __future__ import annotations

import functools
import secrets
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from ledgerbox.inbox._errors import RedisUnavailableError

__all__ = [
    "AggregateLock",
    "DedupStore",
    "LockLease",
    "RedisAggregateLock",
    "RedisDedupStore",
    "new_token",
    "redis_client",
]

T = TypeVar("T")

# Compare-and-delete: delete only if the key still holds our token. Returns 1 if we owned it.
RELEASE_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""

# Claim the "in progress" marker unless the event is already done, in one round trip:
# 1 claimed, 0 held by another owner or done (the caller then asks is_done).
CLAIM_LUA = """
if redis.call('exists', KEYS[2]) == 1 then
  return 0
end
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return 0
"""

# Set every "done" key of KEYS to 1 with a time to live of ARGV[1] ms, in one command: the
# client packs one command instead of one per key (a pipeline of SETs costs ~9 us of client
# CPU per key here, this ~0.5 us; docs/performance.md).
MARK_DONE_LUA = """
for _, key in ipairs(KEYS) do
  redis.call('set', key, '1', 'PX', ARGV[1])
end
return #KEYS
"""

#: Most keys in one MARK_DONE_LUA call (a longer list is sent in several calls).
MARK_DONE_CHUNK = 1000

# Compare-and-pexpire: extend only if the key still holds our token. Returns 1 if we own it.
RENEW_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""

# Take the lock and hand out a fencing token in one atomic step. The token is INCR of a
# counter that never expires, raised to at least Redis's own clock in microseconds, so tokens
# keep growing even if the counter key is lost (FLUSHALL, failover to an empty replica).
ACQUIRE_LUA = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local now = redis.call('time')
  local floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local token = redis.call('incr', KEYS[2])
  if token < floor then
    redis.call('set', KEYS[2], string.format('%d', floor))
    token = floor
  end
  return token
end
return 0
"""


def new_token() -> str:
    """A random lock owner token (128 bits)."""
    return secrets.token_hex(16)


def redis_client(url: str, *, timeout_s: float = 0.5, ca_file: str | None = None) -> Redis:
    """A ``redis.asyncio`` client whose calls fail fast instead of stalling the consumer.

    Parameters
    ----------
    url : str
        ``redis://host:port/db``; ``redis://user:password@host:port/db`` logs in (ACL user,
        or ``:password@`` for ``requirepass``); ``rediss://`` is TLS, the server's
        certificate and name verified (redis-py's defaults for ``rediss``).
    timeout_s : float
        Socket and connect timeout in seconds. Client-side retries are off: the consumer
        decides what to do when Redis is down (skip it and probe later).
    ca_file : str | None
        PEM file of the CA of the server's certificate (``rediss`` only; ``None``: the
        system's CAs).
    """
    tls: dict[str, Any] = {}
    if url.startswith("rediss://"):
        tls = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
        if ca_file is not None:
            tls["ssl_ca_certs"] = ca_file
    return Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        health_check_interval=0,
        **tls,
    )


async def _guard(call: Callable[[], Awaitable[T]]) -> T:
    # RuntimeError: under uvloop (the daemons' loop) a write on a connection the server or
    # the network closed raises "unable to perform operation on <TCPTransport closed=True>"
    # instead of an OSError; redis-py drops that connection and re-raises it as is. It is
    # Redis being away like any other (before: it escaped the pipeline and the consumer
    # exited 1 mid-soak, 80 s after a Redis restart, on its first Redis read since).
    try:
        return await call()
    except (TimeoutError, RedisError, OSError, RuntimeError) as exc:
        raise RedisUnavailableError(f"redis: {type(exc).__name__}: {exc}") from exc


@runtime_checkable
class DedupStore(Protocol):
    """Fast-path hints about events of a consumer group. Never the source of truth.

    All methods raise :class:`inbox.RedisUnavailableError` when the store cannot answer.
    """

    async def is_done(self, group: str, event_id: uuid.UUID) -> bool:
        """True if a "done" key says the event's effect committed (a hint)."""
        ...

    async def mark_done(self, group: str, event_id: uuid.UUID, ttl_s: float) -> None:
        """Record "done" for ``ttl_s`` seconds. Call only after the database commit."""
        ...

    async def done_among(self, group: str, event_ids: list[uuid.UUID]) -> set[uuid.UUID]:
        """The ids among ``event_ids`` whose "done" key is set (one round trip)."""
        ...

    async def mark_done_many(self, group: str, event_ids: list[uuid.UUID], ttl_s: float) -> None:
        """:meth:`mark_done` for several events (one round trip). Only after the DB commit."""
        ...

    async def claim(self, group: str, event_id: uuid.UUID, owner: str, ttl_ms: int) -> bool:
        """Set the "in progress" marker (``SET NX PX``); False if another owner holds it.

        An implementation may also return False when the event's "done" key is set, saving
        the consumer a separate :meth:`is_done` call (the Redis one does, atomically); the
        consumer asks :meth:`is_done` after a refused claim.
        """
        ...

    async def unclaim(self, group: str, event_id: uuid.UUID, owner: str) -> None:
        """Drop our "in progress" marker (compare-and-delete)."""
        ...

    async def ping(self) -> None:
        """Return if the store answers."""
        ...


@dataclass(frozen=True, slots=True)
class LockLease:
    """A held aggregate lock.

    Attributes
    ----------
    name : str
        The aggregate the lock protects.
    token : str
        Random owner token stored in the lock key.
    fencing_token : int
        Strictly larger than any token handed out before for this aggregate.
    """

    name: str
    token: str
    fencing_token: int


@runtime_checkable
class AggregateLock(Protocol):
    """A per-aggregate lease with a TTL and fencing tokens.

    All methods raise :class:`inbox.RedisUnavailableError` when the lock service cannot answer.
    """

    async def acquire(self, name: str, ttl_ms: int) -> LockLease | None:
        """Take the lock for ``ttl_ms`` ms; ``None`` if another owner holds it."""
        ...

    async def renew(self, lease: LockLease, ttl_ms: int) -> bool:
        """Extend our lock to ``ttl_ms`` ms from now; False if we no longer own it."""
        ...

    async def release(self, lease: LockLease) -> bool:
        """Release our lock; False if it had expired or another owner holds it now."""
        ...

    async def ping(self) -> None:
        """Return if the lock service answers."""
        ...


class RedisDedupStore:
    """:class:`DedupStore` on Redis. Keys: ``<prefix>inbox:<group>:done|busy:<event id>``,
    or, scoped to one inbox, ``<prefix>inbox:<scope>:<group>:done|busy:<event id>``.

    A "done" key is believed: the consumer skips the event. So it must only ever be read by
    the inbox that wrote it: two deployments that share a Redis and a group name (another
    environment, another tenant's database) or a database restored into a new cluster must
    not see each other's keys. :class:`inbox.InboxConsumer` builds its store with
    ``scoped=True`` and, at the start of ``run``, :meth:`bind` s it to the identity of its
    inbox (the PostgreSQL system identifier and timeline, the database's and the inbox
    table's OIDs: ``InboxConsumer._bind_hints``);
    until then the store knows nothing and writes nothing (every event goes to the
    database, which decides anyway: G4, G6).

    Parameters
    ----------
    client : redis.asyncio.Redis
        See :func:`redis_client` for one with short timeouts.
    prefix : str
        Key prefix (namespace), e.g. ``"ledgerbox:"``.
    scoped : bool
        ``True``: keys carry the scope given to :meth:`bind`; no hint is read or written
        before. ``False`` (a store used on its own): keys without a scope.
    """

    def __init__(self, client: Redis, prefix: str = "ledgerbox:", *, scoped: bool = False) -> None:
        self.client = client
        self.prefix = prefix
        self.scoped = scoped
        self.scope: str | None = None
        self._unclaim = client.register_script(RELEASE_LUA)
        self._claim = client.register_script(CLAIM_LUA)
        self._mark_done = client.register_script(MARK_DONE_LUA)

    def bind(self, scope: str) -> None:
        """Scope the keys to one inbox (``scope``: letters, digits, ``-``); a scoped store
        reads and writes hints only from then on."""
        self.scope = scope

    @property
    def ready(self) -> bool:
        """Hints may be read and written (unscoped, or bound)."""
        return not self.scoped or self.scope is not None

    def _key(self, kind: str, group: str, event_id: uuid.UUID) -> str:
        if self.scope is not None:
            return f"{self.prefix}inbox:{self.scope}:{group}:{kind}:{event_id}"
        return f"{self.prefix}inbox:{group}:{kind}:{event_id}"

    async def is_done(self, group: str, event_id: uuid.UUID) -> bool:
        if not self.ready:
            return False
        key = self._key("done", group, event_id)
        return bool(await _guard(lambda: self.client.exists(key)))

    async def mark_done(self, group: str, event_id: uuid.UUID, ttl_s: float) -> None:
        if not self.ready:
            return
        key = self._key("done", group, event_id)
        await _guard(lambda: self.client.set(key, b"1", px=max(1, int(ttl_s * 1000))))

    async def done_among(self, group: str, event_ids: list[uuid.UUID]) -> set[uuid.UUID]:
        if not event_ids or not self.ready:
            return set()
        keys = [self._key("done", group, e) for e in event_ids]
        found = await _guard(lambda: self.client.mget(keys))
        return {e for e, value in zip(event_ids, found, strict=True) if value is not None}

    async def mark_done_many(self, group: str, event_ids: list[uuid.UUID], ttl_s: float) -> None:
        if not event_ids or not self.ready:
            return
        ttl_ms = max(1, int(ttl_s * 1000))
        keys = [self._key("done", group, e) for e in event_ids]
        for start in range(0, len(keys), MARK_DONE_CHUNK):
            chunk = keys[start : start + MARK_DONE_CHUNK]
            await _guard(functools.partial(self._mark_done, keys=chunk, args=[ttl_ms]))

    async def claim(self, group: str, event_id: uuid.UUID, owner: str, ttl_ms: int) -> bool:
        if not self.ready:
            return True  # no marker: the database's inbox row decides
        keys = [self._key("busy", group, event_id), self._key("done", group, event_id)]
        return bool(await _guard(lambda: self._claim(keys=keys, args=[owner, ttl_ms])))

    async def unclaim(self, group: str, event_id: uuid.UUID, owner: str) -> None:
        if not self.ready:
            return
        key = self._key("busy", group, event_id)
        await _guard(lambda: self._unclaim(keys=[key], args=[owner]))

    async def ping(self) -> None:
        await _guard(lambda: cast(Awaitable[Any], self.client.ping()))


class RedisAggregateLock:
    """:class:`AggregateLock` on one Redis instance.

    Keys: ``<prefix>lock:<name>`` (owner token, PX TTL) and ``<prefix>fence:<name>`` (fencing
    counter, no TTL).
    """

    def __init__(self, client: Redis, prefix: str = "ledgerbox:") -> None:
        self.client = client
        self.prefix = prefix
        self._acquire = client.register_script(ACQUIRE_LUA)
        self._renew = client.register_script(RENEW_LUA)
        self._release = client.register_script(RELEASE_LUA)

    async def acquire(self, name: str, ttl_ms: int) -> LockLease | None:
        token = new_token()
        keys = [f"{self.prefix}lock:{name}", f"{self.prefix}fence:{name}"]
        fence = await _guard(lambda: self._acquire(keys=keys, args=[token, ttl_ms]))
        if not fence:
            return None
        return LockLease(name=name, token=token, fencing_token=int(fence))

    async def renew(self, lease: LockLease, ttl_ms: int) -> bool:
        key = f"{self.prefix}lock:{lease.name}"
        return bool(await _guard(lambda: self._renew(keys=[key], args=[lease.token, ttl_ms])))

    async def release(self, lease: LockLease) -> bool:
        key = f"{self.prefix}lock:{lease.name}"
        return bool(await _guard(lambda: self._release(keys=[key], args=[lease.token])))

    async def ping(self) -> None:
        await _guard(lambda: cast(Awaitable[Any], self.client.ping()))
