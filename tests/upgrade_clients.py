"""Clients that run across an upgrade (tests/system/test_upgrade.py), started as processes with a
released pglockkit first on their path.

    python tests/upgrade_clients.py lease DSN SECONDS

``lease``: for SECONDS, take the lease ``up-lease`` for about a second at a time (a short ttl,
renewed by the Lease's thread), and in each of many transactions check the fence and record the
token, as a fenced writer does. It prints the pglockkit it imported, then one line per
acquisition; an error ends it with a traceback and a non-zero exit.
"""

from __future__ import annotations

import sys
import time

import psycopg

import pglockkit


def lease(dsn: str, seconds: float) -> None:
    print(f"pglockkit {pglockkit.__file__}", flush=True)
    deadline = time.monotonic() + seconds
    with psycopg.connect(dsn) as conn:
        while time.monotonic() < deadline:
            with pglockkit.Lease(dsn, "up-lease", ttl=3.0, renew_every=0.3, holder="upgrade") as held:
                if not held.acquired:
                    time.sleep(0.05)
                    continue
                print(f"acquired {held.token}", flush=True)
                turn = time.monotonic() + 1.0
                while time.monotonic() < min(turn, deadline) and not held.lost.is_set():
                    with conn.transaction():
                        held.check_fence(conn)
                        conn.execute("INSERT INTO fenced_writes (token) VALUES (%s)", (held.token,))
                    time.sleep(0.01)
                if held.lost.is_set():
                    raise SystemExit(f"lease lost: {held.lost_reason}")


if __name__ == "__main__":
    role, dsn, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    {"lease": lease}[role](dsn, seconds)
