"""The one producer the relay's lanes share: started once, recreated after repeated failures.

aiokafka's producer is safe to use from several tasks; its start and stop are serialized by
a lock so two lanes never run them at once. Publish failures are counted relay-wide: the
backoff grows with failures in a row (whichever lane saw them) and the producer is recreated
after every third one (docs/relay.md, "Failures").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import Any

from ledgerbox._core.backoff import Backoff
from ledgerbox.relay import _metrics as m
from ledgerbox.relay._errors import PublishError
from ledgerbox.relay._hooks import RelayHooks
from ledgerbox.relay._policy import failure_reason
from ledgerbox.relay._publisher import OutboundRecord, Publisher
from ledgerbox.relay._stop import StopSignal
from ledgerbox.relay._store import ClaimedEvent

__all__ = ["RECREATE_PRODUCER_AFTER", "SharedProducer"]

log = logging.getLogger("ledgerbox.relay")

#: The producer is stopped (and started afresh by the next batch) after this many publish
#: failures in a row.
RECREATE_PRODUCER_AFTER = 3


class SharedProducer:
    """A :class:`~ledgerbox.relay.Publisher` shared by the lanes, with its start state and
    the relay-wide count of publish failures in a row.

    Parameters
    ----------
    publisher : Publisher
    backoff : Backoff
        Pause after a failure (grows with the failures in a row).
    stop : StopSignal
        Backoff pauses end when the relay stops.
    hooks : RelayHooks
        ``before_first_send`` is awaited before the first :meth:`send_many` (test-only).
    """

    def __init__(
        self, publisher: Publisher, *, backoff: Backoff, stop: StopSignal, hooks: RelayHooks
    ) -> None:
        self.publisher = publisher
        self._backoff = backoff
        self._stop = stop
        self._before_first_send = hooks.before_first_send
        self._ready = False
        self._lock = asyncio.Lock()
        self._failures = 0

    @property
    def failures(self) -> int:
        """Publish failures in a row (0 after a clean batch)."""
        return self._failures

    async def ensure(self) -> bool:
        """Start the producer unless it runs; False (counted as a failure, logged) if Kafka
        cannot be reached. Never raises for a broker error."""
        async with self._lock:
            if self._ready:
                return True
            try:
                await self.publisher.start()
            except Exception as exc:
                self._failures += 1
                m.RETRIES.labels(stage="producer").inc()
                log.warning(
                    "Kafka producer cannot start: %s",
                    failure_reason(exc),
                    extra={"attempt": self._failures},
                )
                return False
            self._ready = True
            return True

    async def pause(self) -> None:
        """Back off after :meth:`ensure` failed (ends early when stopping)."""
        await self._stop.sleep(self._backoff.delay_s(self._failures))

    def precheck(self, record: OutboundRecord) -> PublishError | None:
        """The publisher's refusal of ``record`` before sending, else ``None`` (no I/O)."""
        return self.publisher.precheck(record)

    async def send_many(self, records: Sequence[OutboundRecord]) -> list[Awaitable[Any]]:
        """:meth:`Publisher.send_many`; the first call awaits ``hooks.before_first_send``."""
        hook, self._before_first_send = self._before_first_send, None
        if hook is not None:
            await hook()
        return await self.publisher.send_many(records)

    def succeeded(self) -> None:
        """A batch went through without a transient failure: the count starts again."""
        self._failures = 0

    async def failed(self, exc: BaseException, first: ClaimedEvent | None) -> None:
        """A batch failed transiently (its rows stay pending): count, log, recreate the
        producer every :data:`RECREATE_PRODUCER_AFTER` failures, back off."""
        self._failures += 1
        attempt = self._failures
        m.RETRIES.labels(stage="publish").inc()
        log.warning(
            "publish failed (transient), rows stay pending: %s",
            failure_reason(exc),
            extra={
                "attempt": attempt,
                "event_id": str(first.event_id) if first else None,
                "partition_key": first.partition_key if first else None,
            },
        )
        if attempt % RECREATE_PRODUCER_AFTER == 0:
            await self.stop()
        await self._stop.sleep(self._backoff.delay_s(attempt))

    async def stop(self) -> None:
        """Flush and stop the producer if it runs (the next :meth:`ensure` starts it)."""
        async with self._lock:
            if self._ready:
                self._ready = False
                await self.publisher.stop()
