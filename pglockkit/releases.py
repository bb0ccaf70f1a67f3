"""The releases of pglockkit's schema, newest last: each with the last migration it contains.

A release is cut by tagging its commit ``vX.Y.Z`` and adding it here (CONTRIBUTING.md). Since
0.1.0 the migrations are append-only, so the chain up to a release's last migration builds that
release's schema exactly: ``pglockkit status`` names the newest release a database has all of,
and the upgrade tests install an exact release from it.
"""

from __future__ import annotations

from collections.abc import Iterable

# version -> the last migration of that release
RELEASES: dict[str, str] = {
    "0.1.0": "0001_baseline",
}


def release_of(applied: Iterable[str]) -> str | None:
    """The newest release whose migrations are all among ``applied`` (ids), or None.

    >>> release_of(["0001_baseline"])
    '0.1.0'
    """
    done = set(applied)
    newest = None
    for version, last in RELEASES.items():
        if last in done:
            newest = version
    return newest
