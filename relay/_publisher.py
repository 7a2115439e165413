"""The broker edge of the relay: a ``Publisher`` Protocol and its aiokafka implementation.

The in-memory implementation for tests lives in :mod:`ledgerbox.relay.testing`. Both raise
and resolve only :class:`ledgerbox.relay.PublishError` (translated here from aiokafka's
errors by the one table of :mod:`ledgerbox._core.faults`): Kafka classes never reach the
relay's policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.partitioner import murmur2
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from ledgerbox._core.faults import Fault
from ledgerbox._core.kafka import KafkaSettings
from ledgerbox._core.kafka_probe import probe_kafka
from ledgerbox._core.names import DEFAULT_MAX_RECORD_BYTES
from ledgerbox.relay._errors import PublishError
from ledgerbox.relay._policy import NOT_SENT, failure_reason

__all__ = ["KafkaPublisher", "OutboundRecord", "Publisher", "not_sent_error"]

log = logging.getLogger("ledgerbox.relay.publisher")


@dataclass(frozen=True, slots=True)
class OutboundRecord:
    """One Kafka record as the relay sends it.

    Attributes
    ----------
    topic : str
    key : bytes
        The partition key, UTF-8.
    value : bytes
        The payload JSON exactly as stored.
    timestamp_ms : int
        Event time in milliseconds since the epoch.
    headers : list[tuple[str, bytes]]
        CloudEvents binary-mode headers plus the event's own headers.
    """

    topic: str
    key: bytes
    value: bytes
    timestamp_ms: int
    headers: list[tuple[str, bytes]]


@runtime_checkable
class Publisher(Protocol):
    """What the relay needs from a broker client."""

    async def start(self) -> None:
        """Connect. Raises :class:`PublishError` if the broker cannot be reached."""

    async def stop(self, *, abort: bool = False, timeout_s: float | None = None) -> None:
        """Flush what was handed over and disconnect. ``abort``: do not flush; fail every
        record not confirmed yet at once (the relay sends those rows again). ``timeout_s``:
        the longest the flush may take, in seconds (``None``: the publisher's own bound;
        ``0``: none, as ``abort``); what is not confirmed by then fails, as with ``abort``.
        The relay passes what is left of ``RelayConfig.stop_timeout_s`` when it stops."""

    def precheck(self, record: OutboundRecord) -> PublishError | None:
        """The error that refuses ``record`` before sending (e.g. too large), else ``None``.
        No I/O."""

    async def send_many(self, records: Sequence[OutboundRecord]) -> list[Awaitable[Any]]:
        """Hand records over, in order; one awaitable per record, resolved when the broker
        confirmed it and raising :class:`PublishError` when it refused it or did not confirm
        it in time. Raises :class:`PublishError` when nothing could be handed over.

        Records of one key keep their order (same partition, submitted in order). Several
        records may share one awaitable (one Kafka record batch). A record is never
        confirmed while an earlier record of its partition in the same call failed: such
        a record is not sent, and its awaitable raises the ``PublishError`` of
        :func:`not_sent_error` (kind ``"NotSent"``; the relay reads it again, it neither
        dead-letters it nor counts a failure). Kafka accepts or refuses each record batch
        on its own, so a later batch sent anyway could put a key's later events on the
        topic before an earlier one that is then dead-lettered or re-sent (G3).
        """

    async def check(self) -> None:
        """Raise :class:`PublishError` if the broker cannot be reached now."""


@functools.lru_cache(maxsize=4096)
def _key_hash(key: bytes) -> int:
    # murmur2 is pure Python in aiokafka (~9% of the relay's CPU when draining a backlog);
    # keys repeat (one per aggregate), so the hot ones are cached (4,096 entries, < 1 MB).
    return int(murmur2(key)) & 0x7FFFFFFF


def partition_for(key: bytes, partitions: Sequence[int]) -> int:
    """The partition Kafka's default partitioner picks for ``key`` among ``partitions``
    (sorted ids): ``(murmur2(key) & 0x7fffffff) % len(partitions)``, as aiokafka's
    ``DefaultPartitioner`` and the Java client compute it."""
    return partitions[_key_hash(key) % len(partitions)]


async def _force_close(producer: AIOKafkaProducer) -> None:
    """After a stop() that timed out: stop the sender task and the connections, so that no
    task nor socket of the old producer outlives it (aiokafka then warns "Unclosed")."""
    sender = getattr(producer, "_sender", None)
    task = getattr(sender, "sender_task", None)
    if sender is not None and task is not None and not task.done():
        # Its done callback fails the pending batches (done by the caller) and then trips
        # over the idempotent producer's transaction manager (AttributeError, a traceback
        # at every stop during an outage, aiokafka 0.14): not wanted.
        with contextlib.suppress(Exception):
            task.remove_done_callback(sender._fail_all)
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
    with contextlib.suppress(Exception):
        await producer.client.close()
    producer._closed = True  # closed by hand: no "Unclosed AIOKafkaProducer" warning


def _fail_undelivered(producer: AIOKafkaProducer, why: str) -> None:
    """Fail every batch still in the producer's accumulator at once (their delivery futures
    raise ``KafkaError(why)``): awaiting them cannot outlast the producer."""
    accumulator = getattr(producer, "_message_accumulator", None)
    if accumulator is not None:
        accumulator.fail_all(KafkaError(why))


def not_sent_error() -> PublishError:
    """The error of a record held back behind a failed record batch of its partition (see
    :meth:`Publisher.send_many`): not handed to Kafka; the relay reads it again, neither
    dead-letters it nor counts a failure (:func:`~ledgerbox.relay._policy.not_sent`)."""
    return PublishError(
        "not sent: an earlier record batch of its partition was not confirmed",
        fault=Fault.TRANSIENT,
        kind=NOT_SENT,
    )


def _failed(exc: BaseException) -> asyncio.Future[Any]:
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    fut.set_exception(PublishError.translate(exc, "send"))
    return fut


def _follow(source: asyncio.Future[Any], target: asyncio.Future[Any]) -> None:
    """Resolve ``target`` as ``source`` resolves, its failure as a :class:`PublishError`
    (aiokafka's error translated; one already translated kept as it is). A ``target`` given
    up on (a stop, the relay's wait ended) still retrieves ``source``'s outcome, unlogged."""

    def copy(done: asyncio.Future[Any]) -> None:
        if target.done():
            if not done.cancelled():
                done.exception()
            return
        if done.cancelled():
            target.set_exception(
                PublishError("send cancelled", fault=Fault.TRANSIENT, kind="Cancelled")
            )
        elif (exc := done.exception()) is not None:
            target.set_exception(PublishError.translate(exc, "send"))
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)


def translated(fut: asyncio.Future[Any]) -> asyncio.Future[Any]:
    """A future resolved like ``fut`` (a producer's delivery future) whose failure is the
    :class:`PublishError` of aiokafka's error. One per record batch, not per record."""
    ours: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    _follow(fut, ours)
    return ours


class KafkaPublisher:
    """:class:`Publisher` on ``aiokafka.AIOKafkaProducer`` with ``acks="all"`` and the
    idempotent producer, so retries inside the producer never duplicate nor reorder records
    of one partition (Kafka KIP-98).

    Records are packed into one record batch per partition with ``create_batch`` /
    ``send_batch`` (measured 2.4x faster than one ``send`` per record); the partition is the
    default partitioner's (murmur2 of the key, as ``send`` and the Java client choose it).

    Every Kafka client here (the producer, the admin client of :meth:`cluster`) is built
    from the same :class:`~ledgerbox.relay.KafkaSettings`. Before the producer starts, one
    connection logs in by hand (:mod:`ledgerbox._core.kafka_probe`): a refused password, a
    TLS mismatch or an untrusted certificate fails :meth:`start` with a
    :class:`PublishError` whose message names it and the fix (``kind`` e.g.
    ``"SaslAuthenticationFailed"``), not aiokafka's "Unable to bootstrap".

    Parameters
    ----------
    kafka : KafkaSettings | str
        The connection settings, or ``host:port[,host:port]`` for PLAINTEXT.
    compression : str
        ``"lz4"``, ``"zstd"``, ``"gzip"``, ``"snappy"`` or ``"none"``.
    linger_ms : int
    max_batch_bytes : int
        Record batch size per partition, in bytes.
    request_timeout_ms : int
    max_request_bytes : int
        Largest record sent (aiokafka's ``max_request_size``), in bytes; a larger one is
        refused by :meth:`precheck` as the event's fault (default 1 MiB).
    """

    def __init__(
        self,
        kafka: KafkaSettings | str,
        *,
        compression: str = "lz4",
        linger_ms: int = 0,
        max_batch_bytes: int = 262_144,
        request_timeout_ms: int = 30_000,
        max_request_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ) -> None:
        if isinstance(kafka, str):
            kafka = KafkaSettings(bootstrap_servers=kafka)
        self.kafka = kafka
        self._kwargs: dict[str, Any] = {
            "acks": "all",
            "enable_idempotence": True,
            "compression_type": None if compression == "none" else compression,
            "linger_ms": linger_ms,
            "max_batch_size": max_batch_bytes,
            "max_request_size": max_request_bytes,
            "request_timeout_ms": request_timeout_ms,
        }
        self._producer: AIOKafkaProducer | None = None
        # Tasks sending the later record batches of a partition (send_many).
        self._behind: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        timeout_s = self._kwargs["request_timeout_ms"] / 1000
        problem = await probe_kafka(self.kafka, timeout_s=min(timeout_s, 10.0))
        if problem is not None:
            raise PublishError(problem.cause, fault=Fault.ENVIRONMENT, kind=problem.kind)
        producer = AIOKafkaProducer(**self.kafka.client_kwargs(), **self._kwargs)
        try:
            await producer.start()
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await producer.stop()
            if isinstance(exc, Exception):
                raise PublishError.translate(exc, "producer start") from exc
            raise
        self._producer = producer

    async def stop(self, *, abort: bool = False, timeout_s: float | None = None) -> None:
        for task in self._behind:  # later record batches not handed over yet: never sent
            task.cancel()
        producer, self._producer = self._producer, None
        if producer is None:
            return
        if abort:
            # aiokafka's stop() waits until every batch is delivered or failed; a producer
            # recreated after errors (e.g. OutOfOrderSequenceNumber after a cluster restart)
            # may never deliver them, so fail them now: the lanes see the failure at once
            # instead of waiting for their bounded confirmation timeout (soak finding).
            _fail_undelivered(producer, "producer recreated after failures")
        # stop() flushes; bounded so a dead broker cannot hang shutdown forever.
        bound_s = 5.0 if abort else self._kwargs["request_timeout_ms"] / 1000 + 5
        if timeout_s is not None:
            bound_s = min(bound_s, timeout_s)
        try:
            if bound_s <= 0:
                raise TimeoutError
            await asyncio.wait_for(producer.stop(), bound_s)
        except TimeoutError:
            if timeout_s is not None and bound_s == timeout_s:
                # The relay is stopping and its stop_timeout_s is spent: Kafka does not
                # answer. Nothing unconfirmed was persisted; it is sent again after restart.
                log.warning(
                    "Kafka did not confirm every record within stop_timeout_s: the relay"
                    " stops without them; they are sent again after the restart"
                )
            else:
                log.warning("producer stop failed: %s", failure_reason(TimeoutError()))
            _fail_undelivered(producer, "producer stopped before delivery")
            await _force_close(producer)
        except Exception as exc:
            log.warning("producer stop failed: %s", failure_reason(exc))
            await _force_close(producer)

    def precheck(self, record: OutboundRecord) -> PublishError | None:
        size: int = DefaultRecordBatchBuilder.estimate_size_in_bytes(
            key=record.key, value=record.value, headers=record.headers
        )
        limit = self._kwargs["max_request_size"]
        if size > limit:
            return PublishError(
                f"record of {size} bytes is above max_request_size {limit}"
                " (the relay's max_request_bytes)",
                fault=Fault.MESSAGE,
                kind="MessageSizeTooLargeError",
            )
        return None

    async def send_many(self, records: Sequence[OutboundRecord]) -> list[Awaitable[Any]]:
        if self._producer is None:
            await self.start()
        producer = self._producer
        assert producer is not None
        futures: list[Awaitable[Any] | None] = [None] * len(records)
        # Per partition: the open batch, and the full batches behind the first one sent.
        open_batches: dict[tuple[str, int], tuple[Any, list[int]]] = {}
        first_sent: dict[tuple[str, int], asyncio.Future[Any]] = {}
        behind: dict[tuple[str, int], list[tuple[Any, list[int]]]] = {}
        partitions: dict[str, list[int]] = {}
        failure: BaseException | None = None

        async def submit(slot: tuple[str, int], batch: Any, indexes: list[int]) -> None:
            nonlocal failure
            if slot in first_sent:
                # Sent only once the slot's earlier batch is confirmed (_send_behind).
                behind.setdefault(slot, []).append((batch, indexes))
                return
            fut: asyncio.Future[Any] | None = None
            if failure is None:
                try:
                    fut = translated(await producer.send_batch(batch, slot[0], partition=slot[1]))
                except Exception as exc:
                    # Nothing after this may be sent: it could overtake these records.
                    failure = exc
            if fut is not None:
                first_sent[slot] = fut
            for i in indexes:
                futures[i] = fut if fut is not None else _failed(failure or RuntimeError())

        for i, record in enumerate(records):
            if failure is not None:
                futures[i] = _failed(failure)
                continue
            try:
                all_parts = partitions.get(record.topic)
                if all_parts is None:
                    all_parts = partitions[record.topic] = sorted(
                        await producer.partitions_for(record.topic)
                    )
            except Exception as exc:
                failure = exc
                futures[i] = _failed(exc)
                continue
            slot = (record.topic, partition_for(record.key, all_parts))
            entry = open_batches.get(slot)
            if entry is None:
                entry = open_batches[slot] = (producer.create_batch(), [])
            if not self._append(entry[0], record):
                await submit(slot, *entry)
                entry = open_batches[slot] = (producer.create_batch(), [])
                if not self._append(entry[0], record):  # never: a first record always fits
                    futures[i] = _failed(
                        PublishError(
                            "record does not fit a batch",
                            fault=Fault.MESSAGE,
                            kind="MessageSizeTooLargeError",
                        )
                    )
                    continue
            entry[1].append(i)
        for slot, (batch, indexes) in open_batches.items():
            if indexes:
                await submit(slot, batch, indexes)
        loop = asyncio.get_running_loop()
        for slot, batches in behind.items():
            chained: list[tuple[Any, asyncio.Future[Any]]] = []
            for batch, indexes in batches:
                fut = loop.create_future()
                chained.append((batch, fut))
                for i in indexes:
                    futures[i] = fut
            task = loop.create_task(self._send_behind(producer, slot, first_sent[slot], chained))
            self._behind.add(task)
            task.add_done_callback(self._behind.discard)
        return [f if f is not None else _failed(RuntimeError("not sent")) for f in futures]

    @staticmethod
    async def _send_behind(
        producer: AIOKafkaProducer,
        slot: tuple[str, int],
        previous: asyncio.Future[Any],
        chained: list[tuple[Any, asyncio.Future[Any]]],
    ) -> None:
        """Send the later record batches of one partition of a :meth:`send_many` call, each
        once the one before it is confirmed; once one fails (or is given up on), the rest
        are not sent (:func:`not_sent_error`). Kafka accepts or refuses each record batch on
        its own: a batch sent behind a refused one could put later events of a key on the
        topic before the refused event (G3)."""

        def give_up(rest: list[tuple[Any, asyncio.Future[Any]]]) -> None:
            for _, later in rest:
                if not later.done():
                    later.set_exception(not_sent_error())

        for k, (batch, fut) in enumerate(chained):
            try:
                await asyncio.shield(previous)
            except asyncio.CancelledError:
                give_up(chained[k:])
                if not previous.cancelled():
                    raise  # this task was cancelled (the publisher stops)
                return  # the earlier batch was given up on
            except Exception:
                give_up(chained[k:])  # the earlier batch failed
                return
            if fut.done():  # given up on by the relay (its wait ended): nothing more to send
                give_up(chained[k:])
                return
            try:
                previous = translated(await producer.send_batch(batch, slot[0], partition=slot[1]))
            except asyncio.CancelledError:
                give_up(chained[k:])
                raise
            except Exception as exc:
                fut.set_exception(PublishError.translate(exc, "send"))
                give_up(chained[k + 1 :])
                return
            _follow(previous, fut)

    @staticmethod
    def _append(batch: Any, record: OutboundRecord) -> bool:
        meta = batch.append(
            key=record.key,
            value=record.value,
            timestamp=record.timestamp_ms,
            headers=record.headers,
        )
        return meta is not None

    async def check(self) -> None:
        if self._producer is None:
            await self.start()
        assert self._producer is not None
        try:
            await self._producer.client.fetch_all_metadata()
        except Exception as exc:
            raise PublishError.translate(exc, "metadata") from exc

    async def cluster(self, topics: Sequence[str]) -> tuple[int, set[str], bool]:
        """``(brokers, which of topics exist, whether the brokers create topics)`` for
        ``relay check``: cluster metadata and the brokers' ``auto.create.topics.enable``
        (read only; nothing is created).

        Raises
        ------
        PublishError
            Kafka cannot be reached or refuses the request.
        """
        from aiokafka.admin import AIOKafkaAdminClient
        from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

        if self._producer is None:
            await self.start()
        assert self._producer is not None
        try:
            metadata = await self._producer.client.fetch_all_metadata()
            brokers = sorted(b.nodeId for b in metadata.brokers())
            existing = set(metadata.topics()) & set(topics)
            auto_create = False
            if brokers and set(topics) - existing:
                admin = AIOKafkaAdminClient(
                    **self.kafka.client_kwargs(),
                    request_timeout_ms=self._kwargs["request_timeout_ms"],
                )
                await admin.start()
                try:
                    resource = ConfigResource(ConfigResourceType.BROKER, str(brokers[0]))
                    (response,) = await admin.describe_configs([resource])
                finally:
                    await admin.close()
                for *_, entries in response.resources:
                    for name, value, *_rest in entries:
                        if name == "auto.create.topics.enable":
                            auto_create = str(value).lower() == "true"
        except Exception as exc:
            raise PublishError.translate(exc, "cluster metadata") from exc
        return len(brokers), existing, auto_create
