"""What one page shows: :func:`gather` reads every section of every service from a
:class:`~ledgerbox.console._source.ConsoleSource`, each section on its own (a section that
fails shows its one-line error; the others still show), and :class:`RateMeter` turns two
readings of a counter into a rate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ledgerbox._core.errors import LedgerboxError
from ledgerbox._core.redaction import scrub
from ledgerbox.admin import DeadEvent, DlqRecord, HeldKey, NotFoundError, PartitionLag
from ledgerbox.console._config import ConsoleConfig, ServiceTarget
from ledgerbox.console._source import ConsoleSource, RelayPanel

__all__ = ["RateMeter", "Section", "ServiceView", "gather"]

T = TypeVar("T")
_log = logging.getLogger("ledgerbox.console")


@dataclass(frozen=True, slots=True)
class Section(Generic[T]):
    """One section's data, or why it could not be read.

    Attributes
    ----------
    value : T | None
        ``None`` when ``error`` is set.
    error : str | None
        One line (scrubbed of secrets).
    note : str | None
        Shown with an empty ``value``: why there is nothing (not an error).
    """

    value: T | None
    error: str | None = None
    note: str | None = None


@dataclass(frozen=True, slots=True)
class ServiceView:
    """Everything the page shows for one service.

    Attributes
    ----------
    name : str
    status : Section[RelayPanel]
    publish_rate : float | None
        Events per second published by the service's relays since the previous page load
        (``None``: unknown: no relay metrics, or the first load).
    held_keys, dead : Section[list]
    dlq : dict[str, Section[list[DlqRecord]]]
        By dead-letter topic.
    lag : dict[str, Section[list[PartitionLag]]]
        By consumer group.
    """

    name: str
    status: Section[RelayPanel]
    publish_rate: float | None
    held_keys: Section[list[HeldKey]]
    dead: Section[list[DeadEvent]]
    dlq: dict[str, Section[list[DlqRecord]]] = field(default_factory=dict)
    lag: dict[str, Section[list[PartitionLag]]] = field(default_factory=dict)


class RateMeter:
    """Rate of a monotonic counter from successive readings, per service.

    A reading more than ``max_gap_s`` after the previous one, or below it (a relay restarted
    and its counter began again), gives ``None`` and starts over.

    Parameters
    ----------
    clock : Callable[[], float]
        Monotonic seconds (injected for tests).
    min_gap_s, max_gap_s : float
        Readings closer than ``min_gap_s`` (default 0.5) keep the previous rate; further
        than ``max_gap_s`` (default 600) apart give ``None``.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        min_gap_s: float = 0.5,
        max_gap_s: float = 600.0,
    ) -> None:
        self._clock = clock
        self._min_gap_s = min_gap_s
        self._max_gap_s = max_gap_s
        self._last: dict[str, tuple[float, float, float | None]] = {}

    def update(self, name: str, value: float | None) -> float | None:
        """Record ``value`` for ``name`` and return the rate per second since the previous
        reading (``None``: unknown)."""
        if value is None:
            self._last.pop(name, None)
            return None
        now = self._clock()
        previous = self._last.get(name)
        rate: float | None = None
        if previous is not None:
            at, before, last_rate = previous
            gap = now - at
            if value >= before and gap < self._min_gap_s:
                return last_rate
            if value >= before and gap <= self._max_gap_s:
                rate = (value - before) / gap
        self._last[name] = (now, value, rate)
        return rate


def _failed(exc: Exception) -> Section[Any]:
    if isinstance(exc, LedgerboxError):
        return Section(None, scrub(f"{type(exc).__name__}: {exc}".splitlines()[0]))
    # A bug must not take the whole page (and the other services) down.
    _log.error("console: a section failed", exc_info=exc)
    return Section(None, f"internal error ({type(exc).__name__}): see the console's log")


async def _section(read: Awaitable[T]) -> Section[T]:
    try:
        return Section(await read)
    except Exception as exc:
        return _failed(exc)


async def _dlq_section(read: Awaitable[list[DlqRecord]]) -> Section[list[DlqRecord]]:
    # A dead-letter topic appears with its first record: until then there is nothing to show.
    try:
        return Section(await read)
    except NotFoundError as exc:
        return Section([], note=scrub(str(exc).splitlines()[0]))
    except Exception as exc:
        return _failed(exc)


async def _service(source: ConsoleSource, service: ServiceTarget, rates: RateMeter) -> ServiceView:
    # Every section at once: a server that does not answer costs the page its timeout once
    # (Kafka's 15 s request timeout), not once per section (the DLQ reads, then the lag reads,
    # took 30 s with one DLQ topic and one group).
    (status, total, held, dead), dlq, lag = await asyncio.gather(
        asyncio.gather(
            _section(source.relay_status(service)),
            _section(source.published_total(service)),
            _section(source.held_keys(service)),
            _section(source.dead_events(service)),
        ),
        asyncio.gather(*(_dlq_section(source.dlq_records(service, t)) for t in service.dlq_topics)),
        asyncio.gather(*(_section(source.lag(service, g)) for g in service.groups)),
    )
    return ServiceView(
        name=service.name,
        status=status,
        publish_rate=rates.update(service.name, total.value),
        held_keys=held,
        dead=dead,
        dlq=dict(zip(service.dlq_topics, dlq, strict=True)),
        lag=dict(zip(service.groups, lag, strict=True)),
    )


async def gather(
    config: ConsoleConfig,
    source: ConsoleSource,
    rates: RateMeter,
    names: Sequence[str] | None = None,
) -> list[ServiceView]:
    """The views of the services called ``names`` (``None``: all), in config order. Never
    raises for a service that cannot be reached: its sections carry the errors."""
    services = [s for s in config.services if names is None or s.name in names]
    return list(await asyncio.gather(*(_service(source, s, rates) for s in services)))
