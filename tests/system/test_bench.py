"""Smoke test of the benchmark suite: ``python -m bench --quick`` end to end on each test server.

The numbers of a quick run mean nothing; the test checks that every section ran and reported
numbers, and that suite.md and suite.json were written. procrastinate and pgqueuer are the optional
extra ``peers``, graphile-worker and pg-boss the Node.js project in bench/node (``npm ci --prefix
bench/node``, and Node.js 20+): without them (as in CI) their rows must say so, and with them they
must be measured.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from bench import peers, suite


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


# The harness on one server: what it measures (every SQL path) is tested on both elsewhere, and the
# suite's report is the same code on either; on both it cost 70 s of the test run.
@pytest.mark.slow
@pytest.mark.parametrize("server", ["pg18"], indirect=True)
def test_quick_suite_reports_every_section(db, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    assert suite.main(["--dsn", db.dsn, "--quick", "--output-dir", str(tmp_path)]) == 0
    elapsed = time.monotonic() - started

    doc = json.loads((tmp_path / "suite.json").read_text(encoding="utf-8"))
    markdown = (tmp_path / "suite.md").read_text(encoding="utf-8")
    assert markdown == capsys.readouterr().out
    assert "| section | measure | result | target |" in markdown
    env = doc["environment"]
    assert env["nproc"] >= 1 and env["cpu"] and env["date"] and env["command"].startswith("python -m bench")
    assert env["server_short"].split(".")[0] == str(db.server.version)

    sections = doc["sections"]
    assert list(sections) == [s.name for s in suite.SECTIONS]
    assert {row["section"] for row in doc["summary"]} == set(sections)
    for name, section in sections.items():
        assert _positive(section["seconds"]), name
        assert section["markdown"].strip(), name

    lock = sections["lock"]["data"]
    assert lock["round_trips"] and all(_positive(r["ratio"]) for r in lock["round_trips"])
    assert _positive(lock["server_side"]["cost_ratio"])

    queue = sections["queue"]["data"]["results"]
    assert set(queue) == {"claim_complete", "scaling", "backlog", "batch"}
    assert all(_positive(r["ratio"]) and _positive(r["ratio_minimal"]) for r in queue["claim_complete"])
    assert all(_positive(r["queue_jobs_s"]) and _positive(r["global_lock_units_s"]) for r in queue["scaling"])
    assert [c["case"] for c in queue["backlog"]["cases"]] == ["a", "b", "c", "d"]
    assert all(_positive(c["ratio_vs_a"]) for c in queue["backlog"]["cases"])
    assert all(_positive(r["jobs_s"]) for r in queue["batch"])

    lease = sections["lease"]["data"]
    assert lease["rows"] and all(_positive(r["ratio"]) for r in lease["rows"])

    monitoring = sections["monitoring"]["data"]
    assert monitoring["locks_held"] > 0 and _positive(monitoring["kept"])
    assert all(_positive(v) for values in monitoring["latency_ms"].values() for v in values)

    pgbench = sections["pgbench"]["data"]
    assert pgbench["environment"]["pgbench"].startswith("pgbench")
    for row in pgbench["rows"]:
        assert set(row["median_tps"]) == {
            "pglockkit.xact_lock",
            "pglockkit.key hot loop",
            "pglockkit.key hot loop, integer",
            "key formula written out",
            "pg_advisory_xact_lock",
            "SELECT ... FOR UPDATE",
        }
        assert all(_positive(v) for v in row["median_tps"].values())

    rows = {r["system"]: r for r in sections["peers"]["data"]["rows"]}
    names = {"pglockkit", "pglockkit tuned", "pglockkit at least once", "procrastinate", "pgqueuer"}
    names |= {"graphile-worker", "graphile-worker fast", "graphile-worker batched", "pg-boss"}
    assert set(rows) == names
    systems = {s.name: s for s in peers.SYSTEMS}
    for name, row in rows.items():
        why = peers.missing(systems[name])
        if name.startswith("pglockkit") or why is None:
            assert row["status"] == "measured", name
            assert all(_positive(v) for v in row["jobs_s"] + row["steady_jobs_s"]), name
        else:
            expected = peers.NPM_NOT_INSTALLED if systems[name].npm else peers.NOT_INSTALLED
            assert why in (expected, peers.NODE_MISSING), name
            assert row["status"] == why, name
            lines = markdown.splitlines()
            assert any(x.startswith(f"| {name} | ") and why in x for x in lines), name
    for row in sections["worker"]["data"]["rows"]:
        for who in ("worker", "bare"):
            measures = ("jobs_s", "commits_per_job", "round_trips_per_job")
            assert all(_positive(row[who][k]) for k in measures), row
    io = {r["case"]: r for r in sections["io"]["data"]["rows"]}
    assert io["pglockkit threads"]["status"] == io["pglockkit asyncio"]["status"] == "measured"
    assert all(_positive(r["of_ideal"]) for r in io.values() if r["status"] == "measured")
    assert elapsed < 120, f"the quick suite took {elapsed:.0f} s (about 25 s on an idle 2-core machine)"


def test_the_pgbench_scripts_lock_the_keys_of_lock_keys(db) -> None:
    """pgbench_compare's named scripts, the formula written out included (on both servers: it
    reads the hash differently before PostgreSQL 18), lock the key that lock_key gives."""
    from bench import pgbench_compare

    ns_id = db.conn.execute("SELECT pglockkit.register_namespace('bench')").fetchone()[0]
    version = int(db.conn.execute("SHOW server_version_num").fetchone()[0])
    written_in = pgbench_compare.script_literals(ns_id, version)
    for script, resource in (
        ("xact_lock.sql", "7"),
        ("key_lock.sql", "7"),
        ("formula_lock.sql", "7"),
        ("key_int_lock.sql", 7),
    ):
        text = (pgbench_compare.SCRIPTS_DIR / script).read_text(encoding="utf-8")
        for name, value in written_in.items():
            text = text.replace(f":{name}", value)
        statement = next(line for line in text.splitlines() if line.startswith("SELECT"))
        statement = statement.replace(":client_id", "%s").rstrip(";")
        expected = db.conn.execute("SELECT pglockkit.lock_key('bench', %s)", (resource,)).fetchone()[0]
        with db.connect() as conn, conn.transaction():
            conn.execute(statement, (resource,))
            held = conn.execute(
                "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks"
                " WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
            ).fetchall()
        assert held == [(expected,)], script


@pytest.mark.parametrize("server", ["pg18"], indirect=True)
def test_the_lease_pgbench_runs_both_shapes_and_counts_every_acquisition(db, tmp_path: Path) -> None:
    """bench.lease_pgbench end to end: every client of both designs runs to the end (pgbench fails
    the run if one aborts: a bare miss returns no row, which \\gset would abort on), and the
    one-name shape counts acquisitions, not attempts: pglockkit's cycles are its release_lease
    calls, fewer than its attempts when 4 clients fight for a name."""
    from bench import lease_pgbench

    out = tmp_path / "lease_pgbench.json"
    argv = ["--dsn", db.dsn, "--seconds", "1", "--runs", "1", "--clients", "1", "--one-name-clients", "4"]
    assert lease_pgbench.main([*argv, "--miss-pause-ms", "0", "--output", str(out)]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert [r["clients"] for r in doc["a_name_each"]] == [1]
    assert _positive(doc["a_name_each"][0]["ratio"])
    (one,) = doc["one_name"]
    for design in ("pglockkit", "bare upsert"):
        ((cycles, attempts),) = one["runs"][design]
        assert _positive(cycles) and cycles <= attempts, design
    assert one["runs"]["pglockkit"][0][0] < one["runs"]["pglockkit"][0][1]
    tokens = db.conn.execute(
        "SELECT token FROM bench_bare_leases WHERE name = %s", (lease_pgbench.ONE_NAME,)
    ).fetchone()[0]
    assert tokens == round(one["runs"]["bare upsert"][0][0])  # one second: cycles/s = acquisitions
