"""pglockkit._format: how the commands read and print durations and ages (no server)."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from pglockkit._format import age, duration, ms, parse_duration


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("200ms", timedelta(milliseconds=200)),
        ("2s", timedelta(seconds=2)),
        ("1.5s", timedelta(seconds=1.5)),
        ("5m", timedelta(minutes=5)),
        ("1h", timedelta(hours=1)),
        ("7d", timedelta(days=7)),
        ("30", timedelta(seconds=30)),  # plain seconds
        ("0", timedelta(0)),
        ("0ms", timedelta(0)),
        ("0.0001ms", timedelta(0)),  # below a microsecond: rounds to nothing
        ("-5s", timedelta(seconds=-5)),  # read as written; the SQL function judges it
        ("1e3ms", timedelta(seconds=1)),
    ],
)
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "s", "ms", "abc", "5x", "5 min", "inf", "-inf", "nan", "infs", "1e20d"])
def test_parse_duration_refuses_what_is_not_a_finite_duration(text):
    with pytest.raises(ValueError, match=r"not a duration: .* \(try 200ms, 2s, 5m, 7d\)"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "-"),
        (timedelta(0), "0ms"),
        (0.0, "0ms"),
        (timedelta(microseconds=1), "0.001ms"),
        (timedelta(milliseconds=250), "250ms"),
        (timedelta(seconds=1), "1s"),
        (timedelta(seconds=2.5), "2.5s"),
        (timedelta(minutes=5), "300s"),
        (timedelta(days=2), "172800s"),
        (-2.0, "-2000ms"),  # below one second, as the setting reads
    ],
)
def test_duration(value, expected):
    assert duration(value) == expected


def test_duration_round_trips_through_parse():
    for text in ("250ms", "2s", "1.5s", "90s", "0.001ms"):
        assert duration(parse_duration(text)) == text


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "-"),
        (timedelta(0), "0.0s"),
        (timedelta(microseconds=400), "0.0s"),
        (timedelta(seconds=59.94), "59.9s"),
        (timedelta(seconds=60), "1.0m"),
        (timedelta(minutes=10), "10.0m"),
        (timedelta(minutes=59, seconds=59), "60.0m"),
        (timedelta(hours=1), "1.0h"),
        (timedelta(days=2), "48.0h"),  # no day unit: the columns of `top` stay comparable
        (12.5, "12.5s"),
        (timedelta(seconds=-3), "-3.0s"),  # a lease that expired 3 s ago
        (timedelta(seconds=-90), "-1.5m"),  # negative ages scale like positive ones
        (timedelta(hours=-5), "-5.0h"),
        (math.inf, "infh"),
        (math.nan, "nans"),
    ],
)
def test_age(value, expected):
    assert age(value) == expected


def test_age_of_the_largest_timedelta_is_hours():
    assert age(timedelta.max) == f"{timedelta.max.total_seconds() / 3600:.1f}h"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "-"),
        (0.0, "0 ms"),
        (0.0004, "0 ms"),
        (0.0015, "2 ms"),
        (1.2344, "1,234 ms"),
        (3600.0, "3,600,000 ms"),
        (timedelta(milliseconds=42), "42 ms"),
        (-0.5, "-500 ms"),
        (math.inf, "inf ms"),
    ],
)
def test_ms(value, expected):
    assert ms(value) == expected
