"""Durations and ages as the command line reads and prints them: one place for every command.

``parse_duration`` reads an argument (``200ms``, ``5m``, ``7d``); ``duration`` prints a setting
(``2s``, ``250ms``); ``age`` prints how long something has waited or has left, in a column
(``12.5s``, ``3.0m``, ``2.5h``); ``ms`` prints a measured wait (``1,234 ms``). Each takes a
``timedelta`` or seconds as a float, and prints ``-`` for None.
"""

from __future__ import annotations

import math
from datetime import timedelta

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """'200ms', '2s', '1.5s', '5m', '1h', '7d', or plain seconds; ValueError otherwise.

    >>> parse_duration("1.5m")
    datetime.timedelta(seconds=90)
    """
    for suffix in ("ms", "s", "m", "h", "d"):
        if text.endswith(suffix):
            number, scale = text[: -len(suffix)], _UNITS[suffix]
            break
    else:
        number, scale = text, 1
    try:
        return timedelta(seconds=float(number) * scale)
    except (ValueError, OverflowError):  # not a number; nan, inf or beyond timedelta's range
        raise ValueError(f"not a duration: {text!r} (try 200ms, 2s, 5m, 7d)") from None


def _seconds(value: timedelta | float) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def duration(value: timedelta | float | None) -> str:
    """A setting such as a lock timeout, exact and short: '250ms' below a second, else '2s', '90s'.

    >>> duration(timedelta(milliseconds=250)), duration(2.5)
    ('250ms', '2.5s')
    """
    if value is None:
        return "-"
    seconds = _seconds(value)
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    return f"{seconds:g}s"


def age(value: timedelta | float | None) -> str:
    """An age or a time left, one decimal, in seconds below a minute, minutes below an hour, else
    hours: '12.5s', '3.0m', '26.0h'; a negative value (a lease expired that long ago) keeps its
    sign: '-3.0m'.

    >>> age(timedelta(minutes=10)), age(-90.0), age(None)
    ('10.0m', '-1.5m', '-')
    """
    if value is None:
        return "-"
    seconds = _seconds(value)
    size = abs(seconds)
    if size < 60 or math.isnan(seconds):
        return f"{seconds:.1f}s"
    if size < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def ms(value: timedelta | float | None) -> str:
    """A measured wait in whole milliseconds, with thousands separators: '1,234 ms'.

    >>> ms(1.2344), ms(None)
    ('1,234 ms', '-')
    """
    if value is None:
        return "-"
    return f"{_seconds(value) * 1000:,.0f} ms"
