"""The Kafka side of an inbox consumer: fetch, one worker task per partition, offset commits,
rebalances.

Offsets: a partition worker advances its position only past records whose pipeline finished
(applied, duplicate, ignored or dead-lettered); positions are committed every
``commit_interval_ms`` and always before a partition is given up (revoke, stop). A record
whose processing was abandoned (revoked mid-retry) is not committed: the next owner reads it
again and the inbox recognises it if its effect had committed.

Stop (docs/operations.md, "Stopping a daemon"): fetching stops, the in-flight records finish
(database, not Kafka), then the final offset commit and the client's stop (leave the group)
get ``stop_timeout_s`` in all. aiokafka retries a commit until it finds the group
coordinator, so with the broker away a stop waited until Kafka came back (and was killed at
the end of the grace period); past the bound the offsets are left uncommitted (their records
come again after the restart, recognised by the inbox) and the client is closed by hand.

A broker that does not answer when the run starts is waited for (health ``down`` naming it,
one log line per change, backoff at most :data:`START_RETRY_MAX_S` apart); refused
credentials raise :class:`inbox.StartupError`.

A client that stops fetching is replaced: aiokafka (0.14) runs its fetches in one background
task, and when that task dies (under uvloop a write to a connection the broker just closed
raises ``RuntimeError``, which aiokafka does not catch: aiokafka#1038) ``getmany`` returns
nothing forever while the heartbeats keep the partitions assigned to this member. The fetch
loop checks the task after every empty ``getmany``. A fetch task that is alive but stuck
(a request that never ends) is caught by its effect: a partition this consumer waits on (no
record queued or in process, not paused) that got no fetch response (the broker answers a
fetch at least every ``fetch_max_wait_ms``, records or not) for :data:`FETCH_STALL_S`. When
either happens, the in-flight records finish,
their offsets commit (at most ``stop_timeout_s``), the client stops and a new one joins the
group (health ``down`` "kafka" meanwhile, one log line). Records fetched but not processed
come again from the last commit; the inbox recognises any whose effect had committed.

Lag: about once per :data:`LAG_REFRESH_S` the fetch loop sets
``ledgerbox_inbox_lag_records{group,topic,partition}`` of each assigned partition to the
records not applied yet: end offset (last stable offset under ``read_committed``, else the
high watermark, both from the last fetch response: no request) minus the fetch position,
plus the records fetched and waiting or in process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from ledgerbox._core.stop import StopSignal
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

#: How often the lag gauges are refreshed while the consumer fetches, in seconds.
LAG_REFRESH_S = 1.0


class KafkaClientFailed(Exception):
    """The aiokafka client stopped working although it was not stopped (its fetch task
    ended): :meth:`KafkaRunner.run` replaces it. ``cause`` is the task's error, as one
    line."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


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
    """:meth:`inbox.InboxConsumer.process_batch`: the pipeline for records of ONE partition."""

    def __call__(
        self, records: Sequence[Record], *, abandon: Callable[[], bool] | None = None
    ) -> Awaitable[list[Outcome]]:
        """One outcome per record, in order; it stops after the first ``ABANDONED``."""
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
        # How long an offset commit may wait for Kafka, in seconds: unbounded while
        # running (aiokafka waits for the coordinator), stop_timeout_s for a failed client.
        self._commit_bound_s = math.inf

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
        while True:
            kafka = await self._started()
            if kafka is None:
                return  # stopped while waiting for the broker
            failure = await self._serve(kafka)
            if failure is None or self.stopping.is_set():
                return

    async def _serve(self, kafka: AIOKafkaConsumer) -> str | None:
        """Consume with ``kafka`` until :meth:`stop` (None) or until the client fails (its
        cause, one line; the client is stopped and the partitions' work committed)."""
        config = self.config
        self.kafka = kafka
        self._commit_bound_s = math.inf
        if config.assignment:
            self.start_workers(kafka.assignment())
        background = [
            asyncio.create_task(self._commit_loop()),
            asyncio.create_task(self._probe_loop()),
        ]
        failure: str | None = None
        grace = self.kafka_grace
        try:
            await self._fetch_loop(kafka)
        except KafkaClientFailed as exc:
            failure = exc.cause
            self.deps.health.fault(
                "kafka", f"Kafka client failed ({failure}): a new client joins the group"
            )
            # What waits on the old client (commits, its stop) is bounded as in a stop.
            self._commit_bound_s = config.stop_timeout_s
            grace = StopSignal(config.stop_timeout_s)
            grace.set()
        finally:
            await asyncio.gather(
                *(w.aclose() for w in self.workers.values()), return_exceptions=True
            )
            if failure is None:
                self.kafka_grace.set()
            await self.close_workers(list(self.workers))
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
        if config.assignment:
            kafka.assign([TopicPartition(t, p) for t, p in config.assignment])
        else:
            kafka.subscribe(list(config.topics), listener=_Listener(self))
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
            batches = await kafka.getmany(timeout_ms=100, max_records=500)
            if not batches and (failure := client_failure(kafka)) is not None:
                raise KafkaClientFailed(failure)
            if time.monotonic() >= next_lag:
                next_lag = time.monotonic() + LAG_REFRESH_S
                await self.refresh_lag(kafka)
                if (stall := self.fetch_stall(kafka)) is not None:
                    raise KafkaClientFailed(stall)
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
                if worker is None or len(worker.queue) < high // 2:
                    self.paused.discard(tp)
                    if worker is not None:
                        kafka.resume(tp)
            for worker in self.workers.values():
                if worker.task.done() and not worker.closing:
                    worker.task.result()  # a bug in the pipeline: surface it

    async def refresh_lag(self, kafka: AIOKafkaConsumer) -> None:
        """Set the lag gauge of every partition with a worker (module docstring, "Lag").
        A partition whose end offset or position is not known yet keeps its last value."""
        metrics = self.deps.metrics
        for tp, worker in list(self.workers.items()):
            end = kafka.last_stable_offset(tp)
            if end is None:
                end = kafka.highwater(tp)
            if end is None:
                continue
            try:
                position = await asyncio.wait_for(kafka.position(tp), 0.05)
            except (KafkaError, TimeoutError, AssertionError, KeyError):
                continue  # being revoked or not positioned yet
            waiting = len(worker.queue) + worker.in_process
            metrics.set_lag(tp.topic, tp.partition, max(0, end - position) + waiting)

    def fetch_stall(self, kafka: AIOKafkaConsumer) -> str | None:
        """A partition this consumer waits on (nothing queued or in process, not paused)
        that got no fetch response for :data:`FETCH_STALL_S`, as one line; else None."""
        now = time.time()
        for tp, worker in list(self.workers.items()):
            if worker.closing or worker.queue or worker.in_process or tp in self.paused:
                continue
            try:
                polled_ms = kafka.last_poll_timestamp(tp)
            except (AssertionError, KeyError, AttributeError):
                continue  # being revoked
            since = max(worker.idle_since, (polled_ms or 0) / 1000)
            if now - since > FETCH_STALL_S:
                return (
                    f"no fetch response for {tp.topic}[{tp.partition}] in {now - since:.0f} s"
                    " while waiting for its records"
                )
        return None

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
            self.deps.metrics.forget_lag(worker.tp.topic, worker.tp.partition)

    async def commit(self, workers: Sequence[_PartitionWorker]) -> None:
        """Commit the positions of ``workers`` that moved since their last commit."""
        kafka = self.kafka
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
                # stopping, at most what is left of stop_timeout_s; stop_timeout_s when
                # the client failed.
                await self.kafka_grace.bounded(kafka.commit(offsets), self._commit_bound_s)
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
                        " the records since the last commit are delivered again after the"
                        " restart and recognised by the inbox"
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
    :data:`CLIENT_STOP_MIN_S` at least (the commits may have spent the grace); past that the
    connections are closed by hand (the group then drops this member after its
    session timeout, as after a crash)."""
    try:
        await asyncio.wait_for(kafka.stop(), max(grace.left_s(), CLIENT_STOP_MIN_S))
    except KafkaError:
        # A fetch task that died re-raises its error from stop() before the connections
        # close (KafkaClientFailed): close them here.
        with contextlib.suppress(Exception):
            await kafka._client.close()
    except TimeoutError:
        _log.warning("Kafka client not stopped within stop_timeout_s: connections closed")
        with contextlib.suppress(Exception):
            await kafka._client.close()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        _log.debug("aiokafka's stop() raised its fetch task's CancelledError (broker away)")


class _PartitionWorker:
    """Processes one partition's records strictly in order."""

    def __init__(self, runner: KafkaRunner, tp: TopicPartition) -> None:
        self.runner = runner
        self.tp = tp
        self.queue: deque[Any] = deque()
        self.closing = False
        self.position: int | None = None  # offset to commit: last finished + 1
        self.committed: int | None = None
        self.in_process = 0  # records taken from the queue whose pipeline has not finished
        # time.time() when the queue was last found empty with nothing in process: from
        # then on the worker waits on Kafka (KafkaRunner.fetch_stall).
        self.idle_since = time.time()
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

    async def _run(self) -> None:
        runner = self.runner
        while True:
            while not self.queue:
                if self.closing:
                    return
                self._wake.clear()
                await self._wake.wait()
            if self.closing:
                return
            take = min(len(self.queue), runner.config.batch_max_records)
            records = [self.queue.popleft() for _ in range(take)]
            self.in_process = take
            try:
                outcomes = await runner.process_batch(records, abandon=lambda: self.closing)
            finally:
                self.in_process = 0
                self.idle_since = time.time()
            for record, outcome in zip(records, outcomes, strict=False):
                if outcome is Outcome.ABANDONED:
                    return
                self.position = record.offset + 1
            runner.commit_wanted.set()


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, runner: KafkaRunner) -> None:
        self.runner = runner

    async def on_partitions_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        await self.runner.close_workers(list(revoked))

    async def on_partitions_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        self.runner.start_workers(list(assigned))
