"""Generate ``lock_keys.json``: pglockkit lock-key test vectors for clients in any language.

The expected keys come from the SQL function ``pglockkit.lock_key`` (the source of truth), never
from a client implementation. Run it once against any database with pglockkit installed, and
commit the result; ``tests/test_vectors.py`` then checks every row against the Python
implementation and against SQL on every test server, and ``tests/node/client_test.mjs`` checks it
against a JavaScript implementation::

    pglockkit up                                   # or any server: pglockkit install --dsn ...
    python3 tests/vectors/generate.py "$DSN"       # or PGLOCKKIT_DSN=... python3 tests/vectors/generate.py

It registers the namespaces below inside one transaction and rolls it back, so the database is
left as it was. To add a vector, add an input below and regenerate: the test fails when the file
and this script's inputs disagree.

Why JSON and not CSV: every language parses JSON with its standard library (CSV needs a parser
for quoting, and has no way to tell an empty string from a missing value); the file is
ASCII-only with ``\\uXXXX`` escapes, so no editor, tool or platform can normalise, re-encode or
strip the unicode vectors (combining marks, a BOM, zero-width joiners); and every 64-bit number
(keys, bigint resources) is a decimal string, because JSON numbers above 2^53 lose precision in
JavaScript and other parsers.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "lock_keys.json"

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
LIMIT = 1 << 47  # integer resources are 0 <= id < 2^47

# (name, id, derived): derived namespaces are registered without an id, so their id is
# namespace_id(name) (first 2 bytes of sha256(name), big-endian, mod 32767, plus 1).
NAMESPACES = [
    ("ns-1", 1, False),
    ("ns-2", 2, False),
    ("ns-3", 3, False),
    ("ns-255", 255, False),
    ("ns-256", 256, False),
    ("ns-7301", 7301, False),
    ("ns-32766", 32766, False),
    ("ns-32767", 32767, False),
    ("billing", 42, False),
    ("graphs", None, True),
    ("pglockkit", None, True),
]

# (namespace, resource, note): a str is a text resource, an int a bigint resource.
INPUTS: list[tuple[str, str | int, str]] = [
    # The examples of DESIGN.md and the README.
    ("ns-1", "restock_plan", "DESIGN example"),
    ("ns-7301", "tenant:42", "DESIGN example (key above 2^53)"),
    ("ns-2", "", "DESIGN example: empty string"),
    ("ns-3", 42, "DESIGN example: integer resource"),
    ("billing", "invoice:7", "README tour example"),
    ("graphs", "restock_plan", "README tour: namespace with a derived id"),
    ("pglockkit", "install", "pglockkit's own namespace (derived id)"),
    # Empty string and whitespace, at both ends of the namespace range.
    ("ns-1", "", "empty string, lowest namespace id"),
    ("ns-32767", "", "empty string, highest namespace id"),
    ("ns-1", " ", "one space"),
    ("ns-1", " restock_plan ", "leading and trailing spaces are part of the resource"),
    ("ns-1", "\t\n\r\n", "tab, LF, CRLF"),
    ("ns-1", "\x01\x1f\x7f", "control characters"),
    ("ns-1", "'\"\\,;%_*", "quotes, backslash, CSV and LIKE metacharacters"),
    ("ns-3", "42", "text '42' is not the integer 42"),
    ("ns-3", "-1", "text '-1' is a valid text resource"),
    ("ns-3", "9223372036854775807", "int64 max as text"),
    # Unicode: keys hash the UTF-8 bytes, with no normalisation.
    ("ns-1", "\u00e9", "e with acute, precomposed (NFC): 2 UTF-8 bytes"),
    ("ns-1", "e\u0301", "e + combining acute (NFD): differs from the precomposed form"),
    ("ns-1", "\u00c5ngstr\u00f6m", "precomposed Latin-1 range letters (a Latin-1 encoder gets these wrong)"),
    ("ns-1", "A\u030angstro\u0308m", "the same word decomposed, with combining marks"),
    ("ns-1", "\u65e5\u672c\u8a9e", "CJK: 3-byte UTF-8"),
    ("ns-1", "\u041f\u0440\u0438\u0432\u0435\u0442", "Cyrillic"),
    ("ns-1", "\u0645\u0631\u062d\u0628\u0627", "Arabic (right to left)"),
    ("ns-1", "\U0001f512", "emoji (lock): 4-byte UTF-8, a surrogate pair in UTF-16"),
    ("ns-1", "\U0001f469\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466", "emoji ZWJ sequence (family)"),
    ("ns-1", "\U0001f44d\U0001f3fd", "emoji with skin-tone modifier"),
    ("ns-1", "\U0001f1fa\U0001f1e6", "flag: two regional indicators"),
    ("ns-1", "\U00020b9f", "CJK extension B: outside the BMP"),
    ("ns-1", "\ufeffbom", "leading byte-order mark is part of the resource"),
    ("ns-1", "\ufffd", "replacement character"),
    ("ns-1", "\uffff", "U+FFFF (noncharacter, valid UTF-8)"),
    ("ns-1", "\U0010ffff", "U+10FFFF, the highest code point"),
    ("ns-1", "tenant:\U0001f512:\u00e9", "mixed ASCII, emoji and accents"),
    ("ns-32767", "\U0001f512", "emoji, highest namespace id"),
    # Lengths at SHA-256 padding boundaries (55/56 and 63/64/65 bytes), in bytes, not characters.
    ("ns-1", "a" * 55, "55 bytes: the longest one-block message"),
    ("ns-1", "a" * 56, "56 bytes: padding spills into a second block"),
    ("ns-1", "a" * 63, "63 bytes"),
    ("ns-1", "a" * 64, "64 bytes: exactly one block"),
    ("ns-1", "a" * 65, "65 bytes"),
    ("ns-1", "\u00e9" * 28, "28 characters, 56 UTF-8 bytes (hash bytes, not characters or UTF-16 units)"),
    # Very long text.
    ("ns-1", "x" * 65_537, "65,537 bytes: past 64 KiB"),
    (
        "ns-32767",
        "pglockkit \u00e9\u65e5\U0001f512 " * 1_000,
        "14,000 characters, 15,000 UTF-16 units, 20,000 UTF-8 bytes",
    ),
    # Namespace ids at the edges (byte boundaries and the top of the range).
    ("ns-255", "edge", "namespace id 255"),
    ("ns-256", "edge", "namespace id 256"),
    ("ns-32766", "edge", "namespace id 32766"),
    ("ns-32767", "edge", "namespace id 32767 (keys near the int64 maximum)"),
    # Bigint resources: valid ones.
    ("ns-1", 0, "integer 0, lowest namespace id: the smallest key pglockkit makes"),
    ("ns-1", 1, "integer 1"),
    ("ns-2", (1 << 32) - 1, "2^32 - 1"),
    ("ns-2", 1 << 32, "2^32: the key's objid wraps"),
    ("ns-7301", 123456789012, "integer above 2^32"),
    ("ns-32767", 0, "integer 0, highest namespace id"),
    ("ns-32767", LIMIT - 1, "2^47 - 1, the largest integer resource: the largest integer key"),
    ("ns-1", LIMIT - 1, "2^47 - 1, lowest namespace id"),
    ("billing", 9, "README: integer resource in billing"),
    # Bigint resources: out of range (error 22003).
    ("ns-1", -1, "negative: out of range"),
    ("ns-1", LIMIT, "2^47: out of range (it would set the text flag)"),
    ("ns-1", (1 << 53) + 1, "2^53 + 1: out of range (and not a safe JavaScript number)"),
    ("ns-1", INT64_MAX, "int64 max: out of range"),
    ("ns-1", INT64_MIN, "int64 min: out of range"),
    ("ns-32767", -LIMIT, "-2^47: out of range"),
]


def rows(keys: list[tuple[str, str | None]]) -> list[dict]:
    """The file's rows, from the inputs and ``(key, error)`` per input (as decimal strings)."""
    ids = {name: nid for name, nid, _ in NAMESPACES}
    out = []
    for (ns, resource, note), (key, error) in zip(INPUTS, keys, strict=True):
        row = {
            "namespace": ns,
            "namespace_id": ids[ns],
            "derived_id": ids[ns] is None,
            "resource_type": "text" if isinstance(resource, str) else "bigint",
            "resource": resource if isinstance(resource, str) else str(resource),
        }
        row.update({"key": key} if error is None else {"error": error})
        row["note"] = note
        out.append(row)
    return out


def input_of(row: dict) -> tuple[str, str | int, str]:
    """The generator input a file row came from."""
    resource = row["resource"] if row["resource_type"] == "text" else int(row["resource"])
    return row["namespace"], resource, row["note"]


def generate(dsn: str) -> dict:
    import psycopg

    with psycopg.connect(dsn) as conn:  # one transaction, rolled back below
        version = conn.execute("SHOW server_version").fetchone()[0]
        ids = {}
        for name, nid, derived in NAMESPACES:
            assert derived == (nid is None)
            ids[name] = conn.execute("SELECT pglockkit.register_namespace(%s, %s)", (name, nid)).fetchone()[0]
        keys: list[tuple[str | None, str | None]] = []
        for ns, resource, _ in INPUTS:
            cast = "text" if isinstance(resource, str) else "bigint"
            try:
                with conn.transaction():  # a savepoint: an expected error leaves the rest alone
                    key = conn.execute(
                        f"SELECT pglockkit.lock_key(%s, %s::{cast})", (ns, resource)
                    ).fetchone()[0]
                keys.append((str(key), None))
            except psycopg.Error as exc:
                if exc.sqlstate != "22003":
                    raise
                keys.append((None, exc.sqlstate))
        conn.rollback()
    vectors = rows(keys)
    for row in vectors:
        row["namespace_id"] = ids[row["namespace"]]
    return {
        "about": "pglockkit lock-key test vectors: (namespace, namespace id, resource) -> key, or the "
        "SQLSTATE that lock_key raises. Keys and bigint resources are decimal strings (they exceed 2^53). "
        "derived_id: the namespace was registered without an id, so namespace_id is derived from its name.",
        "formula": [
            "text resource:    key = (ns_id << 48) | (1 << 47) | h47(resource)",
            "                  h47 = first 6 bytes of sha256(UTF-8 bytes of resource), big-endian, >> 1",
            "integer resource: key = (ns_id << 48) | id, with 0 <= id < 2^47, else SQLSTATE 22003",
            "derived ns id:    first 2 bytes of sha256(UTF-8 name), big-endian, mod 32767, plus 1",
        ],
        "generated_by": f"tests/vectors/generate.py from SQL pglockkit.lock_key on PostgreSQL {version}",
        "vectors": vectors,
    }


def dump(data: dict) -> str:
    """ASCII-only JSON, one vector per line (readable diffs)."""
    head = {k: v for k, v in data.items() if k != "vectors"}
    text = json.dumps(head, indent=1)[:-2]  # drop the closing "\n}"
    lines = ",\n".join("  " + json.dumps(row) for row in data["vectors"])
    return f'{text},\n "vectors": [\n{lines}\n ]\n}}\n'


def main(argv: list[str]) -> int:
    dsn = argv[1] if len(argv) > 1 else os.environ.get("PGLOCKKIT_DSN")
    if not dsn:
        print(__doc__, file=sys.stderr)
        return 2
    data = generate(dsn)
    assert json.loads(dump(data)) == data
    OUT.write_text(dump(data), encoding="ascii")
    print(f"wrote {len(data['vectors'])} vectors to {OUT.name} ({data['generated_by']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
