"""Durations, ages and names as the command line reads and prints them: one place for every
command.

``parse_duration`` reads an argument (``200ms``, ``5m``, ``7d``); ``duration`` prints a setting
(``2s``, ``250ms``); ``age`` prints how long something has waited or has left, in a column
(``12.5s``, ``3.0m``, ``2.5h``); ``ms`` prints a measured wait (``1,234 ms``). Each takes a
``timedelta`` or seconds as a float, and prints ``-`` for None.

Names and text read from the database (a queue, a lease, a role, an application_name, a query)
are anyone's to choose. ``printable`` shows one on a terminal or in a log line: one line, no
escape sequence. In a command that a reader may paste, ``sql_literal``, ``sql_ident`` and
``shell_word`` quote it so that it stays one value, whatever it holds.
"""

from __future__ import annotations

import math
import re
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


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x80:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: object) -> str:
    r"""``text`` with every character a terminal would not print as itself (controls such as a
    newline or ESC, format characters such as a bidi override, separators but the space)
    written as an escape, ``\x0a``, ``\u202e``: one line, no escape sequence.

    >>> print(printable("q\n[ERROR] forged"), printable("\x1b[2Jq"))
    q\x0a[ERROR] forged \x1b[2Jq
    """
    s = str(text)
    return s if s.isprintable() else "".join(c if c.isprintable() else _escape(c) for c in s)


def sql_literal(text: str) -> str:
    r"""``text`` as an SQL string literal: ``'...'``, or ``E'...'`` with escapes where it holds a
    backslash or a character ``printable`` escapes (so that the literal stays on one line).

    >>> print(sql_literal("x'); DROP TABLE t; --"), sql_literal("a\nb"))
    'x''); DROP TABLE t; --' E'a\x0ab'
    """
    if text.isprintable() and "\\" not in text:
        return "'" + text.replace("'", "''") + "'"
    body = "".join(
        "\\\\" if c == "\\" else "''" if c == "'" else c if c.isprintable() else _escape(c) for c in text
    )
    return f"E'{body}'"


def sql_ident(name: str) -> str:
    r"""``name`` as a quoted SQL identifier: ``"..."``, or ``U&"..."`` with escapes where it holds a
    character ``printable`` escapes.

    >>> print(sql_ident('Alice'), sql_ident('a "b" c'), sql_ident("a\nb"))
    "Alice" "a ""b"" c" U&"a\000ab"
    """
    if name.isprintable():
        return '"' + name.replace('"', '""') + '"'

    def escaped(c: str) -> str:
        if c == "\\":
            return "\\\\"
        if c == '"':
            return '""'
        if c.isprintable():
            return c
        return f"\\{ord(c):04x}" if ord(c) < 0x10000 else f"\\+{ord(c):06x}"

    return 'U&"' + "".join(escaped(c) for c in name) + '"'


_SHELL_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


def shell_word(text: str) -> str:
    r"""``text`` as one word for a POSIX shell: as it is where nothing in it is special, else in
    single quotes, or as ``$'...'`` (bash, zsh, ksh) with escapes where it holds a character
    ``printable`` escapes. A word that begins with ``-`` needs ``--`` before it in a command.

    >>> print(shell_word("mail"), shell_word("$(rm -rf ~)"), shell_word("a'b"), shell_word("a\nb"))
    mail '$(rm -rf ~)' 'a'"'"'b' $'a\x0ab'
    """
    if _SHELL_SAFE.fullmatch(text):
        return text
    if text.isprintable():
        return "'" + text.replace("'", "'\"'\"'") + "'"
    body = "".join(
        "\\\\" if c == "\\" else "\\'" if c == "'" else c if c.isprintable() else _escape(c) for c in text
    )
    return f"$'{body}'"
