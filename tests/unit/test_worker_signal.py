"""The Worker's SIGTERM/SIGINT handler runs in the main thread wherever that thread was, perhaps
inside a lock that stopping the lanes takes (``threading.Event.set`` takes the lock that
``Event.wait`` holds for a moment as it wakes). The handler must take no lock: it sets a flag that
the thread in ``run`` passes on. Before, a SIGTERM landing in that moment hung the worker for good,
and the deploy had to SIGKILL it (its jobs in hand then went back only by their lease)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, signal
    from pglockkit import Worker

    worker = Worker("postgresql:///unused", "q", lambda job: None)
    restore = worker._install_signal_handlers()
    # As in Event.wait just after it woke: this thread holds the event's lock when SIGTERM lands.
    with worker._stopping._cond:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between two bytecodes of this loop
            pass
    assert worker._pass_on_stop(), "stop() was not passed on"
    restore()
    print("stopped")
    """
)


def test_sigterm_landing_while_the_main_thread_holds_the_stop_events_lock_stops_the_worker():
    try:
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=20, check=False
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("the SIGTERM handler deadlocked on a lock its own thread held") from None
    assert (out.returncode, out.stdout.strip()) == (0, "stopped"), out.stderr
