"""The test helpers' safety net: a worker process a test started and left running is killed when
the test ends (tests/conftest.py calls scenarios.reap), so it cannot claim the next tests' jobs."""

from __future__ import annotations

import subprocess
import sys

from scenarios import reap, track


def test_reap_kills_what_a_test_left_running_and_leaves_what_ended() -> None:
    running = track(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    ended = track(subprocess.Popen([sys.executable, "-c", "pass"]))
    ended.wait(10)
    assert reap() == [running.pid]
    assert running.poll() is not None and ended.poll() == 0
    assert reap() == []  # nothing tracked any more
