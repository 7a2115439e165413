"""One lane: the claim -> publish -> mark pipeline of the shards ``shard % lanes == index``.

Per batch: claim up to ``batch_size`` pending rows (``status = 0``) of the lane's usable
shards, per shard in id order (LATERAL over the partial index ``(shard, id) WHERE status =
0``, shards rotated between batches so none starves); send them all, then await all delivery
confirmations; then mark the confirmed ones ``status = 1`` in ONE ``UPDATE ... WHERE id =
ANY(...)`` that also checks, in SQL, that this relay still holds each shard under the fence
it claimed it with. No cursor, no "last id seen": an event whose transaction commits late
(C01) is simply pending and the next claim finds it.

Pipelining (``Lane.run``): a clean batch's mark runs in the background (own connection)
while the next batch is claimed, excluding the rows being marked by id, and sent; at most
one mark is in flight (measured to help). The next batch is also claimed while the current
one awaits its confirmations (prefetch), and handed to the producer only once the current
one is confirmed in full; a batch with a failure drops the prefetched claim.

Refused records: a record the publisher refuses before sending, or that the broker refuses
on its own, is dead-lettered (``status = 2``, ``last_error``). The broker rejects a whole
record batch for one bad record, so the records of a failed batch whose fault is the
record's are sent again one by one and only the one that fails alone is dead-lettered. With
``on_dead_letter="hold"`` later events of its key are not sent (the claim skips them too).
A record refused for its timestamp alone (the broker's ``log.message.timestamp.after.max.ms``
or ``before.max.ms``) is never dead-lettered: it is sent again with the relay's send time as
its timestamp, the event time staying in ``ce_time`` (C19, docs/outbox.md "Event time").

A lane maps each shard to exactly one lane (``shard % lanes``), so rows of one shard (and
key) are handed to the shared producer by one pipeline, one batch after the other, in id
order (G3). A failed mark after a successful send is retried with backoff (C04); if the
process dies meanwhile the rows are sent again with the same event ids (G4).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ledgerbox._core.backoff import Backoff
from ledgerbox._core.faults import Fault
from ledgerbox.relay import _metrics as m
from ledgerbox.relay._config import RelayConfig
from ledgerbox.relay._errors import StoreError
from ledgerbox.relay._health import RelayHealth
from ledgerbox.relay._hooks import RelayHooks
from ledgerbox.relay._leases import Leases
from ledgerbox.relay._policy import (
    failure_reason,
    held_behind_dead_letter,
    publish_fault,
    timestamp_refused,
)
from ledgerbox.relay._producer import SharedProducer
from ledgerbox.relay._publisher import OutboundRecord
from ledgerbox.relay._record import restamped, to_record
from ledgerbox.relay._stop import StopSignal
from ledgerbox.relay._store import ClaimedEvent, RelayStore

__all__ = ["Lane", "LaneDeps"]

log = logging.getLogger("ledgerbox.relay")

_Dead = list[tuple[ClaimedEvent, str]]
_Outcome = tuple[list[ClaimedEvent], _Dead, BaseException | None]


@dataclass(frozen=True, slots=True)
class LaneDeps:
    """What a :class:`Lane` uses (shared by the relay's lanes).

    Attributes
    ----------
    config : RelayConfig
        ``batch_size``, ``on_dead_letter``, ``poll_interval_s``, ``request_timeout_ms``.
    leases : Leases
        Usable shards and their fences; drained shards are released after each batch.
    producer : SharedProducer
    backoff : Backoff
        Pause between retries of a database call.
    stop : StopSignal
    regroup : asyncio.Event
        Set when the lane count is to change: the lane finishes its batch and returns.
    hooks : RelayHooks
        ``after_confirm`` is awaited between confirmation and mark (test-only).
    on_claimed : Callable[[int], None]
        Told the size of each claim of :meth:`Lane.run` (the lane scaler).
    health : RelayHealth
        Told when the lane's database calls fail and work again (part ``"claims"``).
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


class Lane:
    """State and steps of one claim -> publish -> mark pipeline.

    Parameters
    ----------
    index : int
        The lane claims the usable shards with ``shard % lanes == index``.
    store, mark_store : RelayStore
        Claim connection and mark connection (marks overlap the next claim).
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
        self._inflight: set[int] = set()
        self._marking: asyncio.Task[int] | None = None
        self._prefetch: asyncio.Task[tuple[list[ClaimedEvent], dict[int, int]]] | None = None
        self._marking_ids: list[int] = []
        self._marking_shards: set[int] = set()
        self._rotation = 0
        self._claimed_from_db = False  # the last claim ran a query (it had shards)

    @property
    def stores(self) -> tuple[RelayStore, RelayStore]:
        """The claim and the mark store."""
        return self.store, self.mark_store

    def busy_shards(self) -> set[int]:
        """Shards with rows in flight or being marked (not releasable now)."""
        return self._inflight | self._marking_shards

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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), deps.config.poll_interval_s)
        if not deps.stop.is_set():
            # Regrouping: nothing of this lane may be in flight when its shards move (on stop,
            # Relay.aclose() does the same).
            await self.finish()

    async def finish(self) -> None:
        """Drop the prefetched claim and wait for the background mark."""
        await self._drop_prefetch()
        await self._finish_marking()

    def cancel(self) -> None:
        """Cancel the background mark and prefetch (the relay was cancelled, not stopped):
        their rows stay pending and are sent again later with the same event ids."""
        for task in (self._marking, self._prefetch):
            if task is not None:
                task.cancel()

    # -- one batch -------------------------------------------------------------------------

    async def publish_batch(self, lanes: int, *, pipelined: bool = False) -> tuple[int, int]:
        """Claim, publish, mark one batch; returns ``(claimed, marked published)``.

        ``lanes``: lanes running now (the lane claims ``shard % lanes == index``).
        ``pipelined``: while a batch awaits its delivery confirmations the next one is
        claimed; a clean batch's mark runs in the background while the next batch is sent
        (its rows excluded from the claims); at most one mark in flight. The returned count
        then includes rows whose mark is still running.

        Raises
        ------
        StoreError
            The claim failed (nothing was sent).
        """
        deps = self._deps
        started = time.perf_counter()
        task, self._prefetch = self._prefetch, None
        events: list[ClaimedEvent] = []
        fences: dict[int, int] = {}
        if task is not None:
            events, fences = await task
        leaving = deps.regroup.is_set() or deps.stop.is_set()
        if not events and not leaving and (task is None or self.wake.is_set()):
            # Nothing prefetched, or the prefetch found nothing and a NOTIFY came in since it
            # began: claim afresh. (An empty prefetch without a NOTIFY since needs no second
            # claim: at low load that halves the claims.) Not when the lane is about to stop:
            # that claim would clear the wake flag of a lane that then waits for it; the next
            # group of lanes claims afresh anyway.
            events, fences = await self._claim(lanes, self._marking_ids)
        if not events:
            await self._finish_marking()
            return 0, 0
        # The claim may have been slow: publish only shards still held under the same fence.
        leases = deps.leases
        usable = {s for s in leases.usable() if leases.fence(s) == fences.get(s)}
        events = [e for e in events if e.shard in usable]
        self._inflight = {e.shard for e in events}
        try:
            after_send = (lambda: self._start_prefetch(lanes, events)) if pipelined else None
            confirmed, dead, failure = await self._publish(events, after_send)
            if failure is not None or dead:
                # The prefetched claim may hold later rows of a key whose row failed or died.
                await self._drop_prefetch()
            for event, reason in dead:
                await self._dead_letter(event, fences[event.shard], reason)
            await self._finish_marking()
            published = 0
            if confirmed:
                if deps.hooks.after_confirm is not None:
                    await deps.hooks.after_confirm()
                ids = [e.id for e in confirmed]
                shard_fences = sorted({(e.shard, fences[e.shard]) for e in confirmed})
                if pipelined and failure is None and not dead:
                    self._marking_ids = ids
                    self._marking_shards = {s for s, _ in shard_fences}
                    # The background mark keeps ids and fences only, not the batch's rows
                    # (peak RSS with several lanes).
                    self._marking = asyncio.create_task(
                        self._mark_published(ids, shard_fences, confirmed[0])
                    )
                    published = len(confirmed)
                else:
                    published = await self._mark_published(ids, shard_fences, confirmed[0])
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

    async def _claim(
        self, lanes: int, exclude: list[int]
    ) -> tuple[list[ClaimedEvent], dict[int, int]]:
        """Claim the next batch of the lane's usable shards; returns it with the fences it
        was claimed under.

        Clears the lane's wake flag first: a NOTIFY that arrives from here on sets it again,
        so "flag set" means "a commit may have landed after the last claim began"."""
        self.wake.clear()
        leases, config = self._deps.leases, self._deps.config
        shards = [s for s in leases.usable() if s % lanes == self.index]
        self._claimed_from_db = bool(shards)
        if not shards:
            return [], {}
        start = self._rotation % len(shards)
        self._rotation += 1
        shards = shards[start:] + shards[:start]
        fences = {s: leases.fence(s) for s in shards}
        events = await self.store.claim_batch(
            shards, config.batch_size, hold=config.on_dead_letter == "hold", exclude=exclude
        )
        return events, fences

    def _start_prefetch(self, lanes: int, sent: list[ClaimedEvent]) -> None:
        """Claim the next batch while the current one awaits Kafka (pipelining). It excludes
        the rows in flight (``sent``) and those being marked; it is only used if the current
        batch is confirmed in full, and its records are handed to the producer only after
        that, so batches reach the producer one after the other, in order."""
        exclude = [e.id for e in sent] + self._marking_ids
        self._prefetch = asyncio.create_task(
            self._claim(lanes, exclude), name=f"relay-prefetch-{self.index}"
        )

    async def _drop_prefetch(self) -> None:
        task, self._prefetch = self._prefetch, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, StoreError):
                await task

    async def _finish_marking(self) -> None:
        """Wait for the background mark of the lane's previous batch (pipelining)."""
        task, self._marking = self._marking, None
        try:
            if task is not None:
                await task
        finally:
            self._marking_ids = []
            self._marking_shards = set()

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
        failure: BaseException | None = None
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
        try:
            futures = await producer.send_many([r for _, r in sendable])
        except Exception as exc:
            return [], dead, exc
        if after_send is not None:
            after_send()
        # Bounded: with several lanes another lane may recreate the producer while these
        # records are in flight, and a producer stopped mid-flight can leave their futures
        # unresolved (seen in the Kafka outage test). Not confirmed in time = transient.
        wait_s = 2 * self._deps.config.request_timeout_ms / 1000 + 5
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*futures, return_exceptions=True), wait_s
            )
        except TimeoutError as exc:
            return [], dead, exc
        confirmed: list[ClaimedEvent] = []
        suspects: list[ClaimedEvent] = []
        for (event, _), result in zip(sendable, results, strict=True):
            if not isinstance(result, BaseException):
                confirmed.append(event)
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
        await future

    # -- mark ------------------------------------------------------------------------------

    async def _mark_published(
        self, ids: list[int], shard_fences: list[tuple[int, int]], first: ClaimedEvent
    ) -> int:
        n = await self._retry_store(
            "mark", lambda: self.mark_store.mark_published(ids, shard_fences), first
        )
        if n is None:
            return 0
        if n < len(ids):
            log.warning(
                "%d of %d published events not marked: lease lost, they will be sent again",
                len(ids) - n,
                len(ids),
            )
        m.PUBLISHED.inc(n)
        return n

    async def _dead_letter(self, event: ClaimedEvent, fence: int, reason: str) -> None:
        n = await self._retry_store(
            "mark_dead_lettered",
            lambda: self.store.mark_dead_lettered(event.id, fence, reason),
            event,
        )
        if n:
            m.DEAD_LETTERED.inc()
            log.error(
                "event dead-lettered: %s",
                reason,
                extra={"event_id": str(event.event_id), "partition_key": event.partition_key},
            )

    async def _retry_store(
        self, stage: str, call: Callable[[], Awaitable[int]], event: ClaimedEvent
    ) -> int | None:
        """Retry a write after a successful send until it lands (C04). Gives up only when
        stopping, after the third attempt (the rows are then simply sent again later)."""
        attempt = 0
        while True:
            try:
                return await call()
            except StoreError as exc:
                attempt += 1
                m.RETRIES.labels(stage=stage).inc()
                log.warning(
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
