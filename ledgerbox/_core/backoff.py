"""Exponential backoff with full jitter: a pure function, no clock, no I/O.

Source: "Exponential Backoff And Jitter", AWS Architecture Blog (Marc Brooker, 2015): full
jitter spreads retrying clients best. Shared by the relay and the inbox.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ledgerbox._core.errors import ConfigurationError

__all__ = ["Backoff"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays for attempt 1, 2, 3, ...: uniform in ``[0, min(max_s, base_s * 2**(n-1))]``.

    Parameters
    ----------
    base_s : float
        Ceiling of the first delay, in seconds (> 0).
    max_s : float
        Largest ceiling, in seconds (>= base_s).

    Raises
    ------
    ConfigurationError
        If ``base_s <= 0`` or ``max_s < base_s``.
    """

    base_s: float = 0.1
    max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.max_s < self.base_s:
            raise ConfigurationError(
                f"backoff needs 0 < base_s <= max_s, got base_s={self.base_s}, max_s={self.max_s}"
            )

    def ceiling_s(self, attempt: int) -> float:
        """Upper bound of the delay before retry number ``attempt`` (1-based), in seconds."""
        if attempt < 1:
            return 0.0
        # Cap the exponent so huge attempt counts do not overflow a float.
        return min(self.max_s, self.base_s * 2.0 ** min(attempt - 1, 62))

    def delay_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """A jittered delay in seconds for retry number ``attempt`` (1-based)."""
        return (rng or random).uniform(0.0, self.ceiling_s(attempt))
