#!/usr/bin/env python3
"""Write the sync flavour of the worker from its asyncio source, or check that it is current.

    python3 tools/async_to_sync.py            # rewrite every generated file
    python3 tools/async_to_sync.py --check    # exit 1, naming the stale ones (CI, and a test)
    python3 tools/async_to_sync.py --twins    # the lines still written twice in ASYNC blocks

The asyncio modules are the source (``SOURCES``: ``pglockkit/worker/driver_async.py`` becomes
``pglockkit/worker/driver.py``, ``pglockkit/locks_async.py`` becomes ``pglockkit/locks.py``...).
The sync module is the same text with:

- ``await`` dropped, and ``async`` before ``def``, ``with`` and ``for``;
- the names of ``NAMES`` replaced (``AsyncPool`` by ``Pool``, ``arun`` by ``run``...), in code,
  and as whole words in comments and docstrings; in a docstring's examples (``>>>`` and ``...``
  lines), ``await`` and ``async`` dropped too;
- each ``if True:  # ASYNC`` block replaced by its ``else:`` block (or by nothing): what only one
  flavour does, written side by side where it differs;
- imports no longer used dropped, a ``for`` that only yields made a ``yield from``, and the
  result formatted, by ruff (the project's linter).

It works on tokens and lines, not on a syntax tree, so comments and layout are kept; psycopg
generates its sync modules from its async ones the same way (``tools/async_to_sync.py`` there
works on the tree). Each generated file says at its top where it came from.
"""

from __future__ import annotations

import argparse
import difflib
import io
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SOURCES = {
    "pglockkit/_run_async.py": "pglockkit/_run.py",
    "pglockkit/leases_async.py": "pglockkit/leases.py",
    "pglockkit/locks_async.py": "pglockkit/locks.py",
    "pglockkit/queue_async.py": "pglockkit/queue.py",
    "pglockkit/retry_async.py": "pglockkit/retry.py",
    "pglockkit/runs_async.py": "pglockkit/runs.py",
    "pglockkit/scheduling_async.py": "pglockkit/scheduling.py",
    "pglockkit/worker/connection_async.py": "pglockkit/worker/connection.py",
    "pglockkit/worker/pool_async.py": "pglockkit/worker/pool.py",
    "pglockkit/worker/driver_async.py": "pglockkit/worker/driver.py",
}

NAMES = {
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "AsyncFeeder": "Feeder",
    "AsyncHold": "Hold",
    "AsyncLaneConnection": "LaneConnection",
    "AsyncLazyConnection": "LazyConnection",
    "AsyncPipeline": "Pipeline",
    "AsyncPool": "Pool",
    "AsyncTransaction": "Transaction",
    "AsyncConnection": "Connection",
    "AsyncCopy": "Copy",
    "AsyncServerCursor": "ServerCursor",
    "_AsyncLaneCursor": "_LaneCursor",
    "_AsyncLaneServerCursor": "_LaneServerCursor",
    "AsyncCursor": "Cursor",
    "AsyncIterator": "Iterator",
    "_aexecute": "_execute",
    "aconnect": "connect",
    "ainvoke": "invoke",
    "arun": "run",
    "arun_pipeline": "run_pipeline",
    "aset_server_keepalives": "set_server_keepalives",
    "asynccontextmanager": "contextmanager",
    "atry_key": "try_key",
    "atry_keys": "try_keys",
    "connection_async": "connection",
    "pool_async": "pool",
}

KEYWORDS = ("def", "with", "for")
MARK = re.compile(r"^(?P<indent>[ ]*)if True:[ ]*# ASYNC[ ]*$")
HEADER = (
    "# Generated from {source} by tools/async_to_sync.py: do not edit.\n"
    "# Edit the source, then run `python3 tools/async_to_sync.py` (CI fails while this file\n"
    "# differs from what the tool writes).\n"
)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _block_end(lines: list[str], start: int, indent: int) -> int:
    """The index after the block whose header is ``lines[start]``: the lines indented deeper
    (blank lines inside it included, trailing blank lines not)."""
    end = i = start + 1
    while i < len(lines):
        if lines[i].strip():
            if _indent(lines[i]) <= indent:
                break
            end = i + 1
        i += 1
    return end


def _async_blocks(lines: list[str]) -> Iterator[tuple[int, int, int, int, int]]:
    """Each ``if True:  # ASYNC`` block of a source, as indices into ``lines``: its header, the
    end of its body, the header of its ``else:`` block and the end of that (both the body's end
    when it has none), and the header's indent."""
    i = 0
    while i < len(lines):
        m = MARK.match(lines[i])
        if not m:
            i += 1
            continue
        indent = len(m["indent"])
        body_end = else_at = end = _block_end(lines, i, indent)
        j = body_end
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j < len(lines) and _indent(lines[j]) == indent and lines[j].strip() == "else:":
            else_at, end = j, _block_end(lines, j, indent)
        yield i, body_end, else_at, end, indent
        i = end


def drop_async_blocks(lines: list[str]) -> list[str]:
    out: list[str] = []
    done = 0
    for start, body_end, else_at, end, indent in _async_blocks(lines):
        out += lines[done:start]
        for line in lines[else_at + 1 : end] if else_at < end else []:
            out.append(line[4:] if line.startswith(" " * (indent + 4)) else line.lstrip(" "))
        # Without an else block, the blank lines after the body stay; with one, it ends the block.
        done = body_end if else_at == end else end
    return out + lines[done:]


EXAMPLE = re.compile(r"^(\s*(?:>>>|\.\.\.) )(.*)$", re.MULTILINE)
EXAMPLE_KEYWORDS = re.compile(r"\bawait |\basync (?=(?:def|with|for)\b)")


def _words(text: str) -> str:
    """A string's or a comment's text: the names of ``NAMES`` replaced as whole words, and the
    lines of a doctest example (``>>>``, ``...``) without ``await`` and ``async``."""
    text = re.sub(r"\b(" + "|".join(map(re.escape, NAMES)) + r")\b", lambda m: NAMES[m[1]], text)
    return EXAMPLE.sub(lambda m: m[1] + EXAMPLE_KEYWORDS.sub("", m[2]), text)


def unasync(text: str) -> str:
    lines = drop_async_blocks(text.splitlines(keepends=True))
    text = "".join(lines)
    edits: list[tuple[int, int, int, int, str]] = []  # (row, col, end row, end col, new text)
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    for n, tok in enumerate(tokens):
        (row, col), (erow, ecol) = tok.start, tok.end
        keyword = tok.string == "await" or (tok.string == "async" and tokens[n + 1].string in KEYWORDS)
        if tok.type == tokenize.NAME and keyword:  # dropped, with the space after it
            nxt = tokens[n + 1].start
            edits.append((row, col, nxt[0], nxt[1], ""))
        elif tok.type == tokenize.NAME and tok.string in NAMES:
            edits.append((row, col, erow, ecol, NAMES[tok.string]))
        elif tok.type in (tokenize.STRING, tokenize.COMMENT):
            new = _words(tok.string)
            if new != tok.string:
                edits.append((row, col, erow, ecol, new))
    lines = text.splitlines(keepends=True)
    for row, col, erow, ecol, new in reversed(edits):
        if row == erow:
            line = lines[row - 1]
            lines[row - 1] = line[:col] + new + line[ecol:]
        else:  # a token spanning lines (a docstring): rows row..erow become one piece
            head, tail = lines[row - 1][:col], lines[erow - 1][ecol:]
            lines[row - 1 : erow] = [head + new + tail]
    return "".join(lines)


def _ruff(args: list[str], text: str, target: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--stdin-filename", target, "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if done.returncode not in (0, 1) or not done.stdout:
        raise SystemExit(f"ruff {' '.join(args)} failed on {target}: {done.stderr.strip()}")
    return done.stdout


def generate(source: str, target: str) -> str:
    text = unasync((ROOT / source).read_text())
    # Unused imports dropped, imports sorted, and a loop that only yields (an ``async for`` once
    # sync) made a ``yield from``.
    fixes = ["--fix", "--unsafe-fixes", "--select", "F401,I001,UP028"]
    text = _ruff(["check", *fixes, "--quiet", "--exit-zero"], text, target)
    text = _ruff(["format", "--quiet"], text, target)
    return HEADER.format(source=source) + text


def _unasynced(line: str) -> str:
    return _words(re.sub(r"\b(await|async)\s+", "", line.strip()))


def twins(text: str) -> list[tuple[int, str]]:
    """The lines an ``ASYNC`` block and its ``else:`` block both have: equal once ``await``,
    ``async`` and the names of ``NAMES`` are read as the sync flavour reads them, in runs of 3
    lines or more; comments and lines of 12 characters or fewer (``try:``, ``return``) not
    counted. What should be written once, outside the blocks."""
    found = []
    lines = text.splitlines()
    for start, body_end, else_at, end, _ in _async_blocks(lines):
        a = [_unasynced(x) for x in lines[start + 1 : body_end]]
        b = [_unasynced(x) for x in lines[else_at + 1 : end]] if else_at < end else []
        for block in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
            if block.size >= 3:
                for k in range(block.a, block.a + block.size):
                    if len(a[k]) > 12 and not a[k].startswith("#"):
                        found.append((start + 2 + k, a[k]))  # 1-based, the body from the line after
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    parser.add_argument("--twins", action="store_true", help="write nothing; list the lines written twice")
    args = parser.parse_args(argv)
    if args.twins:
        total = 0
        for source in SOURCES:
            for line, text in twins((ROOT / source).read_text()):
                print(f"{source}:{line}: {text}")
                total += 1
        print(f"{total} line(s) written twice in ASYNC blocks")
        return 0
    stale = []
    for source, target in SOURCES.items():
        text = generate(source, target)
        path = ROOT / target
        if path.exists() and path.read_text() == text:
            continue
        stale.append(target)
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print(f"stale (run python3 tools/async_to_sync.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    for target in stale:
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
