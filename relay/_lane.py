"""One lane: the claim -> publish -> persist pipeline of the shards ``shard % lanes == index``.

Per batch: claim up to ``batch_size`` committed rows of the lane's usable shards, each
shard's from its cursor's range in id order (:mod:`ledgerbox.relay._cursor`: the cursor of
the next claim is kept in memory, shared by the lanes in a
:class:`~ledgerbox.relay._cursor.CursorBook`; shards rotated between batches so none
starves); send them all, then await all delivery confirmations; then persist each shard's
cursor in ONE statement that also checks, in SQL, that this relay still holds the shard
under the fence it claimed it with. Nothing is written per row: an event whose transaction
commits late (C01) is in a later range, and the next claim finds it.

A failed send advances a shard only to its last row handled in a row (confirmed,
dead-lettered or held); the rest is read again. A shard's cursor is read from its lease row
(:meth:`~ledgerbox.relay._store.RelayStore.open_shards`, which validates it against the
database and refuses a cursor ahead of it) when the lane first claims it under a fence, and
again whenever the claim connection was reopened (the database may have crashed or failed
over: what the lane held in memory may be ahead of what the database kept).

Pipelining (``Lane.run``): a clean batch's cursors are queued and persisted in the
background (own connection) while the next batch is claimed from the in-memory cursors and
sent; at most one persist is in flight, a later one starts only after it, so they are applied
in order, and under load at most one per ``PERSIST_EVERY_S`` (the batches in between are
persisted together; at once when the lane stops or regroups, and when it goes idle once
``PERSIST_EVERY_S`` has passed unless a NOTIFY comes first). The next batch
is also claimed while the current one awaits its delivery confirmations (prefetch), and
handed to the producer only once the current one is confirmed in full; a batch with a
failure or a dead-lettered row drops the prefetched claim (and its cursor moves). Claims
are paced (:class:`~ledgerbox.relay._pacing.ClaimPacer`): in a stream of events, one claim
per ``claim_linger_ms`` at most.

Refused records: a record the publisher refuses before sending, or that the broker refuses
on its own, is dead-lettered (``status = 2``, ``last_error``) in the persist that passes
it. The broker rejects a whole record batch for one bad record, so the records of a failed
batch whose fault is the record's are sent again one by one and only the one that fails
alone is dead-lettered. With ``on_dead_letter="hold"`` later events of its key are not sent
and are held (``status = 3``) in the same persist; the claim flags the later events of a
key with a dead-lettered row (``ClaimedEvent.held``).
A record refused for its timestamp alone (the broker's ``log.message.timestamp.after.max.ms``
or ``before.max.ms``) is never dead-lettered: it is sent again with the relay's send time as
its timestamp, the event time staying in ``ce_time`` (C19, docs/outbox.md "Event time").

Tracing (:mod:`ledgerbox.relay._spans`): one ``send`` span per batch with a link to each
event's producer span, only when an OpenTelemetry SDK is configured; never one per event.

A lane maps each shard to exactly one lane (``shard % lanes``), so rows of one shard (and
key) are handed to the shared producer by one pipeline, one batch after the other, in id
order (G3). A failed persist after a successful send is retried with backoff (C04); if the
process dies meanwhile the rows are sent again with the same event ids (G4).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ledgerbox._core.backoff import Backoff
from ledgerbox._core.faults import Fault
from ledgerbox._core.stop import StopSignal
from ledgerbox.relay import _metrics as m
from ledgerbox.relay._config import RelayConfig
from ledgerbox.relay._cursor import (
    CursorBook,
    ShardState,
    next_states,
    persisted_cursor,
    plan_reads,
    with_ids,
)
from ledgerbox.relay._errors import StoreError
from ledgerbox.relay._health import RelayHealth
from ledgerbox.relay._hooks import RelayHooks
from ledgerbox.relay._leases import Leases
from ledgerbox.relay._pacing import ClaimPacer
from ledgerbox.relay._policy import (
    failure_reason,
    held_behind_dead_letter,
    not_sent,
    publish_fault,
    timestamp_refused,
)
from ledgerbox.relay._producer import SharedProducer
from ledgerbox.relay._publisher import OutboundRecord
from ledgerbox.relay._record import restamped, to_record
from ledgerbox.relay._spans import end_batch_span, start_batch_span
from ledgerbox.relay._store import (
    ClaimedEvent,
    CursorWrite,
    DeadLetter,
    PersistOutcome,
    RelayStore,
    ShardRead,
)

__all__ = ["Lane", "LaneDeps"]

log = logging.getLogger("ledgerbox.relay")

_Dead = list[tuple[ClaimedEvent, str]]
_Outcome = tuple[list[ClaimedEvent], _Dead, BaseException | None]
_T = TypeVar("_T")

#: Id-list paging reads at most this many batches' worth of ids of a large range at once
#: (8 bytes each in memory; more are listed when they are used up).
ID_LIST_BATCHES = 16

#: Under load a lane persists its cursors at most this often (seconds): the batches in
#: between are persisted together. A persist is a round trip (~100 us of the relay's CPU on
#: a small VM): one per batch was a fifth of the relay's CPU at 1,000 events/s. A crash
#: re-sends about this much plus one persist's duration (same event ids). 25 -> 100 ms
#: (2026-12-05): relay CPU at 1,000 events/s 97, 89, 98, 93 -> 86, 87, 89, 92 us per event
#: in alternated 20 s runs (docs/performance.md, eleventh session).
PERSIST_EVERY_S = 0.1


@dataclass(frozen=True, slots=True)
class LaneDeps:
    """What a :class:`Lane` uses (shared by the relay's lanes).

    Attributes
    ----------
    config : RelayConfig
        ``batch_size``, ``on_dead_letter``, ``poll_interval_s``, ``request_timeout_ms``,
        ``claim_linger_ms``.
    leases : Leases
        Usable shards and their fences; drained shards are released after each batch.
    producer : SharedProducer
    backoff : Backoff
        Pause between retries of a database call.
    stop : StopSignal
    regroup : asyncio.Event
        Set when the lane count is to change: the lane finishes its batch and returns.
    hooks : RelayHooks
        ``after_confirm`` is awaited between confirmation and persist (test-only).
    on_claimed : Callable[[int], None]
        Told the size of each claim of :meth:`Lane.run` (the lane scaler).
    health : RelayHealth
        Told when the lane's database calls fail and work again (part ``"claims"``).
    on_idle : Callable[[], None]
        Called when the lane starts waiting for a wake-up (nothing claimed): the listener
        then reads the notifications that came meanwhile (:mod:`ledgerbox.relay._wakeup`).
    cursors : CursorBook
        The reading positions of the relay's shards (shared by the lanes).
    clock : Callable[[], float]
        Monotonic clock in seconds (claim pacing).
    idle_wait_s : Callable[[], float] | None
        How long an idle lane waits for a wake-up before it claims again, in seconds
        (:meth:`~ledgerbox.relay._gate.WakeGate.idle_wait_s`: short while the wake gate is
        open and writers skip their NOTIFY); ``None``: ``config.poll_interval_s``.
    """

    config: RelayConfig
    leases: Leases
    producer: SharedProducer
    backoff: Backoff
    stop: StopSignal
    regroup: asyncio.Event
    hooks: RelayHooks
    on_claimed: Callable[[int], None]
    health: RelayHealth
    on_idle: Callable[[], None] = lambda: None
    cursors: CursorBook = field(default_factory=CursorBook)
    clock: Callable[[], float] = time.monotonic
    idle_wait_s: Callable[[], float] | None = None


@dataclass(frozen=True, slots=True)
class _Batch:
    """One claim: its rows and how it moved the cursors of the shards it read."""

    events: list[ClaimedEvent]
    fences: dict[int, int]
    before: dict[int, ShardState]
    after: dict[int, ShardState]
    hi: dict[int, str]
    #: The persist connection's epoch when the claim ran (CursorWrite.epoch).
    epoch: int | None = None


_EMPTY = _Batch([], {}, {}, {}, {})


class Lane:
    """State and steps of one claim -> publish -> persist pipeline.

    Parameters
    ----------
    index : int
        The lane claims the usable shards with ``shard % lanes == index``.
    store, mark_store : RelayStore
        Claim connection and persist connection (persists overlap the next claim).
    deps : LaneDeps
    """

    def __init__(
        self, index: int, store: RelayStore, mark_store: RelayStore, deps: LaneDeps
    ) -> None:
        self.index = index
        self.store = store
        self.mark_store = mark_store
        self.wake = asyncio.Event()
        self._deps = deps
        self._cursors = deps.cursors
        # Shards whose state this lane read or claimed on its claim connection as it is now
        # (``store.epoch``): any other state is read again from its lease row.
        self._epoch = store.epoch
        self._valid: set[int] = set()
        self._pacer = ClaimPacer(deps.config.claim_linger_ms / 1000, deps.config.batch_size)
        self._inflight: set[int] = set()
        self._persisting: asyncio.Task[int] | None = None
        self._prefetch: asyncio.Task[_Batch] | None = None
        self._persisting_shards: set[int] = set()
        # Cursors of confirmed batches not persisted yet (latest per shard), their published
        # counts, the first event of the oldest one (for logs), when the last persist began.
        self._queued: dict[int, CursorWrite] = {}
        self._queued_counts: dict[int, int] = {}
        self._queued_first: ClaimedEvent | None = None
        self._last_persist = -float("inf")
        self._rotation = 0
        self._claimed_from_db = False  # the last claim ran a query (it had shards)
        self._lanes = 0
        self._more = True  # the last claim left rows to read (full, or ranges left open)

    @property
    def stores(self) -> tuple[RelayStore, RelayStore]:
        """The claim and the persist store."""
        return self.store, self.mark_store

    @property
    def rate(self) -> float:
        """The lane's event rate as its claims saw it, in events per second."""
        return self._pacer.rate

    def busy_shards(self) -> set[int]:
        """Shards with rows in flight, or confirmed but not persisted yet (not releasable
        now)."""
        return self._inflight | self._persisting_shards | set(self._queued)

    # -- the loop --------------------------------------------------------------------------

    async def run(self, lanes: int) -> None:
        """Run pipelined batches while ``lanes`` lanes run, until stopped or regrouped; then
        (on a regroup) finish the batch: nothing of this lane is in flight when it returns.

        Raises only unexpected errors: database errors back off and retry
        (``retries_total{stage="db"}``), publish errors back off inside the batch.
        """
        deps = self._deps
        attempt = 0
        while not deps.stop.is_set() and not deps.regroup.is_set():
            try:
                if not await deps.producer.ensure():
                    await deps.producer.pause()
                    continue
                claimed, _ = await self.publish_batch(lanes, pipelined=True)
                attempt = 0
                if self._claimed_from_db:
                    deps.health.up("claims")
            except StoreError as exc:
                attempt += 1
                m.RETRIES.labels(stage="db").inc()
                deps.health.down("claims", str(exc))
                log.debug("database error: %s", exc, extra={"attempt": attempt})
                await deps.stop.sleep(deps.backoff.delay_s(attempt))
                continue
            deps.on_claimed(claimed)
            if claimed or deps.regroup.is_set() or deps.stop.is_set():
                continue
            deps.on_idle()
            await self._idle()
        if not deps.stop.is_set():
            # Regrouping: nothing of this lane may be in flight when its shards move (on stop,
            # Relay.aclose() does the same).
            await self.finish()

    async def _idle(self) -> None:
        """Wait for a NOTIFY (at most ``poll_interval_s``; while the wake gate is open, at
        most ``LaneDeps.idle_wait_s()``). Cursors still queued are persisted
        once ``PERSIST_EVERY_S`` has passed since the last persist began, unless a NOTIFY
        comes first (the next batch's persist then takes them along; an idle lane woken
        again and again persists them once that time has passed). At 1,000 events/s a
        lane goes idle after nearly every batch; persisting at once there was one persist
        per batch again."""
        deps = self._deps
        wait_s = deps.config.poll_interval_s if deps.idle_wait_s is None else deps.idle_wait_s()
        if self._queued:
            due_s = self._last_persist + PERSIST_EVERY_S - deps.clock()
            if due_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), min(due_s, wait_s))
                if self.wake.is_set() or due_s > wait_s:
                    # (A stop or a regroup ends the loop, whose finish persists them; while
                    # the wake gate is open the lane claims again after its short wait.)
                    return
            await self._flush_persist()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), wait_s)

    async def finish(self) -> None:
        """Drop the prefetched claim, persist what is queued and wait for it."""
        await self._drop_prefetch()
        await self._flush_persist()
        await self._finish_persist()

    def cancel(self) -> None:
        """Cancel the background persist and prefetch (the relay was cancelled, not stopped):
        their rows are sent again later with the same event ids."""
        for task in (self._persisting, self._prefetch):
            if task is not None:
                task.cancel()

    # -- one batch -------------------------------------------------------------------------

    async def publish_batch(self, lanes: int, *, pipelined: bool = False) -> tuple[int, int]:
        """Claim, publish, persist one batch; returns ``(claimed, published)``.

        ``lanes``: lanes running now (the lane claims ``shard % lanes == index``).
        ``pipelined``: while a batch awaits its delivery confirmations the next one is
        claimed; a clean batch's persist runs in the background while the next batch is
        sent; at most one persist in flight. The returned count then includes rows whose
        persist is still running.

        Raises
        ------
        StoreError
            The claim failed (nothing was sent).
        """
        deps = self._deps
        started = time.perf_counter()
        task, self._prefetch = self._prefetch, None
        batch = _EMPTY
        if task is not None:
            batch = await task
        leaving = deps.regroup.is_set() or deps.stop.is_set()
        if not batch.events and not leaving and (task is None or self.wake.is_set()):
            # Nothing prefetched, or the prefetch found nothing and a NOTIFY came in since it
            # began: claim afresh. (An empty prefetch without a NOTIFY since needs no second
            # claim: at low load that halves the claims.) Not when the lane is about to stop:
            # that claim would clear the wake flag of a lane that then waits for it; the next
            # group of lanes claims afresh anyway.
            batch = await self._claim(lanes)
        if not batch.events:
            if not pipelined:
                await self._flush_persist()
            return 0, 0
        # The claim may have been slow: publish only shards still held under the same fence;
        # the others are read again from their lease rows if they come back.
        leases = deps.leases
        usable = set(leases.usable())
        gone = {
            s
            for s in {e.shard for e in batch.events}
            if s not in usable or leases.fence(s) != batch.fences.get(s)
        }
        self._cursors.forget(gone)
        self._valid.difference_update(gone)
        events = [e for e in batch.events if e.shard not in gone]
        if not events:
            await self._flush_persist()
            return 0, 0
        self._inflight = {e.shard for e in events}
        published = 0
        try:
            after_send = (lambda: self._start_prefetch(lanes)) if pipelined else None
            sendable = [e for e in events if not e.held]
            confirmed, dead, failure = await self._publish(sendable, after_send)
            if confirmed:
                oldest_ms = min(e.occurred_at_ms for e in confirmed)
                m.EVENT_AGE_AT_PUBLISH.observe(max(0.0, time.time() - oldest_ms / 1000))
            handled, held = _handled(events, confirmed, dead, deps.config.on_dead_letter)
            clean = failure is None and not dead and len(handled) == len(events)
            if not clean:
                # The prefetched claim may hold later rows of a key whose row failed, died
                # or was not sent: they are read again from the cursors kept below.
                await self._drop_prefetch()
            if confirmed and deps.hooks.after_confirm is not None:
                await deps.hooks.after_confirm()
            writes, retry = self._writes(batch, events, handled)
            counts = _per_shard(confirmed)
            letters = [DeadLetter(e.id, e.shard, reason) for e, reason in dead]
            if pipelined and clean and not held:
                # Queued for the background persist, which keeps cursors and counts only,
                # not the batch's rows (peak RSS with several lanes).
                self._queue(writes, counts, events[0])
                published = len(confirmed)
                self._persist_soon()
            else:
                # In order: whatever is queued (older cursors) goes in this persist too.
                await self._finish_persist()
                writes, counts = self._take_queued(writes, counts)
                if writes:
                    published = await self._persist(
                        writes, letters, held, counts, events[0], dead_events=dead
                    )
            for shard, state in retry.items():
                self._cursors.states[shard] = state
        except BaseException:
            await self._drop_prefetch()
            raise
        finally:
            self._inflight = set()
        m.PUBLISH_BATCH_DURATION.observe(time.perf_counter() - started)
        if failure is not None:
            await deps.producer.failed(failure, events[0] if events else None)
        else:
            deps.producer.succeeded()
        await leases.release_drained()
        return len(events), published

    def _writes(
        self, batch: _Batch, events: list[ClaimedEvent], handled: set[int]
    ) -> tuple[list[CursorWrite], dict[int, ShardState]]:
        """The cursors to persist for the shards of ``events``, and the in-memory states of
        the shards to read again from a failed row on."""
        rows: dict[int, list[tuple[int, bool]]] = {}
        for event in events:
            rows.setdefault(event.shard, []).append((event.id, event.id in handled))
        writes: list[CursorWrite] = []
        retry: dict[int, ShardState] = {}
        for shard, shard_rows in rows.items():
            before, after = batch.before[shard], batch.after[shard]
            cursor = persisted_cursor(before, after, batch.hi[shard], shard_rows)
            if cursor is not None:
                writes.append(CursorWrite(shard, batch.fences[shard], cursor, batch.epoch))
            if not all(ok for _, ok in shard_rows):
                retry[shard] = ShardState(before.fence, cursor or before.cursor)
        return writes, retry

    # -- claim -----------------------------------------------------------------------------

    async def _claim(self, lanes: int, *, prefetch: bool = False) -> _Batch:
        """Claim the next batch of the lane's usable shards from the in-memory cursors (read
        from the lease rows first where the lane has none under the current fence).

        Clears the lane's wake flag first: a NOTIFY that arrives from here on sets it again,
        so "flag set" means "a commit may have landed after the last claim began"."""
        deps = self._deps
        if lanes != self._lanes:
            # Another lane count: other shards map to this lane now (and the lane's former
            # shards to other lanes, which read them again).
            self._valid.clear()
            self._lanes = lanes
        delay = self._pacer.delay_s(deps.clock())
        if delay > 0:
            await asyncio.sleep(delay)
        if prefetch and not self.wake.is_set() and not self._more:
            # Nothing committed since the last claim began (no NOTIFY; a lost one is caught
            # by the polling) and nothing left in its ranges: at low load this prefetch
            # would find nothing, every time.
            return _EMPTY
        self.wake.clear()
        leases = deps.leases
        shards = [s for s in leases.usable() if s % lanes == self.index]
        self._claimed_from_db = bool(shards)
        if not shards:
            return _EMPTY
        start = self._rotation % len(shards)
        self._rotation += 1
        shards = shards[start:] + shards[:start]
        fences = {s: leases.fence(s) for s in shards}
        self._pacer.started(deps.clock())
        for _ in range(3):
            batch = await self._claim_once(shards, fences)
            if batch is not None:
                self._pacer.claimed(len(batch.events))
                return batch
        return _EMPTY

    async def _claim_once(self, shards: list[int], fences: dict[int, int]) -> _Batch | None:
        """One attempt; ``None`` if the claim connection was reopened meanwhile (the states
        of the lane's shards are then dropped and read again)."""
        store, cursors = self.store, self._cursors
        if store.epoch != self._epoch:
            self._reset_epoch()
        await self._open(fences)
        states = {
            s: cursors.states[s]
            for s in shards
            if s in self._valid and s in cursors.states and cursors.states[s].fence == fences[s]
        }
        await self._list_ids(shards, states)
        ordered = [(s, states[s]) for s in shards if s in states]
        reads = plan_reads(ordered, self._deps.config.batch_size)
        if not reads:
            return _EMPTY
        limit = self._deps.config.batch_size
        # Opened before the claim: its cursors are written through this connection or not
        # at all (CursorWrite.epoch: a reopened one may reach a server that lost xids).
        epoch = await self.mark_store.connected()
        claim = await store.claim_batch(
            reads, limit, hold=self._deps.config.on_dead_letter == "hold"
        )
        if store.epoch != self._epoch:
            self._reset_epoch()
            return None
        if claim.ahead:
            # Opening them again records the refusal (sticky) and logs it.
            cursors.forget(claim.ahead)
            self._valid.difference_update(claim.ahead)
            await self._open({s: fences[s] for s in claim.ahead})
        after = next_states(states, reads, claim, limit)
        before = {s: states[s] for s in after}
        cursors.states.update(after)
        self._more = len(claim.events) >= limit or any(
            st.cursor.hi is not None for st in after.values()
        )
        hi = {r.shard: r.cursor.hi or claim.snapshot for r in reads}
        events = [e for e in claim.events if e.shard in after]
        return _Batch(events, fences, before, after, hi, epoch)

    def _reset_epoch(self) -> None:
        """The claim connection was reopened: the database may have crashed or failed over
        and kept less than the lane saw; every state is read again from the lease rows."""
        self._cursors.forget(self._valid)
        self._valid.clear()
        self._epoch = self.store.epoch

    async def _open(self, fences: dict[int, int]) -> None:
        """Read (and validate) the cursors of the shards without a state under their fence."""
        cursors = self._cursors
        wanted = [
            (s, f)
            for s, f in fences.items()
            if (s not in self._valid or s not in cursors.states or cursors.states[s].fence != f)
            and cursors.refused.get(s, (None,))[0] != f
        ]
        if not wanted:
            return
        release = self._deps.config.on_dead_letter == "skip"
        for opened in await self.store.open_shards(wanted, release_held=release):
            if opened.cursor is not None:
                cursors.states[opened.shard] = ShardState(opened.fence, opened.cursor)
                cursors.refused.pop(opened.shard, None)
                self._valid.add(opened.shard)
                continue
            reason = opened.refused or "refused"
            if cursors.refused.get(opened.shard) != (opened.fence, reason):
                log.error(
                    "shard %d refused: %s; stop the relays and run `ledgerbox relay rebase`"
                    " (docs/relay.md, 'Restore and rebase')",
                    opened.shard,
                    reason,
                    extra={"shard": opened.shard},
                )
            cursors.refused[opened.shard] = (opened.fence, reason)
        m.REFUSED_SHARDS.set(len(cursors.refused))
        if cursors.refused:
            # Down while a shard is refused (it stays so until `relay rebase`): a relay that
            # publishes nothing of those shards must not look healthy (an adversarial
            # review, 2026-12-05: 64 shards refused, health ok).
            shards = sorted(cursors.refused)
            first = cursors.refused[shards[0]][1]
            self._deps.health.down(
                "shards",
                f"{len(shards)} shards refused (shard {shards[0]}: {first}); stop the relays"
                " and run `ledgerbox relay rebase` (docs/relay.md, 'Restore and rebase')",
            )
        else:
            self._deps.health.up("shards")

    async def _list_ids(self, shards: list[int], states: dict[int, ShardState]) -> None:
        """Give every open range of ``shards`` that has none a list of its next ids (one
        statement for all of them)."""
        need = [
            ShardRead(s, states[s].cursor) for s in shards if s in states and states[s].needs_ids
        ]
        if not need:
            return
        cap = ID_LIST_BATCHES * self._deps.config.batch_size
        listed = await self.store.range_ids(need, cap)
        for read in need:
            state = with_ids(states[read.shard], listed.get(read.shard, []), cap)
            states[read.shard] = self._cursors.states[read.shard] = state

    def _start_prefetch(self, lanes: int) -> None:
        """Claim the next batch while the current one awaits Kafka (pipelining), from the
        cursors the current claim left; it is only used if the current batch is confirmed
        in full, and its records are handed to the producer only after that, so batches
        reach the producer one after the other, in order."""
        self._prefetch = asyncio.create_task(
            self._claim(lanes, prefetch=True), name=f"relay-prefetch-{self.index}"
        )

    async def _drop_prefetch(self) -> None:
        """Cancel the prefetched claim; if it had completed, its shards' cursors go back to
        where it started."""
        task, self._prefetch = self._prefetch, None
        if task is None:
            return
        task.cancel()
        batch: _Batch | None = None
        with contextlib.suppress(asyncio.CancelledError, StoreError):
            batch = await task
        if batch is not None:
            self._cursors.states.update(batch.before)

    def _queue(
        self, writes: list[CursorWrite], counts: dict[int, int], first: ClaimedEvent
    ) -> None:
        for write in writes:
            self._queued[write.shard] = write  # a later cursor of a shard replaces an earlier
        for shard, n in counts.items():
            self._queued_counts[shard] = self._queued_counts.get(shard, 0) + n
        self._queued_first = self._queued_first or first

    def _take_queued(
        self, writes: list[CursorWrite], counts: dict[int, int]
    ) -> tuple[list[CursorWrite], dict[int, int]]:
        """The queued cursors with ``writes`` after them (latest per shard), and counts."""
        merged = {**self._queued, **{w.shard: w for w in writes}}
        total = dict(self._queued_counts)
        for shard, n in counts.items():
            total[shard] = total.get(shard, 0) + n
        self._queued, self._queued_counts, self._queued_first = {}, {}, None
        return list(merged.values()), total

    def _persist_soon(self, *, now: bool = False) -> None:
        """Start the background persist of the queued cursors unless one is running; under
        load at most one per ``PERSIST_EVERY_S`` (the batches in between are persisted
        together: a crash re-sends at most that much, with the same event ids), at once
        when ``now`` (the idle lane's deadline passed, it stops or regroups)."""
        if not self._queued or (self._persisting is not None and not self._persisting.done()):
            return
        clock = self._deps.clock()
        if not now and clock - self._last_persist < PERSIST_EVERY_S:
            return
        if self._persisting is not None:
            self._reap(self._persisting)
        first = self._queued_first
        assert first is not None
        writes, counts = self._take_queued([], {})
        self._last_persist = clock
        self._persisting_shards = {w.shard for w in writes}
        self._persisting = asyncio.create_task(self._persist(writes, (), (), counts, first))

    @staticmethod
    def _reap(task: asyncio.Task[int]) -> None:
        """Surface an unexpected error of a finished background persist."""
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

    async def _flush_persist(self) -> None:
        """Persist what is queued now (after the running persist; not waiting for it)."""
        if self._queued:
            await self._finish_persist()
            self._persist_soon(now=True)

    async def _finish_persist(self) -> None:
        """Wait for the background persist of the lane's previous batch (pipelining)."""
        task, self._persisting = self._persisting, None
        try:
            if task is not None:
                await task
        finally:
            self._persisting_shards = set()

    # -- publish ---------------------------------------------------------------------------

    async def _publish(
        self, events: list[ClaimedEvent], after_send: Callable[[], None] | None = None
    ) -> _Outcome:
        """Send all, call ``after_send`` (records handed over), then await all.
        Returns (confirmed, dead with reason, transient error)."""
        producer, on_dead_letter = self._deps.producer, self._deps.config.on_dead_letter
        rejected: set[str] = set()
        dead: _Dead = []
        sendable: list[tuple[ClaimedEvent, OutboundRecord]] = []
        for event in events:
            if held_behind_dead_letter(on_dead_letter, event.partition_key, rejected):
                continue
            record = to_record(event)
            refused = producer.precheck(record)
            if refused is not None:
                # Refused before sending: later events of the key are not sent either (hold).
                dead.append((event, failure_reason(refused)))
                rejected.add(event.partition_key)
                continue
            sendable.append((event, record))
        # The batch's span covers the records handed to Kafka: none (every one held or
        # refused before sending) is no send, and no span.
        span = start_batch_span([e for e, _ in sendable])
        try:
            outcome = await self._send(sendable, dead, rejected, after_send)
        except BaseException as exc:
            end_batch_span(span, confirmed=0, dead_lettered=0, failure=exc)
            raise
        confirmed, dead, failure = outcome
        end_batch_span(span, confirmed=len(confirmed), dead_lettered=len(dead), failure=failure)
        return outcome

    async def _send(
        self,
        sendable: list[tuple[ClaimedEvent, OutboundRecord]],
        dead: _Dead,
        rejected: set[str],
        after_send: Callable[[], None] | None,
    ) -> _Outcome:
        """Send the prechecked records, call ``after_send``, await them (the suspects of a
        rejected record batch sent alone). Returns (confirmed, dead with reason, error)."""
        producer = self._deps.producer
        failure: BaseException | None = None
        try:
            futures = await producer.send_many([r for _, r in sendable])
        except Exception as exc:
            return [], dead, exc
        if after_send is not None:
            after_send()
        # Bounded: with several lanes another lane may recreate the producer while these
        # records are in flight, and a producer stopped mid-flight can leave their futures
        # unresolved (seen in the Kafka outage test). Not confirmed in time = transient.
        # Once the relay stops, at most what is left of stop_timeout_s: a broker that is away
        # cannot hold a SIGTERM; the rows not confirmed are simply not persisted (sent again).
        wait_s = 2 * self._deps.config.request_timeout_ms / 1000 + 5
        try:
            results = await self._deps.stop.bounded(
                asyncio.gather(*futures, return_exceptions=True), wait_s
            )
        except TimeoutError as exc:
            return [], dead, exc
        confirmed: list[ClaimedEvent] = []
        suspects: list[ClaimedEvent] = []
        for (event, _), result in zip(sendable, results, strict=True):
            if not isinstance(result, BaseException):
                confirmed.append(event)
            elif not_sent(result):
                continue  # behind a failed record batch of its partition: read again
            elif publish_fault(result) is Fault.MESSAGE:
                suspects.append(event)
            else:
                failure = failure or result
        if suspects:
            # The broker rejects a whole record batch for one bad record: send each suspect
            # alone, so only the record that fails on its own is dead-lettered.
            ok, bad, err = await self._isolate(suspects, rejected)
            confirmed.extend(ok)
            dead.extend(bad)
            failure = failure or err
        return confirmed, dead, failure

    async def _isolate(self, suspects: list[ClaimedEvent], rejected: set[str]) -> _Outcome:
        on_dead_letter = self._deps.config.on_dead_letter
        ok: list[ClaimedEvent] = []
        bad: _Dead = []
        for event in suspects:
            if held_behind_dead_letter(on_dead_letter, event.partition_key, rejected):
                continue
            try:
                await self._send_alone(to_record(event))
            except Exception as exc:
                if timestamp_refused(exc):
                    # No committed event is dead-lettered for its time (C19): the record
                    # goes out stamped with the send time; ce_time keeps the event time.
                    try:
                        await self._send_alone(restamped(to_record(event), time.time()))
                    except Exception as again:
                        # Refused at the relay's own clock too: the clocks are wrong, not
                        # the event. Pending, retried, health down (never dead-lettered).
                        return ok, bad, again
                    m.RESTAMPED.inc()
                    log.warning(
                        "record timestamp refused by the broker, sent with the send time "
                        "(ce_time keeps the event time)",
                        extra={"event_id": event.event_id, "partition_key": event.partition_key},
                    )
                    ok.append(event)
                    continue
                if publish_fault(exc) is not Fault.MESSAGE:
                    return ok, bad, exc
                bad.append((event, failure_reason(exc)))
                rejected.add(event.partition_key)
                continue
            ok.append(event)
        return ok, bad, None

    async def _send_alone(self, record: OutboundRecord) -> None:
        (future,) = await self._deps.producer.send_many([record])
        await self._deps.stop.bounded(future, math.inf)  # TimeoutError: stopped, not sent

    # -- persist ---------------------------------------------------------------------------

    async def _persist(
        self,
        writes: list[CursorWrite],
        dead: Sequence[DeadLetter],
        held: Sequence[tuple[int, int]],
        confirmed: dict[int, int],
        first: ClaimedEvent,
        *,
        dead_events: _Dead | None = None,
    ) -> int:
        outcomes = await self._retry_store(
            "mark", lambda: self.mark_store.persist(writes, dead, held), first
        )
        if outcomes is None:
            return 0
        published = 0
        for write in writes:
            outcome = outcomes.get(write.shard, PersistOutcome.LOST)
            if outcome is PersistOutcome.OK:
                published += confirmed.get(write.shard, 0)
                continue
            # The shard's state is read again from its lease row: lost (another relay sends
            # its rows again, same event ids) or to be validated against this database.
            self._cursors.forget([write.shard])
            self._valid.discard(write.shard)
            if outcome is PersistOutcome.LOST:
                log.warning(
                    "%d published events of shard %d not persisted: lease lost, they will be"
                    " sent again",
                    confirmed.get(write.shard, 0),
                    write.shard,
                )
        for event, reason in dead_events or ():
            if outcomes.get(event.shard) is PersistOutcome.OK:
                m.DEAD_LETTERED.inc()
                log.error(
                    "event %d (%s, key %s) dead-lettered: %s (`ledgerbox relay dead show %d`)",
                    event.id,
                    event.event_id,
                    event.partition_key,
                    reason,
                    event.id,
                    extra={"event_id": str(event.event_id), "partition_key": event.partition_key},
                )
        m.PUBLISHED.inc(published)
        return published

    async def _retry_store(
        self, stage: str, call: Callable[[], Awaitable[_T]], event: ClaimedEvent
    ) -> _T | None:
        """Retry a write after a successful send until it lands (C04). Gives up only when
        stopping, after the third attempt (the rows are then simply sent again later).
        While it fails, health is down (part ``persists``, until every lane whose persist
        failed has written again; one WARNING when it goes down and one when it works again,
        each attempt at DEBUG). A lane whose persist runs in the background goes on claiming
        and sending meanwhile, its cursors queued; on the synchronous path (dead-lettered or
        held rows, ``run_once``, a stop) it waits."""
        attempt = 0
        health = self._deps.health
        while True:
            try:
                result = await call()
            except StoreError as exc:
                attempt += 1
                m.RETRIES.labels(stage=stage).inc()
                health.down("persists", str(exc), who=self.index)
                log.debug(
                    "%s failed, retrying: %s",
                    stage,
                    exc,
                    extra={
                        "attempt": attempt,
                        "event_id": str(event.event_id),
                        "partition_key": event.partition_key,
                    },
                )
                if self._deps.stop.is_set() and attempt >= 3:
                    return None
                await asyncio.sleep(self._deps.backoff.delay_s(attempt))
                continue
            if attempt:
                health.up("persists", who=self.index)
            return result


def _handled(
    events: list[ClaimedEvent], confirmed: list[ClaimedEvent], dead: _Dead, on_dead_letter: str
) -> tuple[set[int], list[tuple[int, int]]]:
    """Ids of the rows a persist may pass (confirmed, dead-lettered or held) and the held
    rows ``(id, shard)``: flagged by the claim, or (``"hold"``) behind a row of their key
    that died in this batch, which ``_publish`` did not send."""
    handled = {e.id for e in confirmed} | {e.id for e, _ in dead}
    first_dead: dict[str, int] = {}
    for event, _ in dead:
        first_dead[event.partition_key] = min(
            event.id, first_dead.get(event.partition_key, event.id)
        )
    held: list[tuple[int, int]] = []
    for event in events:
        if event.id in handled:
            continue
        behind = (
            on_dead_letter == "hold" and first_dead.get(event.partition_key, event.id) < event.id
        )
        if event.held or behind:
            held.append((event.id, event.shard))
            handled.add(event.id)
    return handled, held


def _per_shard(events: list[ClaimedEvent]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for event in events:
        counts[event.shard] = counts.get(event.shard, 0) + 1
    return counts
