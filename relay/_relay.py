"""The relay daemon: publish committed outbox events to Kafka, in per-key commit order.

Read design: status marking inside leased shards
------------------------------------------------
Every outbox row carries ``shard = crc32(partition_key) % shard_count`` (written by the
producer, see ``outbox.shard_of``). A relay publishes only shards it holds a lease on
(``<outbox>_relay_lease``: shard, owner, fence, expires_at); one owner per shard at a time
means events of one key are sent by one relay, one batch after the other, in id order (G3).

Heartbeat (every ``heartbeat_interval_s``, its own connection; times are the DATABASE's
``now()``, never a relay's clock):

1. upsert the member row (``<outbox>_relay_member``), count live members; fair share =
   ``ceil(shard_count / live)``;
2. renew own leases under their fences; a shard not renewed is LOST and no longer published;
3. below the fair share: acquire free or expired shards (``fence + 1``; ``FOR UPDATE SKIP
   LOCKED`` in a subselect so two relays never take the same one);
4. above it: drain the extras (not claimed any more) and release them once no batch in
   flight holds them.

Each lease also has a local monotonic deadline (send time of the last successful renewal +
ttl - margin): when it passes without renewal (database unreachable) the shard is no longer
published, so a relay cut off from the database never competes with the relay that took its
shard over. Lease row ``-1`` elects the maintenance leader (cleanup of published rows,
pending gauges).

Per batch: claim up to ``batch_size`` pending rows (``status = 0``) of the usable shards,
per shard in id order (LATERAL over the partial index ``(shard, id) WHERE status = 0``,
shards rotated between batches so none starves); send them all, then await all delivery
confirmations; then mark the confirmed ones ``status = 1`` in ONE ``UPDATE ... WHERE id =
ANY(...)`` that also checks, in SQL, that this relay still holds each shard under the fence
it claimed it with. No cursor, no "last id seen": an event whose transaction commits late
(C01) is simply pending and the next claim finds it. In :meth:`Relay.run` a clean batch's
mark runs in the background (own connection) while the next batch is claimed, excluding the
rows being marked by id, and sent; at most one mark is in flight (measured to help). The
next batch is also claimed while the current one awaits its confirmations (prefetch), and
handed to the producer only once the current one is confirmed in full; a batch with a
failure drops the prefetched claim.

Lanes: the batches above run in ``config.lanes`` concurrent pipelines ("lanes"), each with
its own claim and mark connections and its own prefetch / background mark, sharing the one
producer. Lane ``i`` claims only the usable shards with ``shard % lanes == i``: a shard maps
to exactly one lane, so rows of one shard (and key) are handed to the producer by one
pipeline, one batch after the other, in id order (G3 as above). The relay mostly waits on
PostgreSQL and Kafka; lanes overlap those waits. Lanes follow the load: one runs while the
relay keeps up (lowest latency and database load), all of them while claims come back full;
the count changes only between batches, after every running lane's batch is confirmed and
marked, so ``shard % lanes`` never moves a shard with rows in flight.

Why not a snapshot (xid) cursor: status marking is simpler, has no "cursor ahead of the
database" failure mode after a restore from a dump, and its per-row write is batched into
one UPDATE per batch. Its cost: one row update per event (and the cleanup of those rows).

Failures: Kafka errors are classified by class (``relay._policy``). Transient ones leave the
rows pending (resent with the same key and event id) and back off exponentially with jitter
(the producer is recreated after repeated failures); permanent ones dead-letter the row
(``status = 2``, ``last_error``). With ``on_dead_letter="hold"`` later events of that partition key
wait (the claim skips them) until an operator replays or discards the dead one; with
``"skip"`` they are published. A failed mark after a successful send is retried with
backoff; if the process dies meanwhile the rows are sent again (duplicates carry the same
event id, consumers drop them, G4). Database errors back off and reconnect; the daemon never
exits on them.

Known limits: a record already handed to the producer when its lease is lost can still land
after the new owner's copy (bounded by ``request_timeout_ms``); if a send of an earlier event
of a key times out while a later event of the key (in a later producer batch) is confirmed,
the earlier one is sent again after it. Consumers keep per-aggregate order with the version
check (G5). A broker-side permanent reject cannot recall a later event of the same key that
was already in flight in the same batch; "hold" applies to everything not yet sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable

from ledgerbox._core.backoff import Backoff
from ledgerbox._core.errors import BrokerError
from ledgerbox._core.faults import Fault
from ledgerbox._core.names import (
    CONTENT_TYPE,
    H_AGG_ID,
    H_AGG_TYPE,
    H_AGG_VERSION,
    H_CONTENT_TYPE,
    H_ID,
    H_KEY,
    H_SOURCE,
    H_SPEC,
    H_TIME,
    H_TYPE,
    KNOWN_HEADERS,
)
from ledgerbox.relay import _metrics as m
from ledgerbox.relay._config import RelayConfig
from ledgerbox.relay._errors import StoreError
from ledgerbox.relay._policy import (
    LEADER_SHARD,
    LeaseBook,
    fair_share,
    held_behind_dead_letter,
    publish_fault,
)
from ledgerbox.relay._publisher import KafkaPublisher, OutboundRecord, Publisher
from ledgerbox.relay._store import ClaimedEvent, RelayStore

__all__ = ["TEST_MARK_DELAY_ENV", "Relay", "to_record"]

log = logging.getLogger("ledgerbox.relay")

#: TEST-ONLY hook: sleep this many milliseconds between "Kafka confirmed the batch" and
#: "mark it published" (fault case C02 kills the process in that window). Never set it in
#: production.
TEST_MARK_DELAY_ENV = "LEDGERBOX_RELAY_TEST_MARK_DELAY_MS"

_RECREATE_PRODUCER_AFTER = 3
#: With several lanes configured, the relay runs them all while there is a backlog and goes
#: back to one lane once the lanes' claims stayed small for this long (seconds).
_SCALE_DOWN_AFTER_S = 2.0
_STATS_INTERVAL_S = 5.0


_SPEC = (H_SPEC, b"1.0")
_CONTENT_TYPE = (H_CONTENT_TYPE, CONTENT_TYPE.encode())


def to_record(event: ClaimedEvent) -> OutboundRecord:
    """The Kafka record of a claimed row: key, payload JSON as stored, event time, headers.

    The headers are those of :func:`outbox.kafka_headers` (same names, order and bytes),
    built from the text columns the claim pre-formats: only what varies per row is encoded.
    """
    headers = [
        _SPEC,
        (H_ID, event.event_id.encode()),
        (H_TYPE, event.event_type.encode()),
        (H_SOURCE, event.source.encode()),
        (H_TIME, event.occurred_at_iso.encode()),
        _CONTENT_TYPE,
        (H_KEY, event.idempotency_key.encode()),
        (H_AGG_TYPE, event.aggregate_type.encode()),
        (H_AGG_ID, event.aggregate_id.encode()),
    ]
    if event.aggregate_version is not None:
        headers.append((H_AGG_VERSION, event.aggregate_version.encode()))
    if event.headers != "{}":
        extra: dict[str, str] = json.loads(event.headers)
        headers.extend((k, v.encode()) for k, v in extra.items() if k not in KNOWN_HEADERS)
    return OutboundRecord(
        topic=event.topic,
        key=event.partition_key.encode(),
        value=event.payload.encode(),
        timestamp_ms=event.occurred_at_ms,
        headers=headers,
    )


class _Lane:
    """State of one claim -> publish -> mark pipeline (the shards ``shard % lanes == index``)."""

    def __init__(self, index: int, store: RelayStore, mark_store: RelayStore) -> None:
        self.index = index
        self.store = store
        # Marks run on their own connection so that they overlap the next claim (pipelining).
        self.mark_store = mark_store
        self.wake = asyncio.Event()
        self.inflight: set[int] = set()
        self.marking: asyncio.Task[int] | None = None
        self.prefetch: asyncio.Task[tuple[list[ClaimedEvent], dict[int, int]]] | None = None
        self.marking_ids: list[int] = []
        self.marking_shards: set[int] = set()
        self.rotation = 0

    @property
    def stores(self) -> tuple[RelayStore, RelayStore]:
        return self.store, self.mark_store


def _reason(exc: BaseException) -> str:
    # A translated Kafka error is named by the client's class (e.g. MessageSizeTooLargeError).
    name = exc.kind if isinstance(exc, BrokerError) else type(exc).__name__
    text = str(exc)
    return f"{name}: {text}" if text else name


class Relay:
    """Publishes committed outbox events to Kafka (at least once, per-key commit order).

    Parameters
    ----------
    config : RelayConfig
    publisher : Publisher | None
        The broker client; default :class:`relay._publisher.KafkaPublisher` built from
        ``config``. Tests pass :class:`relay.testing.InMemoryPublisher`.
    store : RelayStore | None
        The storage seam of the hot path (claim, mark); tests pass one with injected faults.
    clock : Callable[[], float]
        Monotonic clock in seconds (lease deadlines).

    Examples
    --------
    >>> relay = Relay(RelayConfig(database_url=url, kafka_bootstrap_servers="127.0.0.1:9092"))
    >>> await relay.run()          # doctest: +SKIP  (until relay.stop())
    """

    def __init__(
        self,
        config: RelayConfig,
        *,
        publisher: Publisher | None = None,
        store: RelayStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.relay_id = config.member_id
        self._publisher: Publisher = publisher or KafkaPublisher(
            config.kafka_bootstrap_servers,
            compression=config.compression,
            linger_ms=config.linger_ms,
            max_batch_bytes=config.producer_batch_bytes,
            request_timeout_ms=config.request_timeout_ms,
        )
        self._lanes = [
            _Lane(
                i,
                store or RelayStore(config, "main" if config.lanes == 1 else f"main{i}"),
                store or RelayStore(config, "mark" if config.lanes == 1 else f"mark{i}"),
            )
            for i in range(config.lanes)
        ]
        self._lease_store = RelayStore(config, "lease")
        self._maint_store = RelayStore(config, "maint")
        self._listen_store = RelayStore(config, "listen")
        self._clock = clock
        margin_s = min(
            config.lease_ttl_s / 2, max(config.heartbeat_interval_s, config.lease_ttl_s * 0.2)
        )
        self._book = LeaseBook(config.lease_ttl_s, margin_s)
        self._backoff = Backoff(base_s=0.1, max_s=config.backoff_max_s)
        self._stopping = asyncio.Event()
        self._leases_ready = False
        self._producer_ready = False
        # Lanes share the producer: its start and stop never run twice at once.
        self._producer_lock = asyncio.Lock()
        self._publish_failures = 0
        self._last_cleanup = -float("inf")
        self._mark_delay_s = int(os.environ.get(TEST_MARK_DELAY_ENV, "0") or 0) / 1000
        # Adaptive lanes (run()): ``_active`` lanes run, shards split by ``shard % _active``.
        self._active = 1
        self._wanted = 1
        self._regroup = asyncio.Event()
        self._last_busy = -float("inf")

    # -- public API ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until :meth:`stop` is called; then release the batch in flight, flush the
        producer, release the leases and the member row. Never raises on database or Kafka
        errors (it backs off and retries)."""
        tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="relay-heartbeat"),
            asyncio.create_task(self._listen_loop(), name="relay-listen"),
            asyncio.create_task(self._maintenance_loop(), name="relay-maintenance"),
        ]
        try:
            await self._main_loop()
        except asyncio.CancelledError:
            # Cancelled (not stopped): abandon a mark still retrying; its rows stay pending
            # and are sent again later with the same event ids.
            for lane in self._lanes:
                if lane.marking is not None:
                    lane.marking.cancel()
                if lane.prefetch is not None:
                    lane.prefetch.cancel()
            raise
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self.aclose()

    async def run_once(self) -> int:
        """One cycle: heartbeat (membership and leases), then one claim/publish/mark per
        lane (the lanes one after the other).

        Returns
        -------
        int
            Number of events confirmed by Kafka and marked published in this cycle (all
            lanes).

        Raises
        ------
        StoreError
            A database call failed (``run`` retries instead).
        """
        await self._heartbeat_once()
        if not await self._ensure_producer():
            return 0
        total = 0
        self._active = len(self._lanes)
        for lane in self._lanes:
            _, published = await self._publish_batch(lane)
            total += published
        return total

    def stop(self) -> None:
        """Ask :meth:`run` to finish (safe to call from a signal handler in the loop)."""
        self._stopping.set()
        self._wake_all()

    def _wake_all(self) -> None:
        for lane in self._lanes:
            lane.wake.set()

    async def aclose(self) -> None:
        """Release leases and the member row, flush and stop the producer, disconnect."""
        self._stopping.set()  # a mark still retrying gives up after its third attempt
        for lane in self._lanes:
            with contextlib.suppress(asyncio.CancelledError):
                await self._drop_prefetch(lane)
            with contextlib.suppress(asyncio.CancelledError):
                await self._finish_marking(lane)
        held = self._book.held()
        self._book.expire_all()
        m.OWNED_SHARDS.set(0)
        with contextlib.suppress(StoreError):
            await self._lease_store.release_shards(held)
        with contextlib.suppress(StoreError):
            await self._lease_store.leave()
        if self._producer_ready:
            self._producer_ready = False
            await self._publisher.stop()
        stores = [self._lease_store, self._maint_store, self._listen_store]
        for lane in self._lanes:
            stores += [lane.store, lane.mark_store]
        for store in stores:
            await store.aclose()

    async def __aenter__(self) -> Relay:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def owned_shards(self) -> list[int]:
        """Data shards this relay may publish now (for tests and status)."""
        return self._book.usable(self._clock())

    @property
    def active_lanes(self) -> int:
        """Pipelines running now in :meth:`run`: ``config.lanes`` while claims come back full
        (a backlog), 1 once the relay keeps up (lowest latency and database load)."""
        return self._active

    def is_leader(self) -> bool:
        """True while this relay holds the maintenance-leader lease."""
        return self._book.is_leader(self._clock())

    async def cleanup_once(self) -> int:
        """Delete published rows older than ``retention_s`` in bounded batches (leader only;
        returns 0 when this relay is not the leader). Returns the number deleted."""
        if not self.is_leader():
            return 0
        total = 0
        while not self._stopping.is_set() and self.is_leader():
            n = await self._maint_store.cleanup_published(
                self.config.retention_s, self.config.cleanup_batch_size
            )
            total += n
            if n < self.config.cleanup_batch_size:
                break
            await self._sleep(self.config.cleanup_pause_s)
        await self._maint_store.cleanup_members()
        return total

    # -- leases ----------------------------------------------------------------------------

    async def _heartbeat_once(self) -> None:
        cfg = self.config
        ttl = cfg.lease_ttl_s
        if not self._leases_ready:
            await self._lease_store.ensure_leases(cfg.shard_count)
            self._leases_ready = True
        live = await self._lease_store.heartbeat(ttl)
        sent_at = self._clock()
        renewed = await self._lease_store.renew_shards(self._book.held(), ttl)
        lost = self._book.renewed(renewed, sent_at)
        if lost:
            log.warning("lost shard leases %s", lost, extra={"shards": lost})
        want, drain = self._book.plan(fair_share(cfg.shard_count, live))
        if drain:
            log.info("draining shards %s (fair share, %d live relays)", drain, live)
        if want:
            sent_at = self._clock()
            grants = await self._lease_store.acquire_shards(want, ttl, lo=0, hi=cfg.shard_count - 1)
            new = self._book.granted(grants, sent_at)
            if new:
                log.info("acquired shards %s", new, extra={"shards": new})
                self._wake_all()
        if not self._book.is_leader(self._clock()):
            sent_at = self._clock()
            grants = await self._lease_store.acquire_shards(
                1, ttl, lo=LEADER_SHARD, hi=LEADER_SHARD
            )
            if grants:
                self._book.granted(grants, sent_at)
                log.info("became maintenance leader")
        await self._release_drained()
        m.OWNED_SHARDS.set(len(self._book.data_shards()))

    async def _release_drained(self) -> None:
        busy: set[int] = set()
        for lane in self._lanes:
            busy |= lane.inflight | lane.marking_shards
        free = [s for s in self._book.draining() if s not in busy]
        if not free:
            return
        held = [(s, self._book.fence(s)) for s in free]
        self._book.drop(free)
        await self._lease_store.release_shards(held)

    # -- the hot path --------------------------------------------------------------------------

    async def _ensure_producer(self) -> bool:
        async with self._producer_lock:
            if self._producer_ready:
                return True
            try:
                await self._publisher.start()
            except Exception as exc:
                self._publish_failures += 1
                m.RETRIES.labels(stage="producer").inc()
                log.warning(
                    "Kafka producer cannot start: %s",
                    _reason(exc),
                    extra={"attempt": self._publish_failures},
                )
                return False
            self._producer_ready = True
            return True

    async def _claim(
        self, lane: _Lane, exclude: list[int]
    ) -> tuple[list[ClaimedEvent], dict[int, int]]:
        """Claim the next batch of the lane's usable shards; returns it with the fences it
        was claimed under.

        Clears the lane's wake flag first: a NOTIFY that arrives from here on sets it again,
        so "flag set" means "a commit may have landed after the last claim began"."""
        lane.wake.clear()
        lanes = self._active
        shards = [s for s in self._book.usable(self._clock()) if s % lanes == lane.index]
        if not shards:
            return [], {}
        start = lane.rotation % len(shards)
        lane.rotation += 1
        shards = shards[start:] + shards[:start]
        fences = {s: self._book.fence(s) for s in shards}
        events = await lane.store.claim_batch(
            shards,
            self.config.batch_size,
            hold=self.config.on_dead_letter == "hold",
            exclude=exclude,
        )
        return events, fences

    def _start_prefetch(self, lane: _Lane, sent: list[ClaimedEvent]) -> None:
        """Claim the next batch while the current one awaits Kafka (pipelining). It excludes
        the rows in flight (``sent``) and those being marked; it is only used if the current
        batch is confirmed in full, and its records are handed to the producer only after
        that, so batches reach the producer one after the other, in order."""
        exclude = [e.id for e in sent] + lane.marking_ids
        lane.prefetch = asyncio.create_task(
            self._claim(lane, exclude), name=f"relay-prefetch-{lane.index}"
        )

    async def _drop_prefetch(self, lane: _Lane) -> None:
        task, lane.prefetch = lane.prefetch, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, StoreError):
                await task

    async def _publish_batch(self, lane: _Lane, *, pipelined: bool = False) -> tuple[int, int]:
        """Claim, publish, mark one batch of ``lane``; returns ``(claimed, marked published)``.

        ``pipelined``: while a batch awaits its delivery confirmations the next one is
        claimed; a clean batch's mark runs in the background while the next batch is sent
        (its rows excluded from the claims); at most one mark in flight. The returned count
        then includes rows whose mark is still running.
        """
        started = time.perf_counter()
        task, lane.prefetch = lane.prefetch, None
        events: list[ClaimedEvent] = []
        fences: dict[int, int] = {}
        if task is not None:
            events, fences = await task
        leaving = self._regroup.is_set() or self._stopping.is_set()
        if not events and not leaving and (task is None or lane.wake.is_set()):
            # Nothing prefetched, or the prefetch found nothing and a NOTIFY came in since it
            # began: claim afresh. (An empty prefetch without a NOTIFY since needs no second
            # claim: at low load that halves the claims.) Not when the lane is about to stop:
            # that claim would clear the wake flag of a lane that then waits for it; the next
            # group of lanes claims afresh anyway.
            events, fences = await self._claim(lane, lane.marking_ids)
        if not events:
            await self._finish_marking(lane)
            return 0, 0
        # The claim may have been slow: publish only shards still held under the same fence.
        usable = {
            s for s in self._book.usable(self._clock()) if self._book.fence(s) == fences.get(s)
        }
        events = [e for e in events if e.shard in usable]
        lane.inflight = {e.shard for e in events}
        try:
            after_send = (lambda: self._start_prefetch(lane, events)) if pipelined else None
            confirmed, dead, failure = await self._publish(events, after_send)
            if failure is not None or dead:
                # The prefetched claim may hold later rows of a key whose row failed or died.
                await self._drop_prefetch(lane)
            for event, reason in dead:
                await self._dead_letter(lane, event, fences[event.shard], reason)
            await self._finish_marking(lane)
            published = 0
            if confirmed:
                if self._mark_delay_s:
                    await asyncio.sleep(self._mark_delay_s)
                ids = [e.id for e in confirmed]
                shard_fences = sorted({(e.shard, fences[e.shard]) for e in confirmed})
                if pipelined and failure is None and not dead:
                    lane.marking_ids = ids
                    lane.marking_shards = {s for s, _ in shard_fences}
                    # The background mark keeps ids and fences only, not the batch's rows
                    # (peak RSS with several lanes).
                    lane.marking = asyncio.create_task(
                        self._mark_published(lane, ids, shard_fences, confirmed[0])
                    )
                    published = len(confirmed)
                else:
                    published = await self._mark_published(lane, ids, shard_fences, confirmed[0])
        except BaseException:
            await self._drop_prefetch(lane)
            raise
        finally:
            lane.inflight = set()
        m.PUBLISH_BATCH_DURATION.observe(time.perf_counter() - started)
        if failure is not None:
            await self._after_publish_failure(failure, events)
        else:
            self._publish_failures = 0
        await self._release_drained()
        return len(events), published

    async def _finish_marking(self, lane: _Lane) -> None:
        """Wait for the background mark of the lane's previous batch (pipelining)."""
        task, lane.marking = lane.marking, None
        try:
            if task is not None:
                await task
        finally:
            lane.marking_ids = []
            lane.marking_shards = set()

    async def _publish(
        self, events: list[ClaimedEvent], after_send: Callable[[], None] | None = None
    ) -> tuple[list[ClaimedEvent], list[tuple[ClaimedEvent, str]], BaseException | None]:
        """Send all, call ``after_send`` (records handed over), then await all.
        Returns (confirmed, dead with reason, transient error)."""
        on_dead_letter = self.config.on_dead_letter
        rejected: set[str] = set()
        dead: list[tuple[ClaimedEvent, str]] = []
        sendable: list[tuple[ClaimedEvent, OutboundRecord]] = []
        failure: BaseException | None = None
        for event in events:
            if held_behind_dead_letter(on_dead_letter, event.partition_key, rejected):
                continue
            record = to_record(event)
            refused = self._publisher.precheck(record)
            if refused is not None:
                # Refused before sending: later events of the key are not sent either (hold).
                dead.append((event, _reason(refused)))
                rejected.add(event.partition_key)
                continue
            sendable.append((event, record))
        try:
            futures = await self._publisher.send_many([r for _, r in sendable])
        except Exception as exc:
            return [], dead, exc
        if after_send is not None:
            after_send()
        # Bounded: with several lanes another lane may recreate the producer while these
        # records are in flight, and a producer stopped mid-flight can leave their futures
        # unresolved (seen in the Kafka outage test). Not confirmed in time = transient.
        wait_s = 2 * self.config.request_timeout_ms / 1000 + 5
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

    async def _isolate(
        self, suspects: list[ClaimedEvent], rejected: set[str]
    ) -> tuple[list[ClaimedEvent], list[tuple[ClaimedEvent, str]], BaseException | None]:
        ok: list[ClaimedEvent] = []
        bad: list[tuple[ClaimedEvent, str]] = []
        for event in suspects:
            if held_behind_dead_letter(self.config.on_dead_letter, event.partition_key, rejected):
                continue
            try:
                (future,) = await self._publisher.send_many([to_record(event)])
                await future
            except Exception as exc:
                if publish_fault(exc) is not Fault.MESSAGE:
                    return ok, bad, exc
                bad.append((event, _reason(exc)))
                rejected.add(event.partition_key)
                continue
            ok.append(event)
        return ok, bad, None

    async def _after_publish_failure(self, exc: BaseException, events: list[ClaimedEvent]) -> None:
        self._publish_failures += 1
        attempt = self._publish_failures
        m.RETRIES.labels(stage="publish").inc()
        first = events[0] if events else None
        log.warning(
            "publish failed (transient), rows stay pending: %s",
            _reason(exc),
            extra={
                "attempt": attempt,
                "event_id": str(first.event_id) if first else None,
                "partition_key": first.partition_key if first else None,
            },
        )
        if attempt % _RECREATE_PRODUCER_AFTER == 0:
            async with self._producer_lock:
                if self._producer_ready:
                    self._producer_ready = False
                    await self._publisher.stop()
        await self._sleep(self._backoff.delay_s(attempt))

    async def _mark_published(
        self, lane: _Lane, ids: list[int], shard_fences: list[tuple[int, int]], first: ClaimedEvent
    ) -> int:
        n = await self._retry_store(
            "mark", lambda: lane.mark_store.mark_published(ids, shard_fences), first
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

    async def _dead_letter(self, lane: _Lane, event: ClaimedEvent, fence: int, reason: str) -> None:
        n = await self._retry_store(
            "mark_dead_lettered",
            lambda: lane.store.mark_dead_lettered(event.id, fence, reason),
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
        stopping (the rows are then simply sent again later)."""
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
                if self._stopping.is_set() and attempt >= 3:
                    return None
                await asyncio.sleep(self._backoff.delay_s(attempt))

    # -- loops -----------------------------------------------------------------------------

    async def _main_loop(self) -> None:
        """Run the active lanes until stopped. When the load asks for another lane count, the
        lanes finish their batch (confirmed, marked, prefetch dropped) and stop, then the new
        count starts: a shard moves to another lane only between batches, never with a batch
        in flight (G3). The first unexpected error stops the other lanes and is raised."""
        while not self._stopping.is_set():
            self._active = self._wanted
            m.ACTIVE_LANES.set(self._active)
            self._regroup.clear()
            lanes = self._lanes[: self._active]
            tasks = [
                asyncio.create_task(self._lane_loop(lane), name=f"relay-lane-{lane.index}")
                for lane in lanes
            ]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            failed = [
                t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None
            ]
            if failed:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise failed[0].exception()  # type: ignore[misc]
            if self._wanted < self._active:
                # Caught up: the lanes that stop release their database connections.
                kept = {id(s) for lane in self._lanes[: self._wanted] for s in lane.stores}
                for lane in self._lanes[self._wanted : self._active]:
                    for store in lane.stores:
                        if id(store) not in kept:  # (tests may share one store)
                            await store.aclose()
            if self._wanted != self._active and not self._stopping.is_set():
                log.info(
                    "lanes %d -> %d (%s)",
                    self._active,
                    self._wanted,
                    "backlog" if self._wanted > self._active else "caught up",
                )

    def _adapt_lanes(self, claimed: int) -> None:
        """Scale the lanes with the load: all of them once one lane's claim comes back full
        (a backlog); back to one once, for ``_SCALE_DOWN_AFTER_S``, no lane claimed more
        than half a batch's share (``batch_size / (2 * running lanes)``: one lane would then
        claim at most half a batch per cycle). The gap between the two thresholds keeps a
        steady load from flipping the count (one pipeline has the lowest latency and
        database load when the relay keeps up)."""
        most = len(self._lanes)
        if most == 1:
            return
        now = self._clock()
        batch = self.config.batch_size
        if self._active == 1:
            if claimed >= batch:
                self._last_busy = now
                self._request_regroup(most)
        elif claimed * 2 * self._active > batch:
            self._last_busy = now
        elif now - self._last_busy > _SCALE_DOWN_AFTER_S:
            self._request_regroup(1)

    def _request_regroup(self, lanes: int) -> None:
        if self._regroup.is_set():
            return
        self._wanted = lanes
        self._regroup.set()
        self._wake_all()

    async def _lane_loop(self, lane: _Lane) -> None:
        attempt = 0
        while not self._stopping.is_set() and not self._regroup.is_set():
            try:
                if not await self._ensure_producer():
                    await self._sleep(self._backoff.delay_s(self._publish_failures))
                    continue
                claimed, _ = await self._publish_batch(lane, pipelined=True)
                attempt = 0
            except StoreError as exc:
                attempt += 1
                m.RETRIES.labels(stage="db").inc()
                log.warning("database error: %s", exc, extra={"attempt": attempt})
                await self._sleep(self._backoff.delay_s(attempt))
                continue
            self._adapt_lanes(claimed)
            if claimed or self._regroup.is_set() or self._stopping.is_set():
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lane.wake.wait(), self.config.poll_interval_s)
        if not self._stopping.is_set():
            # Regrouping: nothing of this lane may be in flight when its shards move (on stop,
            # close() does the same).
            await self._drop_prefetch(lane)
            await self._finish_marking(lane)

    async def _heartbeat_loop(self) -> None:
        attempt = 0
        while not self._stopping.is_set():
            try:
                await self._heartbeat_once()
                attempt = 0
            except StoreError as exc:
                attempt += 1
                m.RETRIES.labels(stage="heartbeat").inc()
                log.warning("heartbeat failed: %s", exc, extra={"attempt": attempt})
            await self._sleep(self.config.heartbeat_interval_s)

    async def _listen_loop(self) -> None:
        attempt = 0
        while not self._stopping.is_set():
            try:
                # The first item comes once LISTEN is active: a commit before it notified
                # no one, so every lane claims then (and on every notification after).
                async for _ in self._listen_store.notifications():
                    attempt = 0
                    self._wake_all()
            except StoreError as exc:
                attempt += 1
                m.RETRIES.labels(stage="listen").inc()
                log.warning("LISTEN connection lost: %s", exc, extra={"attempt": attempt})
                await self._listen_store.aclose()
                await self._sleep(self._backoff.delay_s(attempt))

    async def _maintenance_loop(self) -> None:
        attempt = 0
        while not self._stopping.is_set():
            if self.is_leader():
                try:
                    stats = await self._maint_store.stats(self.config.shard_count)
                    m.PENDING_EVENTS.set(stats.pending)
                    m.OLDEST_PENDING_AGE.set(stats.oldest_pending_age_s or 0.0)
                    now = self._clock()
                    if now - self._last_cleanup >= self.config.cleanup_interval_s:
                        self._last_cleanup = now
                        deleted = await self.cleanup_once()
                        if deleted:
                            log.info("cleanup deleted %d published rows", deleted)
                    attempt = 0
                except StoreError as exc:
                    attempt += 1
                    m.RETRIES.labels(stage="maintenance").inc()
                    log.warning("maintenance failed: %s", exc, extra={"attempt": attempt})
            await self._sleep(_STATS_INTERVAL_S)

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake at once when stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), max(0.0, seconds))
