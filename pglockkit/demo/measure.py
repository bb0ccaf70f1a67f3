"""One step: N agents of one design for ``seconds``, with a sampler reading the server live."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from pglockkit.demo.model import LIVE_LOCKS, NAMESPACE, Live, Settings


class _Sampler(threading.Thread):
    """Calls sample() and reads advisory_locks every ``every`` seconds until stopped."""

    def __init__(
        self, conn: psycopg.Connection, every: float, names: dict[int, str], started: float, deadline: float
    ):
        super().__init__(name="pglockkit-demo-sampler", daemon=True)
        self.conn, self.every, self.names = conn, every, names
        self.started, self.deadline = started, deadline
        self.stop = threading.Event()
        self.taken = 0
        self.latest: Live | None = None
        self.busiest: Live | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        # Samples fall inside the step only (the first half an interval in, none after the
        # deadline), so that the idle edges of a step do not dilute the report.
        delay = self.every / 2
        try:
            while not self.stop.wait(delay) and time.monotonic() < self.deadline:
                delay = self.every
                self.conn.execute("SELECT pglockkit.sample()")
                self.taken += 1
                row = self.conn.execute(LIVE_LOCKS, (NAMESPACE,)).fetchone()
                live = None
                if row is not None:
                    key, holding, waiting, pids, longest, keys = row
                    name = self.names.get(key, str(key))
                    at = time.monotonic() - self.started
                    live = Live(round(at, 2), key, name, holding, waiting, pids or [], longest, keys)
                    if self.busiest is None or _rank(live) > _rank(self.busiest):
                        self.busiest = live
                self.latest = live
        except BaseException as exc:  # reported by the step
            self.error = exc


def _rank(live: Live) -> tuple[int, float]:
    return live.waiting, live.longest_wait_s or 0.0


Unit = Callable[[psycopg.Connection, int, float], float | None]
"""(conn, agent, deadline) -> seconds waited for the lock or claim; None: stop (step over, or dry)."""


def _run_step(
    conns: list[psycopg.Connection],
    sampler_conn: psycopg.Connection,
    n: int,
    settings: Settings,
    unit: Unit,
    names: dict[int, str],
    progress: Callable[[float, int, Live | None], None],
) -> tuple[int, float, _Sampler, Any]:
    """Run ``unit`` in a loop on ``n`` agents until the deadline; returns (jobs done by the
    deadline, longest wait, the sampler, the server time at the start)."""
    done = [0] * n
    waits = [0.0] * n
    errors: list[BaseException] = []
    go = threading.Event()
    clock: dict[str, float] = {}

    def agent(i: int) -> None:
        go.wait()
        deadline = clock["deadline"]
        try:
            while time.monotonic() < deadline:
                waited = unit(conns[i], i, deadline)
                if waited is None:
                    return
                waits[i] = max(waits[i], waited)
                if time.monotonic() <= deadline:
                    done[i] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=agent, args=(i,), name=f"demo-agent-{i}", daemon=True) for i in range(n)
    ]
    for t in threads:
        t.start()
    server_start = sampler_conn.execute("SELECT clock_timestamp()").fetchone()[0]
    started = time.monotonic()
    clock["deadline"] = started + settings.seconds
    sampler = _Sampler(sampler_conn, settings.sample_every, names, started, clock["deadline"])
    go.set()
    sampler.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)
            progress(min(time.monotonic() - started, settings.seconds), sum(done), sampler.latest)
    sampler.stop.set()
    sampler.join()
    if errors:
        raise errors[0]
    if sampler.error is not None:
        raise sampler.error
    return sum(done), max(waits), sampler, server_start
