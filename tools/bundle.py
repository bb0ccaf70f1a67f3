"""Write what is generated from ``sql/schema/`` (developer tool; not part of the package).

    python3 tools/bundle.py             write sql/pglockkit.sql, the single-file install for psql
    python3 tools/bundle.py --check     exit 1 if sql/pglockkit.sql is not current (CI runs this)

There is no tool for the migrations: since release 0.1.0 they are history, and every change to
``sql/schema/`` comes with a delta migration written by hand (CONTRIBUTING.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pglockkit.install import render_bundle  # noqa: E402 - the checkout's package

BUNDLE = ROOT / "sql" / "pglockkit.sql"


def _shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if sql/pglockkit.sql is not current")
    parser.add_argument("--output", type=Path, default=BUNDLE, help="the bundle's path")
    args = parser.parse_args(argv)
    text = render_bundle()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{_shown(args.output)} is stale: run `python3 tools/bundle.py`", file=sys.stderr)
            return 1
        print(f"{_shown(args.output)} is up to date")
        return 0
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {_shown(args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
