"""Pure policy of the relay: fair share, lease bookkeeping, error classes, hold rule.

No clock and no I/O: callers pass monotonic times in. Unit-tested in
``tests/unit/test_relay_policy.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ledgerbox._core.errors import BrokerError
from ledgerbox._core.faults import Fault

__all__ = [
    "LEADER_SHARD",
    "NOT_SENT",
    "Lease",
    "LeaseBook",
    "failure_reason",
    "fair_share",
    "held_behind_dead_letter",
    "not_sent",
    "publish_fault",
    "shard_ranges",
    "timestamp_refused",
    "unreachable",
]

#: Lease row whose owner is the maintenance leader (cleanup, gauges). Not a data shard.
LEADER_SHARD = -1


def publish_fault(exc: BaseException) -> Fault:
    """The fault of a failed send: the :class:`~ledgerbox.relay.PublishError`'s own (the
    publisher seam translated the client's error), anything else ``TRANSIENT``.

    Only ``MESSAGE`` dead-letters the event; a wrong "transient" costs retries, a wrong
    "message" would dead-letter a good event.
    """
    return exc.fault if isinstance(exc, BrokerError) else Fault.TRANSIENT


def failure_reason(exc: BaseException) -> str:
    """``"<kind>: <message>"`` of a failed call, for logs and a dead-lettered row's
    ``last_error``: a translated Kafka error is named by the client's class (e.g.
    ``MessageSizeTooLargeError``), anything else by its own class."""
    name = exc.kind if isinstance(exc, BrokerError) else type(exc).__name__
    text = str(exc)
    return f"{name}: {text}" if text else name


#: Kafka error kinds of a broker that did not answer in time (as opposed to one that answered
#: with a refusal such as NOT_ENOUGH_REPLICAS, which every relay gets alike).
_NO_ANSWER = frozenset({"KafkaTimeoutError", "RequestTimedOutError", "Cancelled"})


def unreachable(exc: BaseException) -> bool:
    """True if a failed send means Kafka did not answer this relay (a connection fault of
    the environment, or no answer in time), not that it answered with a refusal."""
    if isinstance(exc, TimeoutError):
        return True
    if not isinstance(exc, BrokerError):
        return False
    return exc.fault is Fault.ENVIRONMENT or exc.kind in _NO_ANSWER


def timestamp_refused(exc: BaseException) -> bool:
    """True if the broker refused the record for its timestamp alone (INVALID_TIMESTAMP,
    error code 32: ``log.message.timestamp.after.max.ms`` / ``before.max.ms``)."""
    return isinstance(exc, BrokerError) and exc.kind == "InvalidTimestampError"


#: ``BrokerError.kind`` of a record a publisher held back, unsent, because an earlier record
#: batch of its partition in the same send failed (``Publisher.send_many``).
NOT_SENT = "NotSent"


def not_sent(exc: BaseException) -> bool:
    """True if the record was never handed to Kafka because an earlier record batch of its
    partition failed: it is read again, neither dead-lettered nor a failure of its own."""
    return isinstance(exc, BrokerError) and exc.kind == NOT_SENT


def shard_ranges(values: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (for messages about many shards)."""
    parts: list[str] = []
    ordered = sorted(values)
    if not ordered:
        return ""
    start = prev = ordered[0]
    for value in [*ordered[1:], None]:
        if value is not None and value == prev + 1:
            prev = value
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return ",".join(parts)


def fair_share(shard_count: int, live_members: int) -> int:
    """Shards one relay should own: ``ceil(shard_count / live_members)`` (at least 1 member)."""
    return math.ceil(shard_count / max(1, live_members))


def held_behind_dead_letter(on_dead_letter: str, key: str, rejected_keys: set[str]) -> bool:
    """True if an event of ``key`` must wait because an earlier event of the key is dead.

    ``"hold"`` keeps per-key order (G3): later events wait for the operator. ``"skip"``
    publishes them.
    """
    return on_dead_letter == "hold" and key in rejected_keys


@dataclass(slots=True)
class Lease:
    """A shard this relay holds: the fence it holds it under and a local monotonic deadline."""

    shard: int
    fence: int
    deadline: float
    draining: bool = False


class LeaseBook:
    """What this relay believes it owns, driven by the results of the lease statements.

    The local deadline is ``(monotonic time when the renewing statement was SENT) + ttl -
    margin``: the database set ``expires_at = now() + ttl`` later than that, so the relay
    stops publishing a shard before any other relay can take it over, even when it cannot
    reach the database to learn that it lost it.

    Parameters
    ----------
    ttl_s : float
        Lease lifetime in seconds.
    margin_s : float
        Safety margin in seconds subtracted from the local deadline.
    """

    def __init__(self, ttl_s: float, margin_s: float) -> None:
        self.ttl_s = ttl_s
        self.margin_s = margin_s
        self._leases: dict[int, Lease] = {}

    def granted(self, grants: Iterable[tuple[int, int]], sent_at: float) -> list[int]:
        """Record acquired leases ``(shard, fence)``; returns the newly owned data shards."""
        new: list[int] = []
        for shard, fence in grants:
            if shard not in self._leases and shard != LEADER_SHARD:
                new.append(shard)
            self._leases[shard] = Lease(shard, fence, sent_at + self.ttl_s - self.margin_s)
        return sorted(new)

    def renewed(self, grants: Iterable[tuple[int, int]], sent_at: float) -> list[int]:
        """Apply a renewal result; returns the shards that were NOT renewed (lost, dropped)."""
        kept = dict(grants)
        lost = [s for s in self._leases if s not in kept or kept[s] != self._leases[s].fence]
        for shard in lost:
            del self._leases[shard]
        deadline = sent_at + self.ttl_s - self.margin_s
        for lease in self._leases.values():
            lease.deadline = deadline
        return sorted(lost)

    def held(self) -> list[tuple[int, int]]:
        """``(shard, fence)`` of every lease held, leader lease included."""
        return sorted((lease.shard, lease.fence) for lease in self._leases.values())

    def usable(self, now: float) -> list[int]:
        """Data shards this relay may publish now: held, not draining, before the deadline."""
        return sorted(
            lease.shard
            for lease in self._leases.values()
            if lease.shard != LEADER_SHARD and not lease.draining and lease.deadline > now
        )

    def fence(self, shard: int) -> int:
        """The fence this relay holds ``shard`` under (``KeyError`` if not held)."""
        return self._leases[shard].fence

    def is_leader(self, now: float) -> bool:
        """True if this relay holds the leader lease and its deadline has not passed."""
        lease = self._leases.get(LEADER_SHARD)
        return lease is not None and lease.deadline > now

    def data_shards(self) -> list[int]:
        """Data shards held (draining ones included), ignoring deadlines."""
        return sorted(s for s in self._leases if s != LEADER_SHARD)

    def plan(self, share: int) -> tuple[int, list[int]]:
        """``(how many shards to acquire, which shards to drain)`` to reach ``share``.

        Draining shards are not claimed any more and released once no batch holds them.
        The highest-numbered shards are drained first, so the choice is deterministic.
        """
        active = [s for s in self.data_shards() if not self._leases[s].draining]
        if len(active) < share:
            return share - len(active), []
        extras = active[share:]
        for shard in extras:
            self._leases[shard].draining = True
        return 0, extras

    def draining(self) -> list[int]:
        """Shards marked to be released."""
        return sorted(s for s, lease in self._leases.items() if lease.draining)

    def drop(self, shards: Iterable[int]) -> None:
        """Forget leases (after a release, or when they are lost)."""
        for shard in shards:
            self._leases.pop(shard, None)

    def expire_all(self) -> None:
        """Forget every lease (e.g. on shutdown)."""
        self._leases.clear()
