"""Durations in seconds (the settings ending in ``_s``): ONE rule for every one of them.

A duration is a finite number of seconds in its range; the upper end of every range is at
most :data:`MAX_DURATION_S` (10 years), unless the setting's own is smaller. ``inf`` and
``nan`` parse as floats, and a huge number is a float too: without this rule ``--lease-ttl-s
inf`` and ``--poll-interval-s inf`` were taken (a relay that never renews, never polls),
``--margin-s 1e300`` raised ``OverflowError`` from ``datetime``, and ``--older-than-s inf``
(or ``1e12``) reached PostgreSQL as an interval it cannot add to ``now()``. The commands
refuse ``inf`` and ``nan`` when they parse a setting (:mod:`ledgerbox._core.settings`), the
configs and the operator API check the range (:func:`check_duration`), so a Python caller
gets the same refusal as the command line.

Pure: no I/O.
"""

from __future__ import annotations

import math

from ledgerbox._core.errors import ConfigurationError

__all__ = ["MAX_DURATION_S", "check_duration"]

#: The longest duration any setting accepts, in seconds: 10 years (of 365 days). Far beyond
#: any sensible value, far inside what ``datetime`` arithmetic and PostgreSQL intervals added
#: to ``now()`` can hold.
MAX_DURATION_S = 10 * 365 * 86400.0


def check_duration(
    value: float,
    setting: str,
    *,
    low: float = 0.0,
    low_open: bool = False,
    high: float = MAX_DURATION_S,
    error: type[ConfigurationError] = ConfigurationError,
) -> None:
    """Refuse a duration that is not a finite number of seconds in its range.

    Parameters
    ----------
    value : float
        Seconds.
    setting : str
        The setting, named in the message and set as the error's ``setting``.
    low, low_open : float, bool
        The lowest value, allowed unless ``low_open`` (``> 0`` rather than ``>= 0``).
    high : float
        The highest value allowed (default :data:`MAX_DURATION_S`).
    error : type[ConfigurationError]
        The error raised (a subclass such as ``ledgerbox.admin.InvalidFilterError``).

    Raises
    ------
    ledgerbox.ConfigurationError
        ``"<setting> must be > 0 and <= 315360000 seconds (10 years), a finite number (got
        inf)"``.
    """
    fine = isinstance(value, int | float) and math.isfinite(value)
    if fine and (value > low if low_open else value >= low) and value <= high:
        return
    limit = f"<= {_num(high)} seconds" + (" (10 years)" if high == MAX_DURATION_S else "")
    raise error(
        f"{setting} must be {'>' if low_open else '>='} {_num(low)} and {limit}, a finite "
        f"number (got {_num(value)})",
        setting=setting,
    )


def _num(value: object) -> str:
    if isinstance(value, float) and math.isfinite(value):
        whole = value == int(value) and abs(value) < 1e16
        return str(int(value)) if whole else f"{value:g}"
    return f"{value:g}" if isinstance(value, float) else repr(value)
