"""``pglockkit demo``: a swarm behind one lock, measured live. The global lock must serialize the
swarm, the queue and the sharded keys must not, and contention_report must name the global key."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from test_embedded import run as run_embedded

from pglockkit import cli, demo

# Work dominated by a 20 ms sleep keeps the ratios robust on a loaded 2-core machine.
TINY = ["--agents", "4", "--steps", "1,4", "--seconds", "0.5", "--work-ms", "20"]


def run_demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pglockkit.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_global_lock_serializes_queue_and_sharded_keys_scale(db, tmp_path):
    out = run_demo(
        "--dsn", db.dsn, *TINY, "--json", str(tmp_path / "d.json"), "--plot", str(tmp_path / "d.png")
    )
    assert out.returncode == 0, out.stderr
    # The summary names the three designs, each with jobs/s, parallelism and longest wait.
    for title in demo.TITLES.values():
        assert re.search(
            rf"^\| {re.escape(title)} \| [\d,.]+ \| [\d.]+ \| [\d,]+ ms \| ", out.stdout, re.M
        ), out.stdout
    assert (tmp_path / "d.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    steps = json.loads((tmp_path / "d.json").read_text())["steps"]
    assert [(s["design"], s["agents"]) for s in steps] == [(d, n) for d in demo.DESIGNS for n in (1, 4)]
    at4 = {s["design"]: s for s in steps if s["agents"] == 4}
    assert at4["queue"]["parallelism"] > 1.8, steps
    assert at4["sharded"]["parallelism"] > 1.8, steps
    assert at4["global"]["parallelism"] < 1.5, steps
    for s in steps:
        assert s["jobs"] > 0 and s["rows_written"] >= s["jobs"], s  # every counted unit wrote its row

    # Live advisory_locks: one holder of the global key, the other agents queued behind it.
    live = at4["global"]["live"]
    assert live["resource"] == "demo/global" and live["holding"] == 1 and live["waiting"] >= 2, live
    # contention_report for the step's window named the global key, with waiters, near 1/N.
    report = at4["global"]["report"]
    assert report["keys"] == 1 and report["top_resource"] == "demo/global", report
    assert report["samples_with_waiters"] >= 1 and report["max_waiters"] >= 2, report
    assert report["parallelism"] < 0.6, report
    # The queue takes no advisory lock; the sharded keys spread over tenants and rarely wait.
    assert at4["queue"]["report"]["keys"] == 0
    sharded = at4["sharded"]["report"]
    assert sharded["keys"] > 1 and sharded["parallelism"] > report["parallelism"], sharded
    # Exactly one agent did the shared refresh behind the lease, in every sharded step.
    for s in steps:
        if s["design"] == "sharded":
            assert s["refreshes"] >= 1 and len(s["refreshers"]) == 1, s

    # Cleaned up, so that it runs again on the same database.
    assert db.conn.execute("SELECT to_regnamespace('pglockkit_demo')").fetchone()[0] is None
    assert db.conn.execute("SELECT count(*) FROM pglockkit.jobs WHERE queue LIKE 'demo-%'").fetchone()[0] == 0
    assert not db.conn.execute(
        "SELECT live FROM pglockkit.lease_status WHERE name = %s", (demo.LEASE,)
    ).fetchone()[0]
    # What the README says it leaves, like any other user of the kit: its namespace and samples.
    assert db.conn.execute("SELECT count(*) FROM pglockkit.namespaces WHERE name = 'demo'").fetchone()[0] == 1
    assert db.conn.execute("SELECT count(*) FROM pglockkit.lock_samples").fetchone()[0] > 0
    again = run_demo("--dsn", db.dsn, "--agents", "2", "--steps", "2", "--seconds", "0.2", "--work-ms", "5")
    assert again.returncode == 0, again.stderr
    assert "steps 1,2" in again.stdout  # 1 is always measured: the parallelism's baseline


def test_default_is_the_embedded_server(tmp_path):
    data = tmp_path / "pg"
    try:
        out = run_embedded(
            "demo", "--agents", "2", "--steps", "2", "--seconds", "0.2", "--work-ms", "5", data=data
        )
        assert out.returncode == 0, out.stderr
        assert re.search(r"^Measured .* on PostgreSQL 18\.\d+ \(embedded, `pglockkit up`\)", out.stdout, re.M)
    finally:
        run_embedded("down", data=data)


def test_a_database_without_pglockkit_is_a_clear_error(empty_db):
    out = run_demo("--dsn", empty_db, "--agents", "1", "--seconds", "0.1")
    assert out.returncode == 1
    assert "pglockkit demo: error: pglockkit (with contention_report) is not installed" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "argument --steps: must be at least 1, got '0'"),
        (["--steps", "1,x"], "argument --steps: expected an integer, got 'x'"),
        (["--agents", "-1"], "argument --agents: must be at least 1, got '-1'"),
        (["--seconds", "0"], "argument --seconds: must be a positive number, got '0'"),
        (["--agents", "4", "--steps", "1,8"], "--steps 8 is more than --agents 4"),
    ],
)
def test_bad_input_is_an_argparse_error(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: pglockkit demo" in err and message in err, err


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--plot", str(tmp_path / "x.png")])
    assert exc.value.code == 2
    assert "pip install 'pglockkit[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
