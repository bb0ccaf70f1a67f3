"""The two-phase reservation: a lock on the natural key before the insert, a row lock on confirm.

Agents reserve things named by a natural key (a time slot, an email address, an order number):

1. **reserve**: in a short transaction, ``pglockkit.xact_lock(ns, natural_key, timeout)``; then
   retire an expired hold of that key, check whether the key is held or confirmed, and if not
   insert a ``held`` row with an expiry. There is no row to lock before the insert, so the
   advisory lock on the key is what keeps two agents from both finding the key free and both
   inserting.
2. **confirm**: in a short transaction, lock the reservation's row (``pglockkit.lock_rows`` or
   ``SELECT ... FOR UPDATE``), check that it is still this holder's, ``held`` and unexpired, then
   mark it ``confirmed`` and queue its confirmation message. The row lock makes that check and
   those writes happen exactly once when two sessions confirm at the same moment.

An agent that never confirms loses the key when its hold expires: the next reserve retires the
hold and takes the key, and the late confirm is refused.

    python3 examples/two_phase_reservation.py DSN

creates its demo tables if missing (``recipe_reservations``, ``recipe_outbox``), registers the
namespace ``reservations``, runs the demo with threads and prints what happened. The same
statements in plain SQL: ``sql/examples/two_phase_reservation.sql``; the explanation:
``docs/recipes.md``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import psycopg

import pglockkit

NAMESPACE = "reservations"
TABLE = "recipe_reservations"

SETUP = """
CREATE TABLE IF NOT EXISTS recipe_reservations (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    natural_key  text NOT NULL,
    holder       text NOT NULL,
    status       text NOT NULL CHECK (status IN ('held', 'confirmed', 'expired')),
    held_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at   timestamptz NOT NULL,
    confirmed_at timestamptz
);
CREATE INDEX IF NOT EXISTS recipe_reservations_natural_key ON recipe_reservations (natural_key);
CREATE TABLE IF NOT EXISTS recipe_outbox (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    reservation_id bigint NOT NULL REFERENCES recipe_reservations (id),
    message        text NOT NULL
)
"""
# The correctness backstop: at most one live reservation per key, whatever a writer does. The
# lock still matters: losers get a clean "taken" instead of a unique_violation that aborts their
# transaction, and the same lock covers rules no unique index states (capacities, overlapping
# ranges, checks across tables).
BACKSTOP = """
CREATE UNIQUE INDEX IF NOT EXISTS recipe_reservations_one_live
    ON recipe_reservations (natural_key) WHERE status IN ('held', 'confirmed')
"""

# --- phase 1, under the key's advisory lock ---
# An expired hold stays, marked expired, for the record. A confirm that holds the row's lock
# makes this UPDATE wait; if it confirmed, the row no longer matches and is left alone.
RETIRE = """
UPDATE recipe_reservations SET status = 'expired'
 WHERE natural_key = %s AND status = 'held' AND expires_at <= clock_timestamp()
"""
LIVE = """
SELECT id, holder, status FROM recipe_reservations
 WHERE natural_key = %s AND status IN ('held', 'confirmed')
"""
HOLD = """
INSERT INTO recipe_reservations (natural_key, holder, status, expires_at)
VALUES (%s, %s, 'held', clock_timestamp() + %s * interval '1 second')
RETURNING id
"""
# --- phase 2, under the row's lock ---
STATE = "SELECT holder, status, expires_at > clock_timestamp() FROM recipe_reservations WHERE id = %s"
CONFIRM = (
    "UPDATE recipe_reservations SET status = 'confirmed', confirmed_at = clock_timestamp() WHERE id = %s"
)
EXPIRE = "UPDATE recipe_reservations SET status = 'expired' WHERE id = %s"
NOTIFY = "INSERT INTO recipe_outbox (reservation_id, message) VALUES (%s, %s)"


@dataclass
class Hold:
    """The live reservation of a key after ``reserve``: this caller's (``mine``) or another's."""

    id: int
    key: str
    holder: str
    status: str  # 'held' or 'confirmed'
    mine: bool


def setup(dsn: str, backstop: bool = True) -> None:
    """Install pglockkit if missing, create the demo tables (with the unique backstop unless
    ``backstop`` is False), register the namespace (idempotent)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if conn.execute("SELECT to_regnamespace('pglockkit') IS NULL").fetchone()[0]:
            pglockkit.install(dsn)
        conn.execute(SETUP)
        if backstop:
            conn.execute(BACKSTOP)
        pglockkit.register_namespace(
            conn, NAMESPACE, description="reservations by natural key: lock the key before the insert"
        )


def reserve(
    conn: psycopg.Connection,
    key: str,
    holder: str,
    *,
    ttl: float = 30.0,
    timeout: float = 0.5,
    race_window: float = 0.0,
) -> Hold:
    """Phase 1: hold ``key`` for ``holder`` for ``ttl`` seconds, unless it is held or confirmed.

    ``conn`` is in autocommit mode. Returns the key's live reservation: the new hold
    (``mine`` True), or the one that was there. ``timeout`` bounds the wait for the key's lock
    (``pglockkit.LockTimeout``): holders keep it for a few statements only. ``race_window``
    (seconds, 0 in real use) sleeps between the check and the insert with the lock held: tests
    widen the window in which two reservers without the lock would both insert.
    """
    with conn.transaction():
        pglockkit.xact_lock(conn, NAMESPACE, key, timeout=timeout)
        conn.execute(RETIRE, (key,))
        live = conn.execute(LIVE, (key,)).fetchone()
        if live is not None:
            return Hold(live[0], key, live[1], live[2], mine=False)
        time.sleep(race_window)
        (rid,) = conn.execute(HOLD, (key, holder, ttl)).fetchone()
    return Hold(rid, key, holder, "held", mine=True)


def confirm(
    conn: psycopg.Connection,
    reservation_id: int,
    holder: str,
    *,
    timeout: float = 0.5,
    race_window: float = 0.0,
) -> str:
    """Phase 2: turn ``holder``'s unexpired hold into a confirmed reservation, exactly once.

    Returns ``'confirmed'`` (this call did it and queued the confirmation message),
    ``'already confirmed'``, ``'expired'`` (the hold ran out, or another reserver took the key
    over), ``'not yours'`` or ``'unknown'``. ``race_window`` as in ``reserve``, between the check
    and the writes.
    """
    with conn.transaction():
        if pglockkit.lock_rows(conn, TABLE, [reservation_id], timeout=timeout) == 0:
            return "unknown"
        owner, status, live = conn.execute(STATE, (reservation_id,)).fetchone()
        if owner != holder:
            return "not yours"
        if status == "confirmed":
            return "already confirmed"
        if status == "expired" or not live:
            conn.execute(EXPIRE, (reservation_id,))
            return "expired"
        time.sleep(race_window)
        conn.execute(CONFIRM, (reservation_id,))
        conn.execute(NOTIFY, (reservation_id, f"{holder}: your reservation {reservation_id} is confirmed"))
    return "confirmed"


# --- the demo -----------------------------------------------------------------------------------

T = TypeVar("T")


def _together(dsn: str, calls: list[Callable[[psycopg.Connection], T]]) -> list[T]:
    """Run each call on its own connection and thread, released together; results in order."""
    barrier = threading.Barrier(len(calls))
    results: list[object] = [RuntimeError("no result")] * len(calls)

    def run(i: int) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                barrier.wait()
                results[i] = calls[i](conn)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


def _says(who: str, hold: Hold) -> str:
    if hold.mine:
        return f"{who}: holds {hold.key} (reservation {hold.id})"
    return f"{who}: {hold.key} is taken, {hold.holder} has it ({hold.status})"


def demo(dsn: str, agents: int = 8) -> int:
    setup(dsn)
    slot, late_slot = "slot:2026-03-06T10:00/room-3", "slot:2026-03-06T11:00/room-3"
    others = [f"slot:2026-03-07T{9 + i:02d}:00/room-3" for i in range(agents)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "DELETE FROM recipe_outbox WHERE reservation_id IN"
            " (SELECT id FROM recipe_reservations WHERE natural_key = ANY(%s))",
            ([slot, late_slot, *others],),
        )
        conn.execute(
            "DELETE FROM recipe_reservations WHERE natural_key = ANY(%s)", ([slot, late_slot, *others],)
        )
    names = [f"agent-{i + 1}" for i in range(agents)]
    problems = []

    print(f"1. {agents} agents reserve {slot} at the same moment")
    holds = _together(dsn, [lambda c, who=who: reserve(c, slot, who) for who in names])
    for who, hold in zip(names, holds, strict=True):
        print("   " + _says(who, hold))
    winners = [h for h in holds if h.mine]
    if len(winners) != 1:
        problems.append(f"{len(winners)} agents hold {slot}")
    winner = winners[0]

    print(f"2. {winner.holder} confirms twice at the same moment (a retried request)")
    outcomes = _together(dsn, [lambda c: confirm(c, winner.id, winner.holder) for _ in range(2)])
    with psycopg.connect(dsn, autocommit=True) as conn:
        (messages,) = conn.execute(
            "SELECT count(*) FROM recipe_outbox WHERE reservation_id = %s", (winner.id,)
        ).fetchone()
    print(f"   outcomes: {' and '.join(sorted(outcomes))}; confirmation messages queued: {messages}")
    if sorted(outcomes) != ["already confirmed", "confirmed"] or messages != 1:
        problems.append("confirm did not happen exactly once")

    print(f"3. agent-1 holds {late_slot} for 0.3 s and never confirms; agent-2 wants it too")
    with psycopg.connect(dsn, autocommit=True) as conn:
        first = reserve(conn, late_slot, "agent-1", ttl=0.3)
        print("   " + _says("agent-1", first))
        print("   " + _says("agent-2", reserve(conn, late_slot, "agent-2")))
        time.sleep(0.4)
        second = reserve(conn, late_slot, "agent-2")
        print("   after 0.4 s: " + _says("agent-2", second))
        late = confirm(conn, first.id, "agent-1")
        print(f"   agent-1 confirms late: {late}; agent-2 confirms: {confirm(conn, second.id, 'agent-2')}")
    if not second.mine or late != "expired":
        problems.append("the expired hold was not taken over")

    print(f"4. {agents} agents reserve {agents} different slots at the same moment")

    def timed(conn: psycopg.Connection, who: str, key: str) -> tuple[Hold, float]:
        started = time.monotonic()
        return reserve(conn, key, who), time.monotonic() - started

    spread = _together(
        dsn, [lambda c, who=who, key=key: timed(c, who, key) for who, key in zip(names, others, strict=True)]
    )
    slowest = max(took for _, took in spread) * 1000
    held = sum(h.mine for h, _ in spread)
    print(f"   {held} of {agents} hold their slot; the slowest call took {slowest:.0f} ms")
    if not all(h.mine for h, _ in spread):
        problems.append("an agent did not get its own slot")

    print("OK" if not problems else "UNEXPECTED: " + "; ".join(problems))
    return 0 if not problems else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dsn", help="a libpq connection string or URI")
    p.add_argument("--agents", type=int, default=8)
    args = p.parse_args(argv)
    return demo(args.dsn, args.agents)


if __name__ == "__main__":
    sys.exit(main())
