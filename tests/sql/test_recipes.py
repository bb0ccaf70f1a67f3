"""The two recipes of docs/recipes.md, against real servers with real threads.

- The bounded critical section (examples/bounded_critical_section.py): agents computing slowly
  run in parallel because no lock is held while they compute; the lock is held for milliseconds;
  no update is lost; a writer whose version moved does not overwrite; the lock wait is bounded.
- The two-phase reservation (examples/two_phase_reservation.py): of 8 agents reserving one
  natural key at once exactly one holds it; two sessions confirming at once confirm exactly once;
  an expired hold is taken over (by exactly one) and its late confirm refused; a confirm that
  checked in time wins over a takeover racing it; different keys never wait for each other.

Then both example programs, and both plain-SQL versions through psql, run to completion.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pglockkit

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def section():
    return _load("bounded_critical_section")


@pytest.fixture(scope="module")
def reservation():
    return _load("two_phase_reservation")


def _together(db, calls: list[Callable[[psycopg.Connection], Any]]) -> list[Any]:
    """Each call on its own connection and thread, released together by a barrier."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with db.connect() as conn:
                barrier.wait(timeout=30)
                results[i] = calls[i](conn)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def _in_background(db, call: Callable[[psycopg.Connection], Any]) -> tuple[threading.Thread, dict]:
    """Run ``call`` on its own connection in a thread; ``out`` gets its result or error."""
    out: dict = {}
    conn = db.connect()

    def run() -> None:
        try:
            out["result"] = call(conn)
        except BaseException as exc:
            out["error"] = exc
        finally:
            conn.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _key_locks(conn: psycopg.Connection, ns: str, resource: str) -> int:
    """Granted advisory locks on ``ns``/``resource``, whoever holds them."""
    return conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND (classid::bigint << 32 | objid::bigint) = pglockkit.lock_key(%s, %s)",
        (ns, resource),
    ).fetchone()[0]


# --- the bounded critical section ---------------------------------------------------------------

COMPUTE_S = 1.0


def test_slow_computations_run_in_parallel_and_the_lock_is_held_for_milliseconds(db, section):
    section.setup(db.dsn)
    n = 6
    seen: list[tuple[float, float, int, object]] = []

    def agent(conn: psycopg.Connection, who: str):
        def compute(body):
            start = time.monotonic()
            # While computing: no transaction open on this connection, nobody holds the lock.
            locks = _key_locks(conn, section.NAMESPACE, "daily-totals")
            time.sleep(COMPUTE_S)
            seen.append((start, time.monotonic(), locks, conn.info.transaction_status))
            return {"total": 1234, "by": who}

        return section.bounded_update(conn, "daily-totals", compute, writer=who, tries=1)

    started = time.monotonic()
    outcomes = _together(db, [lambda c, who=f"agent-{i}": agent(c, who) for i in range(n)])
    wall = time.monotonic() - started

    assert all(locks == 0 for _, _, locks, _ in seen), seen
    assert all(status == psycopg.pq.TransactionStatus.IDLE for *_, status in seen), seen
    # All computations overlapped: every one started before the first one ended.
    assert max(s for s, *_ in seen) < min(e for _, e, *_ in seen), seen
    assert wall < 2.5 * COMPUTE_S, f"{n} computations of {COMPUTE_S} s took {wall:.2f} s"
    holds = [h for o in outcomes for h in o.hold_s]
    assert len(holds) == n and max(holds) < COMPUTE_S / 4, holds
    # One result was written; the others, computed from version 0 too, found version 1 and gave up.
    written = [o for o in outcomes if o.written]
    assert len(written) == 1 and written[0].version == 1
    assert sorted(o.version for o in outcomes) == [1] * n
    row = db.conn.execute("SELECT version, body ->> 'by', updated_by FROM recipe_reports").fetchall()
    assert row == [(1, written[0].writer, written[0].writer)]
    assert db.conn.execute("SELECT count(*) FROM recipe_report_log").fetchone()[0] == 1


@pytest.mark.slow
def test_holding_the_lock_across_the_computation_serialises_the_agents(db, section):
    """The control for the test above: the same agents with the lock taken before computing run
    one at a time, so its wall-time and hold-time assertions tell the two apart."""
    section.setup(db.dsn)
    n, compute_s = 3, 0.4
    holds: list[float] = []

    def agent(conn: psycopg.Connection, who: str) -> None:
        with conn.transaction():
            pglockkit.xact_lock(conn, section.NAMESPACE, "daily-totals", timeout=10)
            locked = time.monotonic()
            time.sleep(compute_s)
            conn.execute(
                "INSERT INTO recipe_reports VALUES ('daily-totals', 1, '{}', %s, now())"
                " ON CONFLICT (name) DO UPDATE SET version = recipe_reports.version + 1",
                (who,),
            )
        holds.append(time.monotonic() - locked)

    started = time.monotonic()
    _together(db, [lambda c, who=f"agent-{i}": agent(c, who) for i in range(n)])
    wall = time.monotonic() - started
    assert wall >= n * compute_s
    assert min(holds) >= compute_s


def test_no_update_is_lost_when_every_agent_recomputes_on_conflict(db, section):
    section.setup(db.dsn)
    n = 8

    def agent(conn: psycopg.Connection, who: str):
        def compute(body):
            time.sleep(0.05)
            return {"items": [*(body or {}).get("items", []), who]}

        # race_window: the writer sleeps between its re-check and its write, with the lock held.
        # Without the lock, every agent waiting there would write over the others.
        return section.bounded_update(conn, "team", compute, writer=who, tries=n, race_window=0.02)

    names = [f"agent-{i}" for i in range(n)]
    outcomes = _together(db, [lambda c, who=who: agent(c, who) for who in names])

    assert all(o.written for o in outcomes), outcomes
    assert sorted(o.version for o in outcomes) == list(range(1, n + 1))
    assert sum(o.tries for o in outcomes) > n  # there were conflicts, and they were recomputed
    version, items = db.conn.execute("SELECT version, body -> 'items' FROM recipe_reports").fetchone()
    assert version == n and sorted(items) == sorted(names)
    log = db.conn.execute("SELECT version, based_on FROM recipe_report_log ORDER BY version").fetchall()
    assert log == [(v, v - 1) for v in range(1, n + 1)]  # each write built on the one before it


def test_a_writer_whose_version_moved_does_not_overwrite_and_recomputes(db, section):
    section.setup(db.dsn)
    with db.connect() as a, db.connect() as b:

        def a_computes(body):
            # While A computes, B reads, computes and writes a whole update.
            b_out = section.bounded_update(b, "r", lambda body: {"by": "B"}, writer="B")
            assert b_out.written and b_out.version == 1
            return {"by": "A"}

        out = section.bounded_update(a, "r", a_computes, writer="A", tries=1)
        assert not out.written and out.version == 1
        assert db.conn.execute("SELECT version, body ->> 'by' FROM recipe_reports").fetchone() == (1, "B")

        # Allowed a second try, A recomputes from B's body and writes version 2 on top of it.
        calls = []

        def a_again(body):
            calls.append(body)
            if len(calls) == 1:
                section.bounded_update(b, "r", lambda body: {"by": "B2"}, writer="B")
            return {"by": "A", "after": body["by"]}

        out = section.bounded_update(a, "r", a_again, writer="A", tries=2)
        assert out.written and out.version == 3 and out.tries == 2
        assert calls == [{"by": "B"}, {"by": "B2"}]
        assert db.conn.execute("SELECT version, body FROM recipe_reports").fetchone() == (
            3,
            {"by": "A", "after": "B2"},
        )


def test_the_wait_for_the_lock_is_bounded_by_its_timeout(db, section):
    section.setup(db.dsn)
    with db.connect() as holder, db.connect() as conn:
        with holder.transaction():
            pglockkit.xact_lock(holder, section.NAMESPACE, "r")
            started = time.monotonic()
            with pytest.raises(pglockkit.LockTimeout) as err:
                section.bounded_update(conn, "r", lambda body: {"x": 1}, writer="late", timeout=0.2)
            waited = time.monotonic() - started
        assert 0.2 <= waited < 2.0
        assert err.value.sqlstate == "55P03"
        assert err.value.__cause__.diag.message_detail == f"Held by pid {holder.info.backend_pid}."
    assert db.conn.execute("SELECT count(*) FROM recipe_reports").fetchone()[0] == 0


# --- the two-phase reservation ------------------------------------------------------------------

SLOT = "slot:2026-03-06T10:00/room-3"


def _live(db, key: str) -> list[tuple]:
    return db.conn.execute(
        "SELECT holder, status FROM recipe_reservations WHERE natural_key = %s"
        " AND status IN ('held', 'confirmed')",
        (key,),
    ).fetchall()


@pytest.mark.parametrize("backstop", [False, True], ids=["lock-alone", "with-unique-backstop"])
def test_eight_agents_reserving_one_key_exactly_one_holds_it(db, reservation, backstop):
    # Without the backstop index the lock alone keeps the key single; with it, the lock is what
    # turns the losers' unique_violation into a clean "taken".
    reservation.setup(db.dsn, backstop=backstop)
    names = [f"agent-{i}" for i in range(8)]
    holds = _together(
        db, [lambda c, who=who: reservation.reserve(c, SLOT, who, race_window=0.05) for who in names]
    )
    winners = [h for h in holds if h.mine]
    assert len(winners) == 1, holds
    winner = winners[0]
    assert all(h.id == winner.id and h.holder == winner.holder for h in holds), holds
    assert _live(db, SLOT) == [(winner.holder, "held")]
    assert db.conn.execute("SELECT count(*) FROM recipe_reservations").fetchone()[0] == 1


def test_two_sessions_confirming_at_once_confirm_exactly_once(db, reservation):
    reservation.setup(db.dsn, backstop=False)
    with db.connect() as conn:
        hold = reservation.reserve(conn, SLOT, "agent-1")
    # race_window: each confirm sleeps between its check and its writes, with the row locked.
    outcomes = _together(
        db, [lambda c: reservation.confirm(c, hold.id, "agent-1", race_window=0.1) for _ in range(2)]
    )
    assert sorted(outcomes) == ["already confirmed", "confirmed"]
    assert _live(db, SLOT) == [("agent-1", "confirmed")]
    messages = db.conn.execute("SELECT reservation_id FROM recipe_outbox").fetchall()
    assert messages == [(hold.id,)]


def test_an_expired_hold_is_taken_over_by_one_agent_and_its_late_confirm_is_refused(db, reservation):
    reservation.setup(db.dsn, backstop=False)
    with db.connect() as conn:
        first = reservation.reserve(conn, SLOT, "agent-0", ttl=0.3)
        assert first.mine
        early = reservation.reserve(conn, SLOT, "agent-1")
        assert not early.mine and early.holder == "agent-0"
    time.sleep(0.4)
    names = [f"agent-{i}" for i in range(1, 5)]
    holds = _together(
        db, [lambda c, who=who: reservation.reserve(c, SLOT, who, race_window=0.05) for who in names]
    )
    winners = [h for h in holds if h.mine]
    assert len(winners) == 1, holds
    winner = winners[0]
    with db.connect() as conn:
        assert reservation.confirm(conn, first.id, "agent-0") == "expired"
        assert reservation.confirm(conn, winner.id, "agent-0") == "not yours"
        assert reservation.confirm(conn, winner.id, winner.holder) == "confirmed"
        assert reservation.confirm(conn, 10**9, winner.holder) == "unknown"
    rows = db.conn.execute("SELECT holder, status FROM recipe_reservations ORDER BY id").fetchall()
    assert rows == [("agent-0", "expired"), (winner.holder, "confirmed")]


def test_a_confirm_after_the_ttl_is_refused_even_if_nobody_took_the_key(db, reservation):
    """A hold whose ttl ran out but which nobody took over: its confirm is refused and marks it."""
    reservation.setup(db.dsn, backstop=False)
    with db.connect() as conn:
        hold = reservation.reserve(conn, SLOT, "agent-0", ttl=0.1)
        time.sleep(0.2)
        assert reservation.confirm(conn, hold.id, "agent-0") == "expired"
    assert _live(db, SLOT) == []


def _row_locked(conn: psycopg.Connection, row_id: int) -> bool:
    """Whether another transaction holds row ``row_id`` of recipe_reservations locked. The row
    locks are not listed in pg_locks, and the table's RowShareLock is granted before the row is
    locked: under load a check of that lock let the test race the confirm to its row. So: try to
    share-lock the row without waiting (FOR KEY SHARE conflicts with lock_rows' FOR UPDATE), and
    let go at once. ``conn`` must be in autocommit, so that the probe's transaction ends."""
    assert conn.autocommit
    with conn.transaction():
        got = conn.execute(
            "SELECT id FROM recipe_reservations WHERE id = %s FOR KEY SHARE SKIP LOCKED", (row_id,)
        ).fetchone()
    return got is None


@pytest.mark.slow
def test_a_confirm_that_checked_in_time_wins_over_a_takeover_racing_it(db, reservation):
    reservation.setup(db.dsn, backstop=False)
    with db.connect() as conn:
        hold = reservation.reserve(conn, SLOT, "agent-0", ttl=1.0)
        reserved_at = time.monotonic()
        # agent-0 confirms at once: it checks (the hold is live) and keeps the row locked for 2 s.
        confirming, out = _in_background(
            db, lambda c: reservation.confirm(c, hold.id, "agent-0", race_window=2.0)
        )
        _wait_for(lambda: _row_locked(conn, hold.id), "agent-0's confirm to lock the row")
        time.sleep(max(0.0, reserved_at + 1.3 - time.monotonic()))
        assert "result" not in out  # the hold has expired, agent-0's confirm has not written yet
        started = time.monotonic()
        other = reservation.reserve(conn, SLOT, "agent-1", timeout=5)
        waited = time.monotonic() - started
    confirming.join(timeout=10)
    assert out.get("result") == "confirmed", out
    # agent-1's retirement of the expired hold waited for the row, then found it confirmed.
    assert waited > 0.3, waited
    assert not other.mine and other.holder == "agent-0" and other.status == "confirmed"
    assert _live(db, SLOT) == [("agent-0", "confirmed")]


@pytest.mark.slow
def test_different_keys_never_wait_for_each_other(db, reservation):
    reservation.setup(db.dsn, backstop=False)
    # agent-0 holds the lock of SLOT (it sleeps between its check and its insert).
    holding, out = _in_background(db, lambda c: reservation.reserve(c, SLOT, "agent-0", race_window=2.5))
    _wait_for(lambda: _key_locks(db.conn, reservation.NAMESPACE, SLOT) == 1, "agent-0 to lock its key")
    with db.connect() as conn, pytest.raises(pglockkit.LockTimeout):  # the key's lock is held...
        reservation.reserve(conn, SLOT, "agent-9", timeout=0.2)

    def timed(conn: psycopg.Connection, who: str, key: str):
        started = time.monotonic()
        hold = reservation.reserve(conn, key, who, timeout=0.3)
        return hold, time.monotonic() - started

    # ... and 8 agents reserving 8 other keys at once wait neither for it nor for each other.
    keys = [f"slot:2026-03-07T{9 + i:02d}:00/room-3" for i in range(8)]
    results = _together(
        db, [lambda c, i=i, key=key: timed(c, f"agent-{i + 1}", key) for i, key in enumerate(keys)]
    )
    assert "result" not in out  # agent-0 held its key all along
    assert all(hold.mine for hold, _ in results), results
    assert max(took for _, took in results) < 0.3
    holding.join(timeout=10)
    assert out["result"].mine

    # Row locks on confirm: a confirm holding one reservation's row holds up no other confirm.
    first = results[0][0]
    with db.connect() as conn:
        confirming, out = _in_background(
            db, lambda c: reservation.confirm(c, first.id, first.holder, race_window=2.0)
        )
        _wait_for(lambda: _row_locked(conn, first.id), "the first confirm to lock its row")
        with pytest.raises(pglockkit.LockTimeout):  # that row is locked...
            reservation.confirm(conn, first.id, first.holder, timeout=0.2)
        started = time.monotonic()
        for hold, _ in results[1:]:  # ... the others are not
            assert reservation.confirm(conn, hold.id, hold.holder, timeout=0.2) == "confirmed"
        assert time.monotonic() - started < 1.0
        assert "result" not in out
    confirming.join(timeout=10)
    assert out["result"] == "confirmed"


# --- the example programs and the plain-SQL versions --------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "bounded_critical_section",
            [
                r"   agent-\d: wrote version 1 after 1 computation\(s\) of [\d.]+ s; lock held .* at most",
                r"   wall time [\d.]+ s for 4 computations of 0\.5 s: they ran in parallel .*",
                r"   team-list is at version 4 with 4 names: no update was lost",
            ],
        ),
        (
            "two_phase_reservation",
            [
                r"   agent-\d: holds slot:2026-03-06T10:00/room-3 \(reservation \d+\)",
                r"   outcomes: already confirmed and confirmed; confirmation messages queued: 1",
                r"   agent-1 confirms late: expired; agent-2 confirms: confirmed",
                r"   8 of 8 hold their slot; .*",
            ],
        ),
    ],
)
def test_example_program_runs(db, name, expected):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{name}.py"), db.dsn],
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this tree's pglockkit
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "OK", proc.stdout
    for pattern in expected:
        assert any(re.fullmatch(pattern, line) for line in lines), f"{pattern!r} not in:\n{proc.stdout}"


def _psql(bindir: Path) -> str:
    own = bindir / "psql"
    if own.exists():
        return str(own)
    found = shutil.which("psql")
    if found is None:
        pytest.fail(f"no psql in {bindir} nor on PATH: install postgresql-client")
    return found


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (
            "bounded_critical_section",
            [
                "B: wrote version 1",
                "A: the version changed while computing: recompute from the new body, or give up",
                r" sql-demo \|\s+1 \| B",
            ],
        ),
        (
            "two_phase_reservation",
            [
                "A holds sql-demo:slot:2026-03-06T10:00/room-3",
                "B finds sql-demo:slot:2026-03-06T10:00/room-3 taken by A",
                r"A confirms reservation \d+: confirmed",
                r"A confirms reservation \d+: already confirmed",
                r"\s+1",  # one confirmation message
                "C holds sql-demo:slot:2026-03-06T11:00/room-3",
                "D holds sql-demo:slot:2026-03-06T11:00/room-3",
                r"C confirms reservation \d+: expired",
                r" sql-demo:slot:2026-03-06T10:00/room-3 \| A\s+\| confirmed",
                r" sql-demo:slot:2026-03-06T11:00/room-3 \| C\s+\| expired",
                r" sql-demo:slot:2026-03-06T11:00/room-3 \| D\s+\| held",
            ],
        ),
    ],
)
def test_plain_sql_version_runs_in_psql(db, script, expected):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PSQL"))}
    env.update(LC_ALL="C", PGCLIENTENCODING="UTF8")
    command = [_psql(db.server.bindir), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", db.dsn]
    for _ in range(2):  # a second run in the same database works too
        proc = subprocess.run(
            [*command, "-f", f"sql/examples/{script}.sql"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stdout
        lines = proc.stdout.splitlines()
        for pattern in expected:
            assert any(re.fullmatch(pattern, line) for line in lines), f"{pattern!r} not in:\n{proc.stdout}"


# --- the page ---------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", heading.strip().lower()).replace(" ", "-")


def test_the_recipes_page_names_only_files_tests_and_anchors_that_exist():
    page = (ROOT / "docs" / "recipes.md").read_text()
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", page, flags=re.MULTILINE)}
    for target in re.findall(r"\]\(([^)]+)\)", page):
        if target.startswith("#"):
            assert target[1:] in anchors, target
        else:
            assert (ROOT / "docs" / target).exists(), target
    paths = set(re.findall(r"`((?:examples|sql/examples|tests)/[\w./-]+)`", page))
    assert paths and all((ROOT / p).exists() for p in paths), sorted(
        p for p in paths if not (ROOT / p).exists()
    )
    for include in re.findall(r"`(two_phase_reservation\.\w+\.sql)`", page):
        assert (ROOT / "sql" / "examples" / include).exists(), include
    defined = set(re.findall(r"^def (test_\w+)", Path(__file__).read_text(), flags=re.MULTILINE))
    named = set(re.findall(r"`(test_\w+)`", page))
    assert named and named <= defined, sorted(named - defined)
    assert "[docs/recipes.md](docs/recipes.md)" in (ROOT / "README.md").read_text()
