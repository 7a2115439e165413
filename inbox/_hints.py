"""Redis "done" hints on the batched path, off the critical path (G6; docs/inbox.md, "Redis").

Two parts:

- :class:`HintPolicy` (pure: no clock, no I/O) decides per partition whether a batch asks
  Redis which of its events are already done. A hint saves a database transaction only for
  a record that was applied before, and on a partition this consumer reads in order such a
  record is rare: it appears where a partition changed hands or was sought (the previous
  owner applied records whose offsets it had not committed) and where a producer or the relay
  sent an event twice (the copies arrive close together). So a batch asks when the partition
  is new to this consumer, when its offsets do not continue the previous batch's, or when
  the previous batch found a duplicate (in Redis or in the database). Otherwise the inbox
  claim in the database is the only check, as it is the authority anyway (G4): a round trip
  per batch is saved and nothing else changes.
- :class:`DoneHintWriter` writes the "done" keys of committed events in the background: a
  batch hands its event ids over after its database commit and goes on; one task sends
  everything handed over meanwhile in one Redis call (``DedupStore.mark_done_many``), at
  most one call in flight. A hint lost to a
  crash, a full buffer or a Redis outage costs a duplicate's database check, never
  correctness: the database decides (G6).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid

from ledgerbox.inbox._gate import RedisGate
from ledgerbox.inbox._redis import DedupStore

__all__ = ["MAX_PENDING_HINTS", "DoneHintWriter", "HintPolicy"]

_log = logging.getLogger("ledgerbox.inbox")

#: Most event ids waiting for their "done" key; beyond it the oldest are dropped (hints only).
MAX_PENDING_HINTS = 50_000


class HintPolicy:
    """Per partition: must the next batch ask Redis for "done" hints? (module docstring)."""

    def __init__(self) -> None:
        # (topic, partition) -> (offset the next batch continues from, last batch found a
        # duplicate)
        self._state: dict[tuple[str, int], tuple[int, bool]] = {}

    def consult(self, topic: str, partition: int, first_offset: int) -> bool:
        """True if the batch starting at ``first_offset`` should read the hints first."""
        state = self._state.get((topic, partition))
        return state is None or state[1] or state[0] != first_offset

    def observe(self, topic: str, partition: int, last_offset: int, duplicate: bool) -> None:
        """Record a finished batch: its last offset and whether any record was a duplicate."""
        self._state[(topic, partition)] = (last_offset + 1, duplicate)


class DoneHintWriter:
    """Writes "done" hints after the database commit without making the batch wait.

    Parameters
    ----------
    dedup : DedupStore
        Where the hints go.
    gate : RedisGate
        The Redis circuit (a failure degrades it; while degraded nothing is sent).
    group : str
        The consumer group the hints are for.
    ttl_s : float
        How long a hint lives, in seconds (``ConsumerConfig.dedup_ttl_s``).
    max_pending : int
        Most ids waiting; beyond it the oldest are dropped.
    """

    def __init__(
        self,
        dedup: DedupStore,
        gate: RedisGate,
        group: str,
        ttl_s: float,
        max_pending: int = MAX_PENDING_HINTS,
    ) -> None:
        self.dedup = dedup
        self.gate = gate
        self.group = group
        self.ttl_s = ttl_s
        self.max_pending = max_pending
        self._pending: list[uuid.UUID] = []
        self._task: asyncio.Task[None] | None = None
        self._warned = False

    def add(self, event_ids: list[uuid.UUID]) -> None:
        """Hand over ids whose effect COMMITTED in the database; returns at once.

        Must run inside the consumer's event loop (it starts the writing task there).
        """
        if not event_ids:
            return
        pending = self._pending
        pending.extend(event_ids)
        if len(pending) > self.max_pending:
            del pending[: len(pending) - self.max_pending]
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._drain(), name=f"inbox-hints-{self.group}"
            )

    async def _drain(self) -> None:
        dedup, group, ttl_s = self.dedup, self.group, self.ttl_s
        while self._pending:
            ids, self._pending = self._pending, []
            write = functools.partial(dedup.mark_done_many, group, ids, ttl_s)
            try:
                await self.gate.call(write, None)
            except Exception as exc:  # not an outage (the gate takes those): say it once
                if not self._warned:
                    self._warned = True
                    _log.warning("done hints not written for group %s: %r", group, exc)

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Wait (at most ``timeout_s`` seconds) until every id handed over was sent; on
        timeout the rest is dropped. Called when the consumer closes."""
        task = self._task
        if task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self._pending = []
