"""The lock-key test vectors (tests/vectors/lock_keys.json) hold for Python (for SQL on every server:
tests/sql/test_sql_keys.py).

The vectors were generated once from SQL ``pglockkit.lock_key`` by tests/vectors/generate.py; a
client in any language checks itself against the same file (tests/node/client_test.mjs does).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from pglockkit import lock_key, namespace_id

VECTORS_DIR = Path(__file__).resolve().parents[1] / "vectors"
FILE = VECTORS_DIR / "lock_keys.json"


def _load_generator():
    spec = importlib.util.spec_from_file_location("lock_key_vectors_generate", VECTORS_DIR / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _load_generator()
DATA = json.loads(FILE.read_text(encoding="ascii"))
VECTORS = DATA["vectors"]


def _resource(row: dict) -> str | int:
    return row["resource"] if row["resource_type"] == "text" else int(row["resource"])


def _label(row: dict) -> str:
    resource = row["resource"] if len(row["resource"]) < 40 else row["resource"][:40] + "..."
    return f"{row['namespace']}/{resource!r} ({row['note']})"


def test_file_is_what_the_generator_writes():
    """Same inputs as generate.py, in its format (ASCII, one vector a line): regenerated, not hand-edited."""
    assert FILE.read_bytes().isascii()
    assert generate.dump(DATA) == FILE.read_text(encoding="ascii")
    assert [generate.input_of(row) for row in VECTORS] == generate.INPUTS
    explicit = {name: nid for name, nid, derived in generate.NAMESPACES if not derived}
    for row in VECTORS:
        assert row["resource_type"] in ("text", "bigint")
        assert ("key" in row) != ("error" in row), row
        assert row["derived_id"] == (row["namespace"] not in explicit)
        if not row["derived_id"]:
            assert row["namespace_id"] == explicit[row["namespace"]]


def test_vectors_cover_the_contract():
    """The documented examples and the edge cases the task asks for are in the file."""
    by_input = {(r["namespace_id"], r["resource_type"], r["resource"]): r.get("key") for r in VECTORS}
    assert by_input[(1, "text", "restock_plan")] == "458487468674308"
    assert by_input[(7301, "text", "tenant:42")] == "2055230974443318157"
    assert by_input[(2, "text", "")] == "828861615000702"
    assert by_input[(3, "bigint", "42")] == "844424930132010"
    assert by_input[(42, "text", "invoice:7")] == "11972594097471414"  # the README tour
    ids = {r["namespace_id"] for r in VECTORS}
    assert {1, 32767} <= ids
    texts = [r["resource"] for r in VECTORS if r["resource_type"] == "text"]
    assert any(len(t.encode()) > 65536 for t in texts)
    assert any(any(ord(c) > 0xFFFF for c in t) for t in texts)  # outside the BMP (emoji)
    assert "e\u0301" in texts and "\u00e9" in texts  # combining vs precomposed
    ints = {int(r["resource"]): r.get("error") for r in VECTORS if r["resource_type"] == "bigint"}
    assert ints[0] is None and ints[(1 << 47) - 1] is None
    assert ints[-1] == ints[1 << 47] == ints[(1 << 63) - 1] == ints[-(1 << 63)] == "22003"


def test_python_keys_match_vectors():
    failures = []
    for row in VECTORS:
        if row["derived_id"] and namespace_id(row["namespace"]) != row["namespace_id"]:
            failures.append(f"namespace_id({row['namespace']!r}) != {row['namespace_id']}")
        try:
            got = str(lock_key(row["namespace_id"], _resource(row)))
        except ValueError:
            got = "22003"  # what SQL raises for an out-of-range integer resource
        if got != row.get("key", row.get("error")):
            failures.append(f"{_label(row)}: python {got}, file {row.get('key', row.get('error'))}")
    assert not failures, "\n".join(failures)


def test_vector_keys_have_the_documented_layout():
    """Every key: namespace id in the top 16 bits, bit 47 set exactly for text, positive."""
    for row in VECTORS:
        if "key" not in row:
            continue
        key = int(row["key"])
        assert 0 < key < 1 << 63, _label(row)
        assert key >> 48 == row["namespace_id"], _label(row)
        assert bool(key >> 47 & 1) == (row["resource_type"] == "text"), _label(row)
        if row["resource_type"] == "bigint":
            assert key & ((1 << 47) - 1) == int(row["resource"]), _label(row)
