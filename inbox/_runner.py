"""The Kafka side of an inbox consumer: fetch, one worker task per partition, offset commits,
rebalances.

Offsets: a partition worker advances its position only past records whose pipeline finished
(applied, duplicate, ignored or dead-lettered); positions are committed every
``commit_interval_ms`` and always before a partition is given up (revoke, stop). A record
whose processing was abandoned (revoked mid-retry) is not committed: the next owner reads it
again and the inbox recognises it if its effect had committed.

Batches across partitions (``ConsumerConfig.batch_across_partitions``, default on;
docs/inbox.md, "Across partitions"): a worker that starts a batch with room left
(``batch_max_records``) takes in the records waiting on idle workers of this consumer, each
partition's in offset order after its own, and runs them in ONE call of the batched
pipeline. A lent worker waits until its records come back: the applied ones move its
position; where a run rolls back (or a record cannot share a transaction) the batch ends,
and the records from there on go back to the front of their partitions' queues, each worker
then running its own in a batch neither lent nor lending. So a partition's records are
never in two batches at once, a failing or retrying record holds up only its own partition
(a slow one holds up its batch), and a revoke (``aclose``) of a lent partition waits for the
batch holding its records, so their positions are committed before the partition moves.
Off with ``lock_aggregates`` (every run is one record) and ``batch_max_records=1``. Why: at
1,000 events/s spread over 3 partitions each relay batch reached the consumer as three small
transactions; one instead cut the consumer's CPU by ~20% and PostgreSQL's by ~9%
(docs/performance.md, "Measured in the twelfth session").

Stop (docs/operations.md, "Stopping a daemon"): fetching stops, the in-flight records finish
(database, not Kafka), then the final offset commit and the client's stop (leave the group)
get ``stop_timeout_s`` in all. aiokafka retries a commit until it finds the group
coordinator, so with the broker away a stop waited until Kafka came back (and was killed at
the end of the grace period); past the bound the offsets are left uncommitted (their records
come again after the restart, recognised by the inbox) and the client is closed by hand.

A broker that does not answer when the run starts is waited for (health ``down`` naming it,
one log line per change, backoff at most :data:`START_RETRY_MAX_S` apart); refused
credentials raise :class:`inbox.StartupError`.

A client that stops fetching is replaced (docs/inbox.md, "A Kafka client that stops fetching
is replaced"): aiokafka (0.14) runs its fetches in one background task, and when that task
dies (under uvloop a write to a connection the broker just closed raises ``RuntimeError``,
which aiokafka's connection does not turn into a connection error: aiokafka#1038)
``getmany`` returns nothing forever while the heartbeats keep the partitions assigned to
this member. The fetch loop checks the task after every empty ``getmany``. A fetch task
that is alive but stuck is caught by its effect: a partition this consumer waits on (no
record queued or in process, not paused) that got no fetch response for
:data:`FETCH_STALL_S` (a broker answers a fetch at least every ``fetch_max_wait_ms``,
records or not); that bound doubles after each such replacement, up to
:data:`FETCH_STALL_MAX_S`, while some partition stays without answers (an offline partition
is not helped by new clients), and is back to :data:`FETCH_STALL_S` once every partition
waited on is answered. When either happens, the records in process finish (a record in
retry is given up, as on a revoke), then the offset commits and the old client's stop get
``stop_timeout_s`` in all, its listener creates no more workers, and a new client joins the
group (health ``down`` "kafka" until it has started). Replacements in quick succession back
off (at most :data:`START_RETRY_MAX_S` apart). Records fetched but not processed come again
from the last commit; the inbox recognises any whose effect had committed.

Lag: about once per :data:`LAG_REFRESH_S` the fetch loop sets
``ledgerbox_inbox_lag_records{group,topic,partition}`` of each assigned partition to the
records not applied yet: end offset (last stable offset under ``read_committed``, else the
high watermark, both from the last fetch response: no request) minus the fetch position,
plus the records fetched and waiting or in process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from ledgerbox._core.stop import StopSignal, cancel_unawaited
from ledgerbox.inbox._checks import kafka_start_verdict
from ledgerbox.inbox._deps import PipelineDeps
from ledgerbox.inbox._errors import StartupError
from ledgerbox.inbox._policy import Outcome
from ledgerbox.inbox._record import Record

__all__ = [
    "START_RETRY_MAX_S",
    "BatchProcessor",
    "KafkaClientFailed",
    "KafkaRunner",
    "client_failure",
]

_log = logging.getLogger("ledgerbox.inbox")

#: Longest wait between two attempts to start the Kafka client, in seconds.
START_RETRY_MAX_S = 5.0

#: Least time the Kafka client's stop gets at the end of a stop, in seconds, even when the
#: offset commits spent ``stop_timeout_s``: with the broker away it fails at once, and the
#: client then closes its tasks and connections itself.
CLIENT_STOP_MIN_S = 1.0

#: Seconds an assigned partition the consumer waits on may go without a fetch response
#: before the client is replaced (module docstring): longer than aiokafka's
#: ``request_timeout_ms`` (40 s), after which the client itself gives up on a request.
FETCH_STALL_S = 45.0

#: The longest the stall bound grows to while replacements do not bring answers, seconds.
FETCH_STALL_MAX_S = 600.0

#: A replacement within this many seconds of the client's start counts as "in quick
#: succession" (the next one backs off further).
REPLACE_QUIET_S = 60.0

#: How often the lag gauges are refreshed while the consumer fetches, in seconds.
LAG_REFRESH_S = 1.0


class KafkaClientFailed(Exception):
    """The aiokafka client stopped fetching although it was not stopped:
    :meth:`KafkaRunner.run` replaces it. ``cause`` is one line; ``why`` is the label of
    ``ledgerbox_inbox_client_replaced_total`` (``fetch_task_died`` or
    ``no_fetch_response``)."""

    def __init__(self, cause: str, why: str) -> None:
        super().__init__(cause)
        self.cause = cause
        self.why = why


def client_failure(kafka: AIOKafkaConsumer) -> str | None:
    """Why ``kafka`` no longer fetches, or None while it does.

    aiokafka 0.14 keeps the fetch routine's task as ``Fetcher.error_future`` but nothing
    reads it: when the task dies, ``getmany`` waits out every timeout and returns ``{}``.
    A client whose ``_closed`` is set is being stopped and is not a failure. Reads private
    attributes; when they are missing (another aiokafka) it returns None, the former
    behaviour.
    """
    if getattr(kafka, "_closed", False):
        return None
    task = getattr(getattr(kafka, "_fetcher", None), "error_future", None)
    if not isinstance(task, asyncio.Future) or not task.done():
        return None
    if task.cancelled():
        return "its fetch task was cancelled"
    exc = task.exception()
    if exc is None:
        return "its fetch task ended"
    root = exc.__cause__ or exc
    return f"its fetch task died: {type(root).__name__}: {root}".splitlines()[0]


class BatchProcessor(Protocol):
    """The consumer's batched pipeline (``inbox._batch.BatchPipeline.process``)."""

    def __call__(
        self,
        records: Sequence[Record],
        abandon: Callable[[], bool],
        own: tuple[str, int] | None = None,
    ) -> Awaitable[list[Outcome]]:
        """One outcome per record, in order; it stops after the first ``ABANDONED``.
        ``own``: the partition of the worker running a batch that holds other partitions'
        records too; the first record not applied in a committed run then comes back
        ``ABANDONED`` (given back, with every record after it)."""
        ...


class KafkaRunner:
    """One run of a consumer against Kafka (until :meth:`stop`).

    Parameters
    ----------
    deps : PipelineDeps
        Uses ``config`` (Kafka settings, intervals, batch size) and, to probe Redis while it
        is down, ``dedup`` or ``lock`` and ``gate``.
    process_batch : BatchProcessor
        Runs the pipeline for the records a partition worker took from its queue.
    """

    def __init__(self, deps: PipelineDeps, process_batch: BatchProcessor) -> None:
        self.deps = deps
        self.process_batch = process_batch
        self.config = deps.config
        self.stopping = asyncio.Event()
        # Set once the in-flight records of a stop finished: from then on what waits on
        # Kafka (commits, the client's stop) gets config.stop_timeout_s in all.
        self.kafka_grace = StopSignal(self.config.stop_timeout_s)
        self.commit_given_up = False
        self.commit_wanted = asyncio.Event()
        self.commit_lock = asyncio.Lock()
        self.kafka: AIOKafkaConsumer | None = None
        self.workers: dict[TopicPartition, _PartitionWorker] = {}
        self.paused: set[TopicPartition] = set()
        # Set when the current client is being replaced, after its records in process
        # finished: its offset commits and its stop then get stop_timeout_s in all.
        self._retire = StopSignal(self.config.stop_timeout_s)
        self._listener: _Listener | None = None
        # Fetch watchdog: (last_poll_timestamp, monotonic time it was first seen) per
        # partition, and the current bound (FETCH_STALL_S, doubled per stall replacement).
        self._polled: dict[TopicPartition, tuple[int, float]] = {}
        self._stall_bound_s = FETCH_STALL_S
        # Partitions whose batch is reported as stalled (batch_stalls / report_stalls).
        self._stalled: set[TopicPartition] = set()

    @property
    def lending(self) -> bool:
        """Batches take in other partitions' records (module docstring): configured, room
        for more than one record, and no per-message aggregate lock (it makes every run
        one record: nothing to share)."""
        config = self.config
        return (
            config.batch_across_partitions
            and config.batch_max_records > 1
            and getattr(self.deps, "lock", None) is None
        )

    def stop(self) -> None:
        """Finish: stop fetching, let in-flight records complete, commit, leave the group."""
        self.stopping.set()

    async def run(self) -> None:
        """Consume until :meth:`stop`. A client that stopped fetching is replaced by a new
        one (module docstring); the run goes on.

        Raises
        ------
        StartupError
            If Kafka refused the credentials.
        """
        quick = 0  # replacements in quick succession
        while True:
            kafka = await self._started()
            if kafka is None:
                return  # stopped while waiting for the broker
            started = time.monotonic()
            failure = await self._serve(kafka)
            if failure is None or self.stopping.is_set():
                return
            quick = quick + 1 if time.monotonic() - started < REPLACE_QUIET_S else 0
            if quick:
                delay_s = min(self.config.backoff.ceiling_s(quick), START_RETRY_MAX_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), delay_s)

    async def _serve(self, kafka: AIOKafkaConsumer) -> str | None:
        """Consume with ``kafka`` until :meth:`stop` (None) or until the client fails (its
        cause, one line; the client is stopped and the partitions' work committed)."""
        config = self.config
        self.kafka = kafka
        retire = self._retire = StopSignal(config.stop_timeout_s)
        listener = self._listener
        self._polled = {}
        if config.assignment:
            self.start_workers(kafka.assignment())
        background = [
            asyncio.create_task(self._commit_loop()),
            asyncio.create_task(self._probe_loop()),
            # Its own task: it goes on while a stop or a client replacement waits for the
            # batches in flight (a review: from the fetch loop it stopped right then).
            asyncio.create_task(self._stall_loop()),
        ]
        failure: str | None = None
        try:
            await self._fetch_loop(kafka)
        except KafkaClientFailed as exc:
            failure = exc.cause
            self.deps.metrics.client_replaced[exc.why].inc()
            self.deps.health.fault(
                "kafka", f"Kafka client failed ({failure}): a new client joins the group"
            )
        finally:
            if listener is not None:
                listener.retired = True  # a rebalance finishing during its stop adds nothing
            await asyncio.gather(
                *(w.aclose() for w in self.workers.values()), return_exceptions=True
            )
            # The records in process finished: what waits on this client from now on (the
            # commits, also one in flight, and its stop) gets stop_timeout_s in all.
            grace = self.kafka_grace if failure is None else retire
            grace.set()
            await self.close_workers(list(self.workers))
            self.report_stalls({})  # the batches ended (or were given up)
            for task in background:
                task.cancel()
            for task in background:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await _stop_client(kafka, grace)
            self.kafka = None
        return failure

    def _client(self) -> AIOKafkaConsumer:
        config = self.config
        kafka = AIOKafkaConsumer(
            **config.kafka_settings.client_kwargs(),
            group_id=config.group_id,
            client_id=config.client_id or f"ledgerbox-inbox-{config.group_id}",
            enable_auto_commit=False,
            auto_offset_reset=config.auto_offset_reset,
            isolation_level="read_committed",
        )
        self._listener = None
        if config.assignment:
            kafka.assign([TopicPartition(t, p) for t, p in config.assignment])
        else:
            self._listener = _Listener(self)
            kafka.subscribe(list(config.topics), listener=self._listener)
        return kafka

    async def _started(self) -> AIOKafkaConsumer | None:
        # A new client per attempt: aiokafka's start() is not meant to be called twice.
        health, retry = self.deps.health, 0
        try:
            while not self.stopping.is_set():
                kafka = self._client()
                try:
                    await kafka.start()
                    health.clear("kafka")
                    return kafka
                except (KafkaError, OSError) as exc:
                    with contextlib.suppress(Exception):
                        await kafka.stop()
                    # aiokafka's "Unable to bootstrap" hides the cause: one login by hand.
                    verdict = await kafka_start_verdict(exc, self.config.kafka_settings)
                    if verdict.permanent:
                        raise StartupError(verdict.cause) from None
                    health.fault("kafka", verdict.cause or "kafka client did not start")
                retry += 1
                delay_s = min(self.config.backoff.ceiling_s(retry), START_RETRY_MAX_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), delay_s)
            return None
        finally:
            health.clear("kafka", resolved=False)  # no-op once started

    async def _fetch_loop(self, kafka: AIOKafkaConsumer) -> None:
        high = self.config.max_buffered_records
        next_lag = 0.0
        while not self.stopping.is_set():
            try:
                batches = await kafka.getmany(timeout_ms=100, max_records=500)
            except RuntimeError as exc:
                # aiokafka#1038 on a path that reports to getmany (a heartbeat's write).
                raise KafkaClientFailed(
                    f"it raised RuntimeError: {exc}".splitlines()[0], "fetch_task_died"
                ) from exc
            if not batches and (failure := client_failure(kafka)) is not None:
                raise KafkaClientFailed(failure, "fetch_task_died")
            # Fed before any await: a partition revoked and assigned back while this loop
            # waited would get a new worker, fed records fetched for the old assignment
            # (an adversarial review, 2026-12-05, with a stand-in client).
            for tp, records in batches.items():
                worker = self.workers.get(tp)
                if worker is None or worker.closing:
                    continue  # revoked meanwhile: the next owner reads it from the commit
                worker.feed(records)
                if len(worker.queue) >= high and tp not in self.paused:
                    kafka.pause(tp)
                    self.paused.add(tp)
            for tp in list(self.paused):
                worker = self.workers.get(tp)
                # max(1, ...): with max_buffered_records 1 a paused partition never resumed
                # (queue < 0), health ok (the same review).
                if worker is None or len(worker.queue) < max(1, high // 2):
                    self.paused.discard(tp)
                    if worker is not None:
                        kafka.resume(tp)
            if time.monotonic() >= next_lag:
                next_lag = time.monotonic() + LAG_REFRESH_S
                await self.refresh_lag(kafka)
                if (stall := self.fetch_stall(kafka)) is not None:
                    self._stall_bound_s = min(2 * self._stall_bound_s, FETCH_STALL_MAX_S)
                    raise KafkaClientFailed(stall, "no_fetch_response")
            for worker in self.workers.values():
                if worker.task.done() and not worker.closing:
                    worker.task.result()  # a bug in the pipeline: surface it

    async def refresh_lag(self, kafka: AIOKafkaConsumer) -> None:
        """Set the lag gauge of every partition with a worker (module docstring, "Lag").
        A partition whose end offset or position is not known yet keeps its last value."""
        metrics = self.deps.metrics
        for tp, worker in list(self.workers.items()):
            try:
                end = kafka.last_stable_offset(tp)
                if end is None:
                    end = kafka.highwater(tp)
                if end is None:
                    continue
                position = await asyncio.wait_for(kafka.position(tp), 0.05)
            except (KafkaError, TimeoutError, AssertionError, KeyError, AttributeError):
                continue  # being revoked or not positioned yet
            waiting = len(worker.queue) + worker.in_process
            metrics.set_lag(tp.topic, tp.partition, max(0, end - position) + waiting)

    def fetch_stall(self, kafka: AIOKafkaConsumer, now: float | None = None) -> str | None:
        """A partition this consumer waits on (nothing queued or in process, not paused)
        that got no fetch response for the current stall bound, as one line; else None.

        Times are monotonic: aiokafka's ``last_poll_timestamp`` (wall clock, ms) is only
        compared with its previous value, and a new value counts from when it was first
        seen here (at most :data:`LAG_REFRESH_S` late). The bound goes back to
        :data:`FETCH_STALL_S` when every partition waited on was answered within it.
        ``now``: ``time.monotonic()`` unless given (tests)."""
        now = time.monotonic() if now is None else now
        waiting, answered = 0, 0
        for tp, worker in list(self.workers.items()):
            if worker.closing or worker.queue or worker.in_process or tp in self.paused:
                continue
            try:
                polled_ms = kafka.last_poll_timestamp(tp)
            except (AssertionError, KeyError, AttributeError):
                continue  # being revoked
            seen = self._polled.get(tp)
            if polled_ms is not None and (seen is None or seen[0] != polled_ms):
                seen = self._polled[tp] = (polled_ms, now)
            waited_s = now - max(worker.idle_since, seen[1] if seen else 0.0)
            waiting += 1
            answered += waited_s <= FETCH_STALL_S
            if waited_s > self._stall_bound_s:
                return (
                    f"no fetch response for {tp.topic}[{tp.partition}] in {waited_s:.0f} s"
                    " (Kafka away, or the client stuck)"
                )
        if waiting and answered == waiting:
            self._stall_bound_s = FETCH_STALL_S
        return None

    def batch_stalls(self, now: float | None = None) -> dict[TopicPartition, str]:
        """The workers whose batch has been running longer than ``stalled_after_s``, each
        with its one-line cause; empty when the check is off. ``now``: ``time.monotonic()``
        unless given (tests)."""
        bound_s = self.config.stalled_after_s
        if bound_s is None:
            return {}
        now = time.monotonic() if now is None else now
        stalls: dict[TopicPartition, str] = {}
        for tp, worker in list(self.workers.items()):
            if worker.busy_since is None or now - worker.busy_since <= bound_s:
                continue
            where = ", ".join(
                f"{t}[{p}] from offset {o}" for (t, p), o in worker.batch_from.items()
            )
            stalls[tp] = (
                f"a batch has been running for {now - worker.busy_since:.0f} s ({where}):"
                " a handler waits for a lock another transaction holds (look for a session"
                " 'idle in transaction' or waiting on a Lock in pg_stat_activity) or is slow,"
                " or its retries go on; it goes on when the wait ends"
            )
        return stalls

    def report_stalls(self, stalls: dict[TopicPartition, str]) -> None:
        """Health ``down`` for each stalled batch (:meth:`batch_stalls`), cleared once it
        ended (or its worker is gone)."""
        health = self.deps.health
        for tp in self._stalled - stalls.keys():
            worker = self.workers.get(tp)
            health.clear(("stalled", tp), resolved=worker is not None and not worker.closing)
        for tp, cause in stalls.items():
            health.fault(("stalled", tp), cause)
        self._stalled = set(stalls)

    def start_workers(self, partitions: Sequence[TopicPartition] | set[TopicPartition]) -> None:
        """Start a worker for each partition that has none."""
        for tp in partitions:
            if tp not in self.workers:
                self.workers[tp] = _PartitionWorker(self, tp)

    async def close_workers(self, partitions: Sequence[TopicPartition]) -> None:
        """Let the in-flight records of ``partitions`` finish, commit, forget the workers.

        Called on revoke before anyone else may read these partitions: no offset is lost and
        no in-flight record is processed twice.
        """
        workers = [self.workers[tp] for tp in partitions if tp in self.workers]
        await asyncio.gather(*(w.aclose() for w in workers), return_exceptions=True)
        await self.commit(workers)
        for worker in workers:
            self.workers.pop(worker.tp, None)
            self.paused.discard(worker.tp)
            self._polled.pop(worker.tp, None)
            self.deps.metrics.forget_lag(worker.tp.topic, worker.tp.partition)

    async def commit(self, workers: Sequence[_PartitionWorker]) -> None:
        """Commit the positions of ``workers`` that moved since their last commit."""
        kafka, retire = self.kafka, self._retire
        if kafka is None:
            return
        async with self.commit_lock:
            offsets = {
                w.tp: w.position
                for w in workers
                if w.position is not None and w.position != w.committed
            }
            if not offsets:
                return
            try:
                # Unbounded while running (aiokafka waits for the coordinator); once
                # stopping, or once this client is being replaced, at most what is left of
                # stop_timeout_s.
                # (kafka.commit is called inside: a wait cut short before it starts leaves
                # no coroutine that was never awaited.)
                async def commit_offsets() -> None:
                    await self.kafka_grace.bounded(kafka.commit(offsets), math.inf)

                await retire.bounded(commit_offsets(), math.inf)
            except KafkaError as exc:
                # Rebalance in progress or broker away: the records stay uncommitted and may
                # be redelivered, which the inbox absorbs.
                _log.warning("offset commit failed, will retry: %r", exc)
                return
            except TimeoutError:
                if not self.commit_given_up:
                    self.commit_given_up = True
                    _log.warning(
                        "offsets not committed within stop_timeout_s (Kafka does not answer):"
                        " the records since the last commit are delivered again (after the"
                        " restart, or to the next client) and recognised by the inbox"
                    )
                return
            for worker in workers:
                if worker.tp in offsets:
                    worker.committed = offsets[worker.tp]

    async def _commit_loop(self) -> None:
        interval_s = self.config.commit_interval_ms / 1000
        while True:
            await self.commit_wanted.wait()
            self.commit_wanted.clear()
            await self.commit(list(self.workers.values()))
            await asyncio.sleep(interval_s)

    async def _stall_loop(self) -> None:
        while True:
            await asyncio.sleep(LAG_REFRESH_S)
            self.report_stalls(self.batch_stalls())

    async def _probe_loop(self) -> None:
        deps = self.deps
        while True:
            await asyncio.sleep(self.config.redis_probe_interval_s)
            store = deps.dedup or deps.lock
            if store is not None:
                await deps.gate.probe(store.ping)


async def _stop_client(kafka: AIOKafkaConsumer, grace: StopSignal) -> None:
    """Stop the aiokafka client (leave the group) within what is left of ``grace``; a
    broker that is away is not an error at shutdown.

    With the broker down, aiokafka's ``stop()`` lets the ``CancelledError`` of its own
    in-flight fetch escape (``Fetcher.close`` cancels and awaits it): the consumer stopped by
    SIGTERM during a Kafka outage then exited 1 with a traceback. That one is absorbed; a
    cancellation of this task itself still propagates (``Task.cancelling()``). It gets
    :data:`CLIENT_STOP_MIN_S` at least (the commits may have spent the grace). Whenever
    ``stop()`` did not finish (past the bound; an error, such as the one a dead fetch task
    re-raises before the connections close, or aiokafka#1038's ``RuntimeError`` while
    leaving the group) the client's tasks and connections are closed by hand
    (:func:`_close_by_hand`): a replaced client must leave nothing running. The group
    then drops this member after its session timeout, as after a crash."""
    stopped = False
    try:
        await asyncio.wait_for(kafka.stop(), max(grace.left_s(), CLIENT_STOP_MIN_S))
        stopped = True
    except TimeoutError:
        _log.warning("Kafka client not stopped within stop_timeout_s: connections closed")
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            await _close_by_hand(kafka)
            raise
        _log.debug("aiokafka's stop() raised its fetch task's CancelledError (broker away)")
    except Exception as exc:  # KafkaError, or RuntimeError (aiokafka#1038)
        _log.debug("aiokafka's stop() failed: %r", exc)
    if not stopped:
        await _close_by_hand(kafka)


async def _close_by_hand(kafka: AIOKafkaConsumer) -> None:
    """Cancel what an aiokafka consumer whose ``stop()`` did not finish still runs (the
    coordinator's and the fetcher's tasks) and close its connections. Private attributes of
    aiokafka 0.14; whatever is missing is skipped."""
    coordinator = getattr(kafka, "_coordinator", None)
    fetcher = getattr(kafka, "_fetcher", None)
    tasks = [
        getattr(coordinator, name, None)
        for name in ("_coordination_task", "_heartbeat_task", "_commit_refresh_task")
    ]
    tasks += [getattr(fetcher, "_fetch_task", None), *getattr(fetcher, "_pending_tasks", ())]
    for task in tasks:
        if isinstance(task, asyncio.Future) and not task.done():
            cancel_unawaited(task)
    with contextlib.suppress(Exception):
        await kafka._client.close()
    kafka._closed = True  # closed by hand: no "Unclosed AIOKafkaConsumer" warning


class _PartitionWorker:
    """Processes one partition's records strictly in order (and, lending, the records of
    idle partitions in the same batch).

    Lending (module docstring, "Batches across partitions"): a worker that starts a batch
    with room left takes the records waiting on idle partitions into the same batch. A lent
    worker does not process until its records come back: applied, its position moves; not
    applied (given back), they return to the front of its queue and it runs them in a batch
    of its own, neither lent nor lending (so does the worker running the batch when some of
    its own records came back). So one partition's records are never in two batches at once,
    a failing record holds up only its own partition, and a closing worker waits for its lent
    records: a revoke commits their positions before the partition goes to another consumer.
    """

    def __init__(self, runner: KafkaRunner, tp: TopicPartition) -> None:
        self.runner = runner
        self.tp = tp
        self.queue: deque[Any] = deque()
        self.closing = False
        self.position: int | None = None  # offset to commit: last finished + 1
        self.committed: int | None = None
        self.in_process = 0  # records taken from the queue whose pipeline has not finished
        self.lent = False  # its records are in another worker's batch
        self.solo = False  # records given back: its next batch is its own (not lent/lending)
        # time.monotonic() when its last batch ended (or it started): once its queue is
        # empty the worker waits on Kafka from then on (KafkaRunner.fetch_stall).
        self.idle_since = time.monotonic()
        # While it runs a batch: time.monotonic() when it started, and the batch's
        # partitions with their first offsets (KafkaRunner.batch_stalls).
        self.busy_since: float | None = None
        self.batch_from: dict[tuple[str, int], int] = {}
        self._wake = asyncio.Event()
        self.task = asyncio.create_task(self._run(), name=f"inbox-{tp.topic}-{tp.partition}")

    def feed(self, records: Sequence[Any]) -> None:
        self.queue.extend(records)
        self._wake.set()

    async def aclose(self) -> None:
        self.closing = True
        self.queue.clear()
        self._wake.set()
        await self.task

    def _take(self, most: int) -> list[Any]:
        take = min(len(self.queue), most)
        self.in_process = take
        return [self.queue.popleft() for _ in range(take)]

    def _lendable(self) -> bool:
        return bool(self.queue) and not (self.closing or self.lent or self.solo or self.in_process)

    async def _run(self) -> None:
        runner = self.runner
        limit = runner.config.batch_max_records
        while True:
            while not self.queue or self.lent:
                if self.closing and not self.lent:
                    return
                self._wake.clear()
                await self._wake.wait()
            if self.closing:
                return
            solo, self.solo = self.solo, False
            records = self._take(limit)
            parts = {(self.tp.topic, self.tp.partition): self}
            if runner.lending and not solo:
                for other in list(runner.workers.values()):
                    if len(records) >= limit:
                        break
                    if other is not self and other._lendable():
                        other.lent = True
                        records += other._take(limit - len(records))
                        parts[(other.tp.topic, other.tp.partition)] = other
            self.busy_since = time.monotonic()
            self.batch_from = {}
            for record in records:
                self.batch_from.setdefault((record.topic, record.partition), record.offset)
            try:
                outcomes = await runner.process_batch(
                    records,
                    functools.partial(_any_closing, list(parts.values())),
                    (self.tp.topic, self.tp.partition) if len(parts) > 1 else None,
                )
            except BaseException:
                # A bug in the pipeline (the fetch loop surfaces it): no lent record is lost.
                self._give_back(parts, records)
                raise
            done = 0
            try:
                if len(outcomes) < len(records) and (
                    not outcomes or outcomes[-1] is not Outcome.ABANDONED
                ):
                    raise RuntimeError(
                        f"the batched pipeline returned {len(outcomes)} outcomes for"
                        f" {len(records)} records without ABANDONED"
                    )
                for record, outcome in zip(records, outcomes, strict=False):
                    if outcome is Outcome.ABANDONED:
                        break
                    parts[(record.topic, record.partition)].position = record.offset + 1
                    done += 1
            finally:
                self._give_back(parts, records[done:])
            runner.commit_wanted.set()  # also the lent partitions' positions when closing
            if self.closing:
                return

    def _give_back(self, parts: dict[tuple[str, int], _PartitionWorker], rest: list[Any]) -> None:
        # The batch is over: the records not applied go back to the front of their
        # partition's queue (unless it is closing: the next owner reads them from the
        # commit), and the lent workers are free again (no await in between).
        now = time.monotonic()
        self.busy_since = None
        if self.tp in self.runner._stalled:  # reported as stalled: it ended (or gave up)
            self.runner._stalled.discard(self.tp)
            self.runner.deps.health.clear(("stalled", self.tp), resolved=not self.closing)
        for key, part in parts.items():
            back = [r for r in rest if (r.topic, r.partition) == key]
            if back and not part.closing:
                part.queue.extendleft(reversed(back))
                part.solo = True
            part.in_process = 0
            part.idle_since = now
            if part is not self:
                part.lent = False
                part._wake.set()


def _any_closing(workers: Sequence[_PartitionWorker]) -> bool:
    return any(worker.closing for worker in workers)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """The rebalance listener of ONE client: once ``retired`` (the client is stopping or
    being replaced) an assignment that still completes starts no worker."""

    def __init__(self, runner: KafkaRunner) -> None:
        self.runner = runner
        self.retired = False

    async def on_partitions_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        await self.runner.close_workers(list(revoked))

    async def on_partitions_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        if not self.retired:
            self.runner.start_workers(list(assigned))
