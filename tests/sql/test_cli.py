"""The ``pglockkit`` command, run as a user would run it (a subprocess)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pglockkit import lock_key

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pglockkit.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_every_command():
    out = run("--help")
    assert out.returncode == 0
    for command in (
        "up",
        "down",
        "install",
        "status",
        "uninstall",
        "namespaces",
        "register",
        "key",
    ):
        assert f"    {command}" in out.stdout
    assert "PGLOCKKIT_DSN" in out.stdout


def test_install_status_register_key_namespaces(db):
    assert run("install", "--dsn", db.dsn).stdout.strip() == "pglockkit is up to date (nothing to apply)"
    status = run("status", "--dsn", db.dsn)
    assert "applied  0001_baseline" in status.stdout and "0 pending" in status.stdout
    reg = run(
        "register",
        "billing",
        "--id",
        "42",
        "--description",
        "invoices | refunds",
        "--lock-timeout",
        "2s",
        "--dsn",
        db.dsn,
    )
    assert reg.returncode == 0 and reg.stdout.strip() == "42"
    key = run("key", "billing", "invoice:7", "--dsn", db.dsn)
    assert int(key.stdout) == lock_key(42, "invoice:7")
    assert int(run("key", "billing", "7", "--int", "--dsn", db.dsn).stdout) == lock_key(42, 7)
    md = run("namespaces", "--markdown", "--dsn", db.dsn).stdout
    assert "| 42 | `billing` | 2752512..2818047 | 2s | invoices \\| refunds |" in md
    assert md.splitlines()[0].startswith("| id | namespace |")


def test_dsn_from_environment(db):
    out = run("key", "pglockkit", "x", env={"PGLOCKKIT_DSN": db.dsn})
    assert out.returncode == 0 and int(out.stdout) > 0


@pytest.mark.parametrize(
    ("args", "sqlstate", "text"),
    [
        (("key", "nope", "x"), "42704", 'unknown lock namespace "nope"'),
        (("register", "Bad Name"), "22023", "invalid namespace name"),
        (("register", "ok", "--id", "40000"), "22003", "out of range"),
        (("key", "pglockkit", "-1", "--int"), "22003", "out of range"),
    ],
)
def test_errors_exit_1_with_sqlstate_and_hint(db, args, sqlstate, text):
    out = run(*args, "--dsn", db.dsn)
    assert out.returncode == 1
    assert f"[{sqlstate}]" in out.stderr and text in out.stderr
    assert "Traceback" not in out.stderr


def test_uninstall_needs_confirmation(db):
    out = run("uninstall", "--dsn", db.dsn)
    assert out.returncode == 2 and "--yes" in out.stderr
    assert "0 pending" in run("status", "--dsn", db.dsn).stdout


def test_bad_duration_is_a_usage_error(db):
    out = run("register", "x", "--lock-timeout", "soon", "--dsn", db.dsn)
    assert out.returncode == 2 and "not a duration" in out.stderr


def test_bundle_tool_writes_and_checks(tmp_path):
    """tools/bundle.py (a developer tool, not in the package) writes and checks the bundle."""
    tool = [sys.executable, str(ROOT / "tools" / "bundle.py")]
    target = tmp_path / "bundle.sql"

    def bundle(*args: str) -> int:
        return subprocess.run([*tool, *args, "--output", str(target)], capture_output=True).returncode

    assert bundle("--check") == 1
    assert bundle() == 0
    assert bundle("--check") == 0
    assert "BEGIN;" in target.read_text()


def test_uninstall_refuses_while_a_user_view_depends_on_the_kit_then_cascade_drops_it(db):
    db.conn.execute("CREATE VIEW public.my_stats AS SELECT * FROM pglockkit.queue_stats")
    refused = run("uninstall", "--yes", "--dsn", db.dsn)
    assert refused.returncode == 1, refused.stderr
    assert "[2BP01]" in refused.stderr and "nothing was changed" in refused.stderr
    assert "view public.my_stats (uses view pglockkit.queue_stats)" in refused.stderr
    assert "--cascade" in refused.stderr and "Traceback" not in refused.stderr
    assert "0 pending" in run("status", "--dsn", db.dsn).stdout
    done = run("uninstall", "--yes", "--cascade", "--dsn", db.dsn)
    assert done.returncode == 0, done.stderr
    assert "no pglockkit objects remain" in done.stdout
    assert "  view public.my_stats (uses view pglockkit.queue_stats)" in done.stdout
    assert db.conn.execute("SELECT to_regnamespace('pglockkit')").fetchone()[0] is None


@pytest.mark.parametrize("server", ["pg18"], indirect=True)
def test_pause_resume_and_rate_limit_commands_and_what_top_and_doctor_show(db):
    """One server: the commands are Python calls the SQL tests cover on both."""
    enq = run("enqueue", "mail", '{"to": "ana"}', "--rate-key", "smtp", "--dsn", db.dsn)
    assert enq.returncode == 0, enq.stderr
    assert run("pause", "mail", "--dsn", db.dsn).stdout.strip() == "queue mail: paused"
    assert run("pause", "mail", "--dsn", db.dsn).stdout.strip() == "queue mail: already paused"
    assert db.conn.execute("SELECT count(*) FROM pglockkit.claim_job('mail', 'w')").fetchone()[0] == 0
    assert "PAUSED" in next(
        line for line in run("top", "--once", "--dsn", db.dsn).stdout.splitlines() if "mail" in line
    )
    doctor = run("doctor", "--fail-on", "error", "--dsn", db.dsn).stdout
    assert "queue mail is paused: none of its 1 ready job(s) is claimed" in doctor
    assert "pglockkit resume mail" in doctor
    assert run("resume", "mail", "--dsn", db.dsn).stdout.strip() == "queue mail: resumed"
    assert run("resume", "mail", "--dsn", db.dsn).stdout.strip() == "queue mail: was not paused"
    out = run("rate-limit", "set", "mail", "smtp", "10", "--per", "1m", "--burst", "3", "--dsn", db.dsn)
    assert out.stdout.strip() == "queue mail, key smtp: at most 10 per 1.0m, burst 3", out.stderr
    listed = run("rate-limit", "list", "--dsn", db.dsn).stdout.splitlines()
    assert listed[0].split()[:5] == ["queue", "key", "rate", "per", "burst"]
    assert listed[1].split()[:5] == ["mail", "smtp", "10", "1.0m", "3"]
    bad = run("rate-limit", "set", "mail", "smtp", "10", "--burst", "0", "--dsn", db.dsn)
    assert bad.returncode == 2 and "--burst" in bad.stderr  # argparse: a positive integer
    assert run("rate-limit", "set", "mail", "--dsn", db.dsn).returncode == 2
    out = run("rate-limit", "remove", "mail", "smtp", "--dsn", db.dsn)
    assert out.stdout.strip() == "queue mail, key smtp: limit removed"
    assert run("rate-limit", "list", "mail", "--dsn", db.dsn).stdout.count("\n") == 1  # the header


def test_what_follows_a_double_dash_is_not_dropped_by_commands_other_than_once(db):
    """main() cuts argv at the first `--` for `once`'s command, for every command: `pglockkit
    enqueue q -- '{"a": 1}'` (the POSIX way to pass an operand) enqueued a job with payload {} and
    exit status 0. docs/cli.md: for the other commands `--` ends the options, so the payload is the
    job's; what follows `--` is an operand even when it looks like an option."""
    out = run("enqueue", "ddq", "--dsn", db.dsn, "--", '{"a": 1}')
    assert out.returncode == 0, out.stderr
    payloads = [r[0] for r in db.conn.execute("SELECT payload FROM pglockkit.jobs WHERE queue = 'ddq'")]
    assert payloads == [{"a": 1}], f"the payload after -- was dropped: {payloads}"
    out = run("rate-limit", "set", "ddq", "--dsn", db.dsn, "--", "--burst", "7")
    assert out.returncode == 0, out.stderr
    assert db.conn.execute(
        "SELECT rate, burst FROM pglockkit.rate_limits WHERE queue = 'ddq' AND key = '--burst'"
    ).fetchone() == (7, 1)


def test_leases_shows_how_long_ago_an_expired_lease_expired(db):
    """`pglockkit leases` printed expires_in with Python's str(timedelta): a lease that expired
    half a second ago showed as `-1 day, 23:59:59.500000`, which reads as a day left. It should
    print a negative age, as `top` and the other columns do (pglockkit._format.age: '-0.5s')."""
    db.conn.execute("SELECT pglockkit.acquire_lease('gone-by', 'pod-a', '50 ms')")
    db.conn.execute("SELECT pglockkit.acquire_lease('still-held', 'pod-b', '1 hour')")
    time.sleep(0.3)
    out = run("leases", "--dsn", db.dsn)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("gone-by"))
    assert "day" not in row, row
    assert re.search(r"\s-\d+\.\ds\s", row), row  # expired: a negative time left, '-0.3s'
    row = next(line for line in out.stdout.splitlines() if line.startswith("still-held"))
    assert re.search(r"\s(59\.\d|60\.0)m\s", row), row  # an hour left: '60.0m'


def test_an_optional_operand_after_an_option_is_taken_not_refused(db):
    """docs/cli.md: `pglockkit enqueue QUEUE [JSON] [--priority N] ...`, `rate-limit set QUEUE KEY
    RATE [--per 1s]`; options may come anywhere, as with every other command (`key NS --dsn D RES`
    works). But the operands declared nargs='?' (enqueue's JSON, rate-limit's QUEUE KEY RATE) are
    filled (or left empty) at the first run of operands, so an option between two operands made
    argparse refuse the rest: `pglockkit enqueue q --priority 3 '{"a": 1}'` exited 2 with
    "unrecognized arguments: {"a": 1}", which does not say what is wrong."""
    out = run("enqueue", "mixq", "--priority", "3", '{"a": 1}', "--dsn", db.dsn)
    assert out.returncode == 0, out.stderr
    row = db.conn.execute("SELECT payload, priority FROM pglockkit.jobs WHERE queue = 'mixq'").fetchone()
    assert row == ({"a": 1}, 3)
    out = run("rate-limit", "set", "mixq", "--dsn", db.dsn, "smtp", "10", "--per", "1m")
    assert out.returncode == 0, out.stderr
    assert db.conn.execute(
        "SELECT rate FROM pglockkit.rate_limits WHERE queue = 'mixq' AND key = 'smtp'"
    ).fetchone() == (10,)


def test_uninstall_where_pglockkit_is_not_installed_says_there_was_nothing_to_drop(empty_db):
    """It printed "dropped schemas pglockkit and pglockkit_migrations (0 migration(s) applied)",
    on a database that never had them."""
    out = run("uninstall", "--yes", "--dsn", empty_db)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "nothing to drop: pglockkit is not installed in this database"
    assert run("install", "--dsn", empty_db).returncode == 0
    out = run("uninstall", "--yes", "--dsn", empty_db)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("dropped schemas pglockkit and pglockkit_migrations ("), out.stdout


def test_sample_fails_on_a_statement_timeout_instead_of_calling_it_a_lost_connection(db):
    """`sample` and `top` go on after a lost connection (psycopg.OperationalError). That class is
    wider than a lost connection: a statement_timeout (57014, QueryCanceled) is one too, and so are
    an admin's pg_cancel_backend, disk full and out of memory (class 53). `sample --count 1` (a cron
    job's sample) whose statement times out printed "connection lost (canceling statement due to
    statement timeout); retrying" forever and never exited; it exited 1 with the error before."""
    import psycopg

    with psycopg.connect(db.dsn, autocommit=True) as blocker:
        with blocker.transaction():
            blocker.execute("LOCK TABLE pglockkit.queue_samples IN ACCESS EXCLUSIVE MODE")
            env = {**os.environ, "PGOPTIONS": "-c statement_timeout=300"}
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pglockkit.cli",
                    "sample",
                    "--count",
                    "1",
                    "--every",
                    "0.2s",
                    "--dsn",
                    db.dsn,
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                _, err = proc.communicate(timeout=8)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                pytest.fail(f"sample --count 1 still running after 8 s: {err.splitlines()[:2]}")
    assert proc.returncode == 1 and "57014" in err, (proc.returncode, err)
    assert "connection lost" not in err, err
