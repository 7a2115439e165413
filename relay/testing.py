"""Test helpers for users of ``relay``: an in-memory :class:`relay.Publisher` and an
in-memory relay store (:class:`InMemoryRelayStore`, the rules of the SQL store without
PostgreSQL).

Example
-------
>>> publisher, store = InMemoryPublisher(), InMemoryRelayStore(config.member_id)
>>> relay = Relay(config, publisher=publisher, store_factory=store.factory())  # doctest: +SKIP
>>> store.add(event)                                                            # doctest: +SKIP
>>> await relay.run_once()                                                      # doctest: +SKIP
>>> [r.key for r in publisher.records]                                          # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ledgerbox.relay._errors import PublishError
from ledgerbox.relay._memstore import InMemoryRelayStore
from ledgerbox.relay._publisher import OutboundRecord, not_sent_error

__all__ = ["InMemoryPublisher", "InMemoryRelayStore"]


class InMemoryPublisher:
    """A :class:`relay.Publisher` that keeps confirmed records in a list.

    Faults are injected per record: ``reject_on_send(pred, exc)`` refuses matching records
    before sending (``precheck``, a client-side refusal such as "too large"),
    ``fail_delivery(pred, exc)`` fails their delivery future (a broker-side failure),
    ``fail_next_sends(n, exc)`` fails the next ``n`` deliveries of any record. ``exc`` may be
    an aiokafka error: like the real publisher, this seam hands the relay its
    :class:`ledgerbox.relay.PublishError` (same classification). Records whose delivery
    failed are NOT in :attr:`records`.

    Each record is its own record batch and each key its own partition: as with
    :class:`~ledgerbox.relay.KafkaPublisher`, once a record of a key fails in a
    :meth:`send_many` call, the later records of that key in the call are not sent (their
    awaitables raise the ``"NotSent"`` error of
    :func:`~ledgerbox.relay._publisher.not_sent_error`).

    Attributes
    ----------
    records : list[OutboundRecord]
        Every record whose delivery was confirmed, in confirmation order (duplicates kept).
    """

    def __init__(self) -> None:
        self.records: list[OutboundRecord] = []
        self.started = False
        self.start_count = 0
        self._send_rejects: list[tuple[Callable[[OutboundRecord], bool], BaseException]] = []
        self._delivery_faults: list[tuple[Callable[[OutboundRecord], bool], BaseException]] = []
        self._fail_next: list[BaseException] = []

    def reject_on_send(self, pred: Callable[[OutboundRecord], bool], exc: BaseException) -> None:
        """Make ``send`` raise ``exc`` for every record matching ``pred``."""
        self._send_rejects.append((pred, exc))

    def fail_delivery(self, pred: Callable[[OutboundRecord], bool], exc: BaseException) -> None:
        """Make the delivery of every record matching ``pred`` fail with ``exc``."""
        self._delivery_faults.append((pred, exc))

    def fail_next_sends(self, n: int, exc: BaseException) -> None:
        """Fail the delivery of the next ``n`` records with ``exc``."""
        self._fail_next.extend([exc] * n)

    def clear_faults(self) -> None:
        """Remove every injected fault."""
        self._send_rejects.clear()
        self._delivery_faults.clear()
        self._fail_next.clear()

    async def start(self) -> None:
        self.started = True
        self.start_count += 1

    async def stop(self, *, abort: bool = False, timeout_s: float | None = None) -> None:
        self.started = False

    async def check(self) -> None:
        return None

    def precheck(self, record: OutboundRecord) -> PublishError | None:
        for pred, exc in self._send_rejects:
            if pred(record):
                return PublishError.translate(exc, "send")
        return None

    async def send_many(self, records: Sequence[OutboundRecord]) -> list[Awaitable[Any]]:
        loop = asyncio.get_running_loop()
        futures: list[Awaitable[Any]] = []
        failed_keys: set[bytes] = set()
        for record in records:
            fut: asyncio.Future[None] = loop.create_future()
            futures.append(fut)
            if record.key in failed_keys:
                fut.set_exception(not_sent_error())
                continue
            failure: BaseException | None = self.precheck(record)
            if failure is None and self._fail_next:
                failure = self._fail_next.pop(0)
            for pred, exc in self._delivery_faults:
                if failure is None and pred(record):
                    failure = exc
            if failure is not None:
                fut.set_exception(PublishError.translate(failure, "send"))
                failed_keys.add(record.key)
            else:
                self.records.append(record)
                fut.set_result(None)
        return futures
