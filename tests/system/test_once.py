"""``pglockkit once`` as a process supervisor, like flock(1): the slot stays taken until the command
has exited, whatever signal reaches the wrapper, and the wrapper exits as a shell would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The command under test: appends "started" to a marker file, then, on each SIGNAL, "signal N";
# after the first one it lingers (a graceful shutdown), appends "exiting" and exits with CODE.
TRAPPING = r"""
import os, signal, sys, time
marker, trapped, linger, code = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
got = []
def note(text):
    with open(marker, "a") as f:
        f.write(text + "\n")
def on_signal(signum, frame):
    got.append(signum)
    note(f"signal {signum}")
signal.signal(trapped, on_signal)
note(f"started {os.getpid()}")
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
release, end = marker + ".release", time.monotonic() + linger  # the test may cut the linger short
while time.monotonic() < end and not os.path.exists(release):
    time.sleep(0.01)
note("exiting")
sys.exit(code)
"""


def _once(dsn: str, *args: str) -> subprocess.Popen:
    """The wrapper in a session of its own, without a terminal, as cron or a container runs it."""
    return subprocess.Popen(
        [sys.executable, "-m", "pglockkit.cli", "once", "--dsn", dsn, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _history(conn, job: str) -> list[tuple]:
    return conn.execute(
        "SELECT slot, status, attempt FROM pglockkit.run_history WHERE job = %s ORDER BY id", (job,)
    ).fetchall()


def _detail(conn, job: str) -> str:
    return conn.execute("SELECT detail FROM pglockkit.run_history WHERE job = %s", (job,)).fetchone()[0]


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_to_the_wrapper_reaches_the_command_and_the_slot_stays_taken(db, tmp_path, sig):
    marker, intruder = tmp_path / "marker", tmp_path / "intruder-ran"
    first = _once(
        db.dsn,
        "nightly",
        "--slot",
        "s",
        "--",
        sys.executable,
        "-c",
        TRAPPING,
        str(marker),
        str(int(sig)),
        "30",  # seconds the command lingers after the signal, at most: until the release below
        "0",
    )
    try:
        _wait_for(lambda: "started" in _read(marker), "the command to start")
        first.send_signal(sig)  # to the wrapper alone, as a deploy or `kill` sends it
        _wait_for(lambda: f"signal {int(sig)}" in _read(marker), "the command to receive the signal")
        # The command is still shutting down: another pod must find the slot taken.
        second = _once(db.dsn, "nightly", "--slot", "s", "--", "touch", str(intruder))
        _, err = second.communicate(timeout=60)
        assert "exiting" not in _read(marker), "the command ended before the second pod tried"
        assert first.poll() is None, "the wrapper exited while its command runs"
        assert second.returncode == 0 and "skipped" in err
        assert not intruder.exists()
        Path(f"{marker}.release").touch()  # the command may end now
        _, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    assert _read(marker).count("signal") == 1  # forwarded once
    assert _history(db.conn, "nightly") == [("s", "succeeded", 1)]
    assert sig.name in _detail(db.conn, "nightly")


@pytest.mark.parametrize(
    ("code", "expected", "detail"),
    [
        ("raise SystemExit(3)", 3, "exit status 3"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 137, "killed by SIGKILL"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", 143, "killed by SIGTERM"),
    ],
    ids=["exit-3", "sigkill", "sigterm"],
)
def test_exit_status_is_the_commands_as_a_shell_reports_it(db, code, expected, detail):
    proc = _once(db.dsn, "job", "--slot", "s", "--", sys.executable, "-c", code)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == expected, err
    assert _history(db.conn, "job") == [("s", "failed", 1)]
    assert detail in _detail(db.conn, "job")


def test_sigterm_ends_a_command_that_does_not_trap_it_and_exits_143(db, tmp_path):
    marker = tmp_path / "marker"
    script = f"open({str(marker)!r}, 'w').write('started'); import time; time.sleep(60)"
    proc = _once(db.dsn, "job", "--slot", "s", "--", sys.executable, "-c", script)
    try:
        _wait_for(lambda: _history(db.conn, "job") == [("s", "running", 1)] and marker.exists(), "the run")
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert time.monotonic() - started < 10
    assert _history(db.conn, "job") == [("s", "failed", 1)]
    assert "killed by SIGTERM" in _detail(db.conn, "job")


@pytest.mark.parametrize(
    ("args", "text"), [(("nightly", "--slot", ""), "--slot"), (("",), "JOB")], ids=["slot", "job"]
)
def test_an_empty_slot_or_job_is_a_usage_error(db, tmp_path, args, text):
    ran = tmp_path / "ran"
    proc = _once(db.dsn, *args, "--", "touch", str(ran))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and text in err and "empty" in err, err
    assert not ran.exists()
    assert db.conn.execute("SELECT count(*) FROM pglockkit.runs").fetchone()[0] == 0


def _alive(pid: int) -> bool:
    """Running, not a zombie (a container's PID 1 may never reap an orphan)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_a_sigkilled_wrapper_takes_its_command_with_it_and_the_slot_is_rerun(db, tmp_path):
    marker, rerun = tmp_path / "marker", tmp_path / "rerun"
    proc = _once(
        db.dsn, "nightly", "--slot", "s", "--", sys.executable, "-c", TRAPPING, str(marker), "10", "0", "0"
    )
    child = None
    try:
        _wait_for(lambda: "started" in _read(marker), "the command to start")
        child = int(_read(marker).split()[1])
        proc.kill()  # SIGKILL to the wrapper alone: nothing can be forwarded
        proc.wait()
        _wait_for(lambda: not _alive(child), "the command to die with its wrapper", timeout=10)
    finally:
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
    # The server freed the slot's lock with the wrapper's connection: the next pod re-runs it.
    second = _once(db.dsn, "nightly", "--slot", "s", "--", "touch", str(rerun))
    _, err = second.communicate(timeout=60)
    assert second.returncode == 0 and rerun.exists(), err
    assert _history(db.conn, "nightly") == [("s", "succeeded", 2)]


def test_ctrl_c_in_a_terminal_reaches_the_command_once(db, tmp_path):
    """The terminal sends Ctrl-C's SIGINT to its whole foreground process group, the command
    included: the wrapper must not send it a second one."""
    import pty

    marker = tmp_path / "marker"
    argv = [sys.executable, "-m", "pglockkit.cli", "once", "--dsn", db.dsn, "nightly", "--slot", "s", "--"]
    argv += [sys.executable, "-c", TRAPPING, str(marker), str(int(signal.SIGINT)), "1", "0"]
    pid, master = pty.fork()  # the wrapper leads a session whose controlling terminal is the pty
    if pid == 0:
        try:
            os.execv(argv[0], argv)
        finally:
            os._exit(127)
    try:
        _wait_for(lambda: "started" in _read(marker), "the command to start")
        os.write(master, b"\x03")  # Ctrl-C
        _wait_for(lambda: "exiting" in _read(marker), "the command to finish")
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(master)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _read(marker).count("signal") == 1
    assert _history(db.conn, "nightly") == [("s", "succeeded", 1)]


def test_an_outcome_it_cannot_record_is_an_error_not_a_success(db, tmp_path):
    """finish_run answers false when this session no longer holds the slot (here the run row is
    made another attempt's, as a takeover would leave it): the outcome is not recorded and the slot
    may run again, so once says so and exits 1, not with the command's 0."""
    go = tmp_path / "go"
    proc = _once(
        db.dsn, "unrecorded", "--slot", "s", "--",
        sys.executable, "-c", f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.02)",
    )  # fmt: skip
    _wait_for(lambda: _history(db.conn, "unrecorded") == [("s", "running", 1)], "the run to start")
    db.conn.execute("UPDATE pglockkit.runs SET holder_pid = -1 WHERE job = 'unrecorded'")
    go.touch()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "the outcome (exit status 0) was not recorded" in err
    assert _history(db.conn, "unrecorded")[0][1] != "succeeded"


def test_a_connection_lost_while_the_command_ran_says_the_outcome_was_not_recorded(db, tmp_path):
    """The wrapper's connection ends while the command runs (a server restart; here its backend is
    terminated): the slot is free and the outcome cannot be recorded (docs/runs.md: it exits 1).
    What it printed was the driver's error alone, "terminating connection due to administrator
    command": not that the command had finished, with which status, nor that its outcome was not
    recorded and the slot may run again, as the refused-outcome path says."""
    go = tmp_path / "go"
    proc = _once(
        db.dsn, "lost", "--slot", "s", "--",
        sys.executable, "-c",
        f"import os, sys, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.02)\nsys.exit(3)",
    )  # fmt: skip
    _wait_for(lambda: _history(db.conn, "lost") == [("s", "running", 1)], "the run to start")
    db.conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'pglockkit run lost'"
    )
    go.touch()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "the outcome (exit status 3) was not recorded" in err, err
