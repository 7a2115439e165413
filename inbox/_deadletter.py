"""The dead-letter edge (G7): a Protocol, the Kafka implementation and the header layout of a
dead-letter record. The step that dead-letters a poison record is :mod:`inbox._deadletterer`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from ledgerbox._core.kafka import KafkaSettings
from ledgerbox.inbox._errors import DeadLetterError

__all__ = [
    "H_ATTEMPTS",
    "H_CONSUMER_GROUP",
    "H_ERROR_MESSAGE",
    "H_ERROR_TYPE",
    "H_REPLAY_GROUP",
    "H_REPLAY_ID",
    "H_SOURCE_OFFSET",
    "H_SOURCE_PARTITION",
    "H_SOURCE_TOPIC",
    "DeadLetterPublisher",
    "KafkaDeadLetterPublisher",
    "dead_letter_headers",
    "replay_target",
]

H_ERROR_TYPE = "ledgerbox_error_type"
H_ERROR_MESSAGE = "ledgerbox_error_message"
H_ATTEMPTS = "ledgerbox_attempts"
H_SOURCE_TOPIC = "ledgerbox_source_topic"
H_SOURCE_PARTITION = "ledgerbox_source_partition"
H_SOURCE_OFFSET = "ledgerbox_source_offset"
#: The consumer group that dead-lettered the record (all groups of a topic share its DLQ).
H_CONSUMER_GROUP = "ledgerbox_consumer_group"
#: On a record an operator replayed from a dead-letter topic (``ledgerbox consumer dlq
#: replay``): the ONE group that runs it; every other group acknowledges it without running
#: a handler (docs/operations.md). ``H_REPLAY_ID``: the replay's audit id.
H_REPLAY_GROUP = "ledgerbox_replay_group"
H_REPLAY_ID = "ledgerbox_replay_id"
_OURS = frozenset(
    {H_ERROR_TYPE, H_ERROR_MESSAGE, H_ATTEMPTS, H_SOURCE_TOPIC, H_SOURCE_PARTITION}
    | {H_SOURCE_OFFSET, H_CONSUMER_GROUP, H_REPLAY_GROUP, H_REPLAY_ID}
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
    group: str | None = None,
) -> list[tuple[str, bytes]]:
    """Headers of a dead-letter record: the original ones, then the reason, the source and
    the consumer group (``group``; ``None``: no group header).

    ``ledgerbox_error_type`` is the exception's qualified class name; earlier copies of our
    own headers (a record dead-lettered twice, a replayed record's target group) are
    replaced, not repeated.
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
        *([(H_CONSUMER_GROUP, group.encode())] if group is not None else []),
    ]


def replay_target(headers: Sequence[tuple[str, bytes]] | None) -> str | None:
    """The group an operator replayed this record for (its ``ledgerbox_replay_group``
    header), ``None`` for an ordinary record."""
    for name, value in headers or ():
        if name == H_REPLAY_GROUP:
            return value.decode("utf-8", "replace")
    return None


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
    kafka : KafkaSettings | str
        The consumer's Kafka settings (same cluster, same login), or ``host:port[,...]``
        for PLAINTEXT.
    request_timeout_ms : int
        How long one send may take before it counts as failed, in ms.
    """

    def __init__(self, kafka: KafkaSettings | str, *, request_timeout_ms: int = 30000) -> None:
        if isinstance(kafka, str):
            kafka = KafkaSettings(bootstrap_servers=kafka)
        self.kafka = kafka
        self.bootstrap_servers = kafka.bootstrap_servers
        self.request_timeout_ms = request_timeout_ms
        self._producer: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()

    async def _started(self) -> AIOKafkaProducer:
        async with self._lock:
            if self._producer is None:
                producer = AIOKafkaProducer(
                    **self.kafka.client_kwargs(),
                    acks="all",
                    enable_idempotence=True,
                    request_timeout_ms=self.request_timeout_ms,
                )
                try:
                    await producer.start()
                except BaseException:
                    # Failed, or cancelled (a stop gave up the send): close what it opened
                    # (else aiokafka logs "Unclosed AIOKafkaProducer" when it is collected).
                    with contextlib.suppress(Exception):
                        await producer.stop()
                    raise
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
