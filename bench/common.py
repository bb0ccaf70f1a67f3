"""What every benchmark here shares: the target server, the machine description, argument parsers
and the median (min-max) format. Benchmarks report ratios measured in the same run."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

import pglockkit


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """--dsn or --embedded (neither: $PGLOCKKIT_DSN, else libpq's PG* variables)."""
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--dsn", help="libpq DSN of a server (pglockkit is installed there if missing)")
    target.add_argument(
        "--embedded", action="store_true", help="start (if needed) and use the embedded PostgreSQL 18"
    )


def target(args: argparse.Namespace) -> tuple[str, str]:
    """(DSN, description) from --embedded / --dsn / the environment."""
    if args.embedded:
        from pglockkit import embedded

        return embedded.start(), "embedded"
    if args.dsn:
        return args.dsn, "--dsn"
    return pglockkit.resolve_dsn(), "environment"


def nproc() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(module: str, argv: Sequence[str], target: str, server_version: str) -> dict[str, Any]:
    """Date, command line, server and machine: what a reader needs to weigh the numbers."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", module, *argv]),
        "target": target,
        "server_version": server_version,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "nproc": nproc(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "psycopg": psycopg.__version__,
        "pglockkit": pglockkit.__version__,
    }


def report(output: Path, data: dict[str, Any]) -> int:
    """Print a benchmark's markdown (popped from ``data``) and write the rest to ``output`` as JSON."""
    print(data.pop("markdown"))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {output}", file=sys.stderr)
    return 0


def spread(values: Sequence[float], fmt: str = ",.0f") -> str:
    """'median (min-max)'."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a positive int or float."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return value

    return parse


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers, e.g. '1,2,4'."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be positive, got {text!r}")
    return values
