"""Test-only hooks of the relay (fault injection), injected as an object."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = ["RelayHooks"]


@dataclass(frozen=True, slots=True)
class RelayHooks:
    """Test-only hooks (fault injection), passed as ``Relay(config, hooks=...)``. Production
    code leaves them unset; every hook defaults to ``None`` (no-op) and nothing reads the
    environment. Each hook is awaited inline: the relay's step waits for it to return.

    Attributes
    ----------
    before_first_send : Callable[[], Awaitable[None]] | None
        Awaited once per relay, before its first records are handed to the producer (after
        the producer started and the batch was claimed). Fault case C03 delays it to widen
        the window in which two relays race for the same shards.
    after_confirm : Callable[[], Awaitable[None]] | None
        Awaited for every batch between "Kafka confirmed the batch" and "mark its rows
        published". Fault case C02 kills the relay process in that window: the rows are on
        Kafka but still pending, and are sent again (same event id) after the restart.

    Examples
    --------
    >>> async def pause() -> None:
    ...     await asyncio.sleep(10)
    >>> relay = Relay(config, hooks=RelayHooks(after_confirm=pause))   # doctest: +SKIP
    """

    before_first_send: Callable[[], Awaitable[None]] | None = None
    after_confirm: Callable[[], Awaitable[None]] | None = None
