"""The one producer the relay's lanes share: started once, recreated after repeated failures.

aiokafka's producer is safe to use from several tasks; its start and stop are serialized by
a lock so two lanes never run them at once. Publish failures are counted relay-wide: the
backoff grows with failures in a row (whichever lane saw them) and the producer is recreated
after every third one (docs/relay.md, "Failures").
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ledgerbox._core.backoff import Backoff
from ledgerbox._core.stop import StopSignal
from ledgerbox.relay import _metrics as m
from ledgerbox.relay._errors import PublishError
from ledgerbox.relay._health import RelayHealth
from ledgerbox.relay._hooks import RelayHooks
from ledgerbox.relay._policy import failure_reason, unreachable
from ledgerbox.relay._publisher import OutboundRecord, Publisher
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
    health : RelayHealth
        Told when Kafka stops and starts answering (part ``"kafka"``).
    """

    def __init__(
        self,
        publisher: Publisher,
        *,
        backoff: Backoff,
        stop: StopSignal,
        hooks: RelayHooks,
        health: RelayHealth,
    ) -> None:
        self.publisher = publisher
        self._health = health
        self._backoff = backoff
        self._stop = stop
        self._before_first_send = hooks.before_first_send
        self._ready = False
        self._lock = asyncio.Lock()
        # A Publisher written before Publisher.stop() took timeout_s (ledgerbox 0.2) is
        # still served: its stop is bounded from outside.
        self._stop_takes_timeout = _takes_keyword(publisher.stop, "timeout_s")
        self._failures = 0
        self._next_probe = 0.0
        # Since when Kafka does not answer at all (not: answers with a refusal).
        self._unreachable_since: float | None = None

    @property
    def failures(self) -> int:
        """Publish failures in a row (0 after a clean batch)."""
        return self._failures

    def can_publish(self) -> bool:
        """True while the producer runs and Kafka answers: only then may the relay hold
        shards (a relay that cannot reach Kafka would strand their events). A broker that
        answers with a retriable refusal (e.g. NOT_ENOUGH_REPLICAS) refuses every relay
        alike: that is no reason to hand shards over."""
        return self._ready and self._unreachable_since is None

    def down_for_s(self) -> float:
        """Seconds since Kafka stopped answering (0 while it answers)."""
        since = self._unreachable_since
        return 0.0 if since is None else self._health.now() - since

    def _unreachable(self) -> None:
        if self._unreachable_since is None:
            self._unreachable_since = self._health.now()

    def _reachable(self) -> None:
        self._unreachable_since = None

    async def ensure(self) -> bool:
        """Start the producer unless it runs; False (counted as a failure, health down with
        the cause, logged once per outage) if Kafka cannot be reached. Never raises for a
        broker error. Once the relay stops, the start (a probe and aiokafka's bootstrap,
        which wait for a broker that does not answer) takes no longer than what is left of
        ``stop_timeout_s``: False then, nothing counted."""
        async with self._lock:
            if self._ready:
                await self._probe_while_down()
                return True
            try:
                await self._stop.bounded(self.publisher.start(), math.inf)
            except Exception as exc:
                if self._cut_short_by_stop(exc):
                    log.debug("producer start given up: stopping, stop_timeout_s passed")
                    return False
                self._failures += 1
                m.RETRIES.labels(stage="producer").inc()
                self._unreachable()
                self._health.down("kafka", f"producer start failed: {failure_reason(exc)}")
                return False
            self._ready = True
            self._reachable()
            self._health.up("kafka")
            return True

    async def _probe_while_down(self) -> None:
        # A relay that released its shards because Kafka did not answer sends nothing, so no
        # send can tell it Kafka is back: ask the cluster for metadata, at the backoff's pace.
        health = self._health
        if self._unreachable_since is None or health.now() < self._next_probe:
            return
        self._next_probe = health.now() + self._backoff.delay_s(max(1, self._failures))
        try:
            await self._stop.bounded(self.publisher.check(), math.inf)
        except Exception as exc:
            if not self._cut_short_by_stop(exc):
                health.down("kafka", f"metadata request failed: {failure_reason(exc)}")
            return  # else stopping, stop_timeout_s passed: nothing learned
        self._reachable()
        health.up("kafka")

    def _cut_short_by_stop(self, exc: BaseException) -> bool:
        # StopSignal.bounded's own TimeoutError: the stop's grace is spent (not a failure).
        return isinstance(exc, TimeoutError) and self._stop.left_s() == 0

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
        self._reachable()
        self._health.up("kafka")

    async def failed(self, exc: BaseException, first: ClaimedEvent | None) -> None:
        """A batch failed transiently (its rows stay pending): count, log, recreate the
        producer every :data:`RECREATE_PRODUCER_AFTER` failures, back off."""
        self._failures += 1
        attempt = self._failures
        m.RETRIES.labels(stage="publish").inc()
        if unreachable(exc):
            self._unreachable()
        self._health.down("kafka", f"publish failed, rows stay pending: {failure_reason(exc)}")
        log.debug(
            "publish failed (transient), rows stay pending: %s",
            failure_reason(exc),
            extra={
                "attempt": attempt,
                "event_id": str(first.event_id) if first else None,
                "partition_key": first.partition_key if first else None,
            },
        )
        if attempt % RECREATE_PRODUCER_AFTER == 0:
            await self.stop(abort=True)
        await self._stop.sleep(self._backoff.delay_s(attempt))

    async def stop(self, *, abort: bool = False) -> None:
        """Flush and stop the producer if it runs (the next :meth:`ensure` starts it).
        ``abort``: fail what it has not delivered yet instead of flushing (recreating it
        after failures: the rows are sent again by the new one). Once the relay is stopping
        the flush takes at most what is left of ``stop_timeout_s`` (:class:`StopSignal`)."""
        async with self._lock:
            if self._ready:
                self._ready = False
                left_s = self._stop.left_s()
                if self._stop_takes_timeout:
                    await self.publisher.stop(
                        abort=abort, timeout_s=None if left_s == math.inf else left_s
                    )
                elif left_s == math.inf:
                    await self.publisher.stop(abort=abort)
                else:
                    try:
                        await asyncio.wait_for(self.publisher.stop(abort=abort), left_s)
                    except TimeoutError:
                        log.warning(
                            "publisher did not stop within stop_timeout_s: the relay stops "
                            "without it; what Kafka did not confirm is sent again after "
                            "the restart"
                        )


def _takes_keyword(function: Callable[..., Any], name: str) -> bool:
    """Whether ``function`` accepts the keyword argument ``name`` (or any keyword)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature to read: assume the current Protocol
        return True
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == name and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in parameters
    )
