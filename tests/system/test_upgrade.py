"""An upgrade under load: a database installed at the last release, with that release's clients
running on it (workers draining a queue, a lease holder writing behind check_fence, a `pglockkit
once` run, a scheduler ticking), is upgraded by `pglockkit install` from the current tree while
they run. Nothing is lost or done twice, no token repeats, no client fails, and the workers go on
without a restart (docs/install.md, "Upgrades").

The released clients are the release's own code, read from git (the tag v0.1.0, else the commit
below): a clone has it, an export of the tree does not, and then this test fails saying so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import time
from io import BytesIO
from pathlib import Path

import psycopg
import pytest
from scenarios import track

import pglockkit
from pglockkit.install import _backend, _migrations
from pglockkit.releases import RELEASES

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
RELEASE = "0.1.0"
RELEASE_COMMIT = "9e45153d13dc91e8cefa7a5fe05d7f59ecca6d36"  # the commit tagged v0.1.0
JOBS = 300  # before the upgrade, and as many again after it


def _release_package(dest: Path) -> Path:
    """The release's ``pglockkit`` package, extracted from git into ``dest``."""
    for ref in (f"v{RELEASE}", RELEASE_COMMIT):
        found = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--verify", "-q", f"{ref}^{{commit}}"],
            capture_output=True,
            text=True,
        )
        if found.returncode == 0:
            break
    else:
        pytest.fail(
            f"release {RELEASE} is not in this checkout's git history (neither tag v{RELEASE} nor commit "
            f"{RELEASE_COMMIT}): the upgrade test runs that release's clients, so it needs a git clone"
        )
    sha = found.stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", sha, "pglockkit"], capture_output=True, check=True
    )
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def _install_release(dsn: str) -> None:
    """The migrations up to the release's last one: the release's schema, exactly (they are
    append-only since 0.1.0, and the schema-equality test holds the chain to sql/schema/)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA IF NOT EXISTS pglockkit_migrations")
    backend = _backend(dsn)
    try:
        with backend.lock():
            wanted = _migrations().filter(lambda m: m.id <= RELEASES[RELEASE])
            backend.apply_migrations(backend.to_apply(wanted))
    finally:
        backend.connection.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pglockkit._grant_privileges()")


def _released(old: Path, name: str, *args: str) -> subprocess.Popen:
    """A process of the released client: its package first on the path (cwd, for ``-m``); its
    output in files ``name.out`` and ``name.err`` beside the package (a pipe nobody reads while
    it runs would fill and stop it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(old), str(TESTS)])}
    with open(old.parent / f"{name}.out", "w") as out, open(old.parent / f"{name}.err", "w") as err:
        return track(subprocess.Popen([sys.executable, *args], cwd=old, env=env, stdout=out, stderr=err))


def _output(old: Path, name: str, stream: str = "err") -> str:
    return (old.parent / f"{name}.{stream}").read_text()


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


@pytest.mark.parametrize("delta", ["current", "probe"])
def test_an_upgrade_under_load_from_the_last_release_loses_nothing_and_stops_nobody(
    server, tmp_path, request, delta
):
    """``current``: `pglockkit install` of this tree (the real deltas since the release; none
    yet right after it is cut). ``probe``: install with the probe's deltas after them, whose first
    takes the lock an ALTER TABLE of jobs takes, so claims and completions queue behind a
    migration while the workers run."""
    dsn = server.dsn(server.create_database())
    _install_release(dsn)
    old = _release_package(tmp_path / "release")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE done_log (job_id bigint, token bigint, pid integer)")
        conn.execute("CREATE TABLE fenced_writes (id bigserial PRIMARY KEY, token bigint)")
        conn.execute(
            "SELECT pglockkit.enqueue_jobs('w', array_fill('{\"sleep\": 0.01}'::jsonb, ARRAY[%s]))", (JOBS,)
        )
        conn.execute("""SELECT pglockkit.schedule('tick', '* * * * *', 'w', '{"scheduled": true}')""")
        # Due now: the scheduler's first tick enqueues the last minute's slot.
        conn.execute(
            "UPDATE pglockkit.job_schedules SET next_run = date_trunc('minute', now()) - interval '1 minute'"
        )

    cli = ("-m", "pglockkit.cli")
    work = (
        *cli,
        "work",
        "--dsn",
        dsn,
        "--queue",
        "w",
        "--handler",
        "queue_handlers:record",
        "--concurrency",
        "4",
    )
    names = {"worker-0", "worker-1", "scheduler", "holder", "once"}
    workers = [_released(old, f"worker-{i}", *work, "--name", f"old-{i}") for i in range(2)]
    scheduler = _released(old, "scheduler", *cli, "scheduler", "--dsn", dsn, "--every", "200ms")
    holder = _released(old, "holder", str(TESTS / "upgrade_clients.py"), "lease", dsn, "8")
    marker = tmp_path / "once.log"
    # Appends "ran" to the marker, then runs on across the upgrade.
    command = (
        f"import pathlib, time; p = pathlib.Path({str(marker)!r}); "
        "p.write_text((p.read_text() if p.exists() else '') + 'ran\\n'); time.sleep(4)"
    )
    once = _released(
        old,
        "once",
        *cli,
        "once",
        "nightly",
        "--slot",
        "2026-12-07",
        "--dsn",
        dsn,
        "--",
        sys.executable,
        "-c",
        command,
    )

    def done() -> int:
        with psycopg.connect(dsn, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM done_log").fetchone()[0]

    _wait_for(lambda: done() >= JOBS // 3, 60, "the released workers to start draining")
    _wait_for(marker.exists, 30, "the `pglockkit once` command to start")

    # The upgrade, while every client runs.
    if delta == "probe":
        probe = request.getfixturevalue("probe")
        applied = pglockkit.install(dsn, lock_timeout_s=60)
        assert applied[-2:] == probe, applied
    else:
        up = subprocess.run(
            [sys.executable, "-m", "pglockkit.cli", "install", "--dsn", dsn],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert up.returncode == 0, up.stderr
    assert done() < 2 * JOBS + 1, "the upgrade came after the clients had finished: no load"
    assert all(s.applied for s in pglockkit.status(dsn)), "the upgrade left migrations pending"

    # The workers go on, without a restart: a second batch enqueued after the upgrade.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pglockkit.enqueue_jobs('w', array_fill('{}'::jsonb, ARRAY[%s]))", (JOBS,))
        scheduled = "SELECT count(*) FROM pglockkit.jobs WHERE payload->>'scheduled' = 'true'"
        total = lambda: 2 * JOBS + conn.execute(scheduled).fetchone()[0]  # noqa: E731
        _wait_for(lambda: done() >= total() and done() > 2 * JOBS, 90, "the workers to drain both batches")
        assert once.wait(30) == 0, _output(old, "once")
        again = subprocess.run(
            [sys.executable, *cli, "once", "nightly", "--slot", "2026-12-07", "--dsn", dsn, "--", "false"],
            cwd=old,
            env={**os.environ, "PYTHONPATH": str(old)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert again.returncode == 0 and "skipped" in again.stderr, again.stderr
        assert holder.wait(60) == 0, _output(old, "holder")
        running = {"worker-0": workers[0], "worker-1": workers[1], "scheduler": scheduler}
        for name, proc in running.items():
            assert proc.poll() is None, f"{name} stopped by itself: {_output(old, name)}"
            proc.send_signal(signal.SIGTERM)
        for name, proc in running.items():
            assert proc.wait(30) == 0, f"{name}: {_output(old, name)}"

        # Nothing lost, nothing done twice; every claim's token new.
        jobs = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE status = 'done') FROM pglockkit.jobs"
        ).fetchone()
        assert jobs[0] == jobs[1] == total(), f"jobs not done: {jobs}"
        log = conn.execute(
            "SELECT count(*), count(DISTINCT job_id), count(DISTINCT token) FROM done_log"
        ).fetchone()
        assert log == (total(), total(), total()), f"effects (rows, jobs, tokens): {log}"
        slots = conn.execute(
            "SELECT count(*), count(DISTINCT run_at) FROM pglockkit.jobs WHERE payload->>'scheduled' = 'true'"
        ).fetchone()
        assert slots[0] >= 1 and slots[0] == slots[1], f"scheduled jobs and slots: {slots}"
        # The lease's tokens: every write fenced by the live token, tokens never going back, and a
        # new token at every acquisition, across the upgrade.
        writes = [r[0] for r in conn.execute("SELECT token FROM fenced_writes ORDER BY id")]
        assert writes and writes == sorted(writes), "a fenced write carried an older token"
        runs = conn.execute(
            "SELECT count(*) FROM pglockkit.runs WHERE job = 'nightly' AND status = 'succeeded'"
        )
        assert runs.fetchone()[0] == 1
    out = _output(old, "holder", "out")
    assert f"pglockkit {old}" in out, f"the lease holder did not run the released package: {out[:200]}"
    tokens = [int(line.split()[1]) for line in out.splitlines() if line.startswith("acquired ")]
    assert len(tokens) >= 3 and tokens == sorted(set(tokens)), f"lease tokens: {tokens}"
    assert marker.read_text() == "ran\n", "the once command ran more than once"
    for name in names:
        err = _output(old, name)
        assert "Traceback" not in err, f"{name}: {err}"
