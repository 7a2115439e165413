"""The dead-letter edge: a Protocol, the Kafka implementation, the header layout, and the
dead-lettering of a poison record (G7).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from ledgerbox._core.faults import Fault
from ledgerbox.inbox._errors import DeadLetterError
from ledgerbox.inbox._policy import Outcome, classify
from ledgerbox.inbox._record import Abandon, Record, record_identity, sleep_unless_abandoned
from ledgerbox.outbox import EventEnvelope

if TYPE_CHECKING:
    from ledgerbox.inbox._consumer import InboxConsumer

__all__ = [
    "H_ATTEMPTS",
    "H_ERROR_MESSAGE",
    "H_ERROR_TYPE",
    "H_SOURCE_OFFSET",
    "H_SOURCE_PARTITION",
    "H_SOURCE_TOPIC",
    "DeadLetterPublisher",
    "DeadLetterer",
    "KafkaDeadLetterPublisher",
    "dead_letter_headers",
]

_log = logging.getLogger("ledgerbox.inbox")

H_ERROR_TYPE = "ledgerbox_error_type"
H_ERROR_MESSAGE = "ledgerbox_error_message"
H_ATTEMPTS = "ledgerbox_attempts"
H_SOURCE_TOPIC = "ledgerbox_source_topic"
H_SOURCE_PARTITION = "ledgerbox_source_partition"
H_SOURCE_OFFSET = "ledgerbox_source_offset"
_OURS = frozenset(
    {H_ERROR_TYPE, H_ERROR_MESSAGE, H_ATTEMPTS, H_SOURCE_TOPIC, H_SOURCE_PARTITION}
    | {H_SOURCE_OFFSET}
)
#: Error messages are cut so that a huge exception text cannot make the record too large.
MAX_ERROR_MESSAGE_BYTES = 4096


def dead_letter_headers(
    original: Sequence[tuple[str, bytes]],
    *,
    error: BaseException,
    attempts: int,
    topic: str,
    partition: int,
    offset: int,
) -> list[tuple[str, bytes]]:
    """Headers of a dead-letter record: the original ones, then the reason and the source.

    ``ledgerbox_error_type`` is the exception's qualified class name; earlier copies of our
    own headers (a record dead-lettered twice) are replaced, not repeated.
    """
    cls = type(error)
    message = str(error).encode("utf-8", "replace")[:MAX_ERROR_MESSAGE_BYTES]
    kept = [(k, v) for k, v in original if k not in _OURS]
    return [
        *kept,
        (H_ERROR_TYPE, f"{cls.__module__}.{cls.__qualname__}".encode()),
        (H_ERROR_MESSAGE, message),
        (H_ATTEMPTS, str(attempts).encode()),
        (H_SOURCE_TOPIC, topic.encode()),
        (H_SOURCE_PARTITION, str(partition).encode()),
        (H_SOURCE_OFFSET, str(offset).encode()),
    ]


@runtime_checkable
class DeadLetterPublisher(Protocol):
    """Where poison records go. ``publish`` returns only once the record is stored."""

    async def publish(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]],
    ) -> None:
        """Store one record. Raises :class:`inbox.DeadLetterError` if it was not stored."""
        ...

    async def aclose(self) -> None:
        """Flush and release resources."""
        ...


class KafkaDeadLetterPublisher:
    """:class:`DeadLetterPublisher` on Kafka: ``acks=all``, idempotent producer, started lazily.

    Parameters
    ----------
    bootstrap_servers : str
        ``host:port[,host:port]``.
    request_timeout_ms : int
        How long one send may take before it counts as failed, in ms.
    """

    def __init__(self, bootstrap_servers: str, *, request_timeout_ms: int = 30000) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.request_timeout_ms = request_timeout_ms
        self._producer: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()

    async def _started(self) -> AIOKafkaProducer:
        async with self._lock:
            if self._producer is None:
                producer = AIOKafkaProducer(
                    bootstrap_servers=self.bootstrap_servers,
                    acks="all",
                    enable_idempotence=True,
                    request_timeout_ms=self.request_timeout_ms,
                )
                await producer.start()
                self._producer = producer
            return self._producer

    async def publish(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]],
    ) -> None:
        try:
            producer = await self._started()
            await producer.send_and_wait(topic, value=value, key=key, headers=list(headers))
        except (TimeoutError, KafkaError, OSError) as exc:
            raise DeadLetterError.translate(exc, f"dead-letter send to {topic!r}") from exc

    async def aclose(self) -> None:
        async with self._lock:
            producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()


class DeadLetterer:
    """Dead-letters the poison records of one :class:`inbox.InboxConsumer`: dead-letter topic first,
    then the inbox row marked DEAD_LETTERED with the reason."""

    def __init__(self, consumer: InboxConsumer) -> None:
        self.consumer = consumer

    async def dead_letter(
        self,
        record: Record,
        event: EventEnvelope | None,
        error: BaseException,
        attempts: int,
        abandon: Callable[[], bool],
    ) -> Outcome:
        """Publish ``record`` (original bytes and headers, plus the error) to its dead-letter
        topic, retrying until it is stored, then record the failure in the inbox.

        Returns ``DEAD_LETTERED``, or ``ABANDONED`` if ``abandon()`` turned True while a send
        was retried: the offset must not move before the dead-letter topic has the record.
        """
        c = self.consumer
        topic = c.config.dead_letter_topic_for(record.topic)
        headers = dead_letter_headers(
            list(record.headers or ()),
            error=error,
            attempts=attempts,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
        )
        retry = 0
        try:
            while True:
                try:
                    await c.dead_letters.publish(topic, record.key, record.value, headers)
                    break
                except Exception as exc:  # the offset must not move before the DLQ has it
                    retry += 1
                    _log.warning("dead-letter send to %s failed, retrying: %r", topic, exc)
                    delay_s = c.config.backoff.delay_s(min(retry, 30))
                    await sleep_unless_abandoned(delay_s, abandon)
            event_id, event_type = record_identity(record, event)
            if event_id is not None:
                await self._record_failure(record, event_id, event_type, error, attempts, abandon)
        except Abandon:
            return Outcome.ABANDONED
        c._metrics.dead_lettered.inc()
        _log.error(
            "record %s[%d]@%d (event %s) dead-lettered to %s after %d attempt(s): %s: %s",
            record.topic,
            record.partition,
            record.offset,
            event.event_id if event else "?",
            topic,
            attempts,
            type(error).__name__,
            error,
        )
        return Outcome.DEAD_LETTERED

    async def _record_failure(
        self,
        record: Record,
        event_id: uuid.UUID,
        event_type: str | None,
        error: BaseException,
        attempts: int,
        abandon: Callable[[], bool],
    ) -> None:
        c = self.consumer
        message = f"{type(error).__name__}: {error}"
        retry = 0
        while True:
            tx = c._open_tx(True)
            try:
                await c.store.record_failure(tx, event_id, event_type, record, message, attempts)
                await tx.commit()
                return
            except Exception as exc:
                retry += 1
                if classify(exc) is Fault.MESSAGE or retry >= 1000:
                    _log.error(
                        "could not mark event %s dead-lettered in the inbox: %r", event_id, exc
                    )
                    return
                delay_s = c.config.backoff.delay_s(min(retry, 30))
                await sleep_unless_abandoned(delay_s, abandon)
            finally:
                await tx.aclose()
