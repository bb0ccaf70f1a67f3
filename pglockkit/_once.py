"""``pglockkit once``: the supervisor that runs a command for the slot it won.

It wins the slot (``runs.start_run``), runs the command, passes signals on to it, holds the
slot's lock (its connection) until the command has exited, and records the outcome.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

import psycopg

from pglockkit import _calls, runs
from pglockkit.connection import connect, set_server_keepalives
from pglockkit.leases import default_holder

# Signals that `once` passes on to its command, as a supervisor must: a deploy or a node drain
# sends SIGTERM to the wrapper, and the slot must stay taken until the command has exited.
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Once:
    """``pglockkit once``: wins the slot, runs the command, holds the slot's lock (its connection)
    until the command has exited, records the outcome and exits with the command's status."""

    def __init__(self, dsn: str, job: str, slot: str, holder: str | None, command: list[str]):
        self.dsn, self.job, self.slot, self.holder, self.command = dsn, job, slot, holder, command
        self.child: subprocess.Popen | None = None
        self.pending: list[int] = []  # signals received while no command was running yet
        self.received: list[int] = []  # signals received while it ran, passed on to it

    def on_signal(self, signum: int, _frame) -> None:
        # Runs in the main thread, between two bytecodes of run() (also while it waits).
        child = self.child
        if child is None:
            self.pending.append(signum)
        elif child.returncode is None:
            self.received.append(signum)
            if not (signum == signal.SIGINT and _in_terminal_foreground(child.pid)):
                child.send_signal(signum)  # a no-op once the child is reaped

    def run(self) -> int:
        conn = connect(self.dsn, autocommit=True, application_name=f"pglockkit run {self.job}")
        with conn:
            # The slot's lock is a session lock: behind a pooler it stays on a server session that
            # others use, and the outcome may be recorded from another (refused, as sole_writer,
            # before any setting of the session).
            _calls.run(conn, _calls.refuse_pooler(conn, *_calls.ONCE_POOLER))
            # The slot's lock lives as long as this session: have the server end it (and free the
            # slot) within a bounded time if this host vanishes, as sole_writer does.
            set_server_keepalives(conn)
            run_id = runs.start_run(conn, self.job, self.slot, self.holder or default_holder())
            if run_id is None:
                _calls.run_event("skipped", self.job, self.slot, None)
                print(
                    f"pglockkit once: {self.job}/{self.slot} already ran or is running elsewhere; skipped",
                    file=sys.stderr,
                )
                return 0
            _calls.run_event("started", self.job, self.slot, run_id)
            previous = {s: signal.signal(s, self.on_signal) for s in _FORWARDED}
            try:
                if self.pending:
                    # Stopped before the command started: leave the run to the next pod. Closing the
                    # connection frees the slot; the run shows as abandoned and is taken over.
                    return 128 + self.pending[0]
                code, detail = self.supervise()
                ok = code == 0
                if self.received:
                    names = ", ".join(sorted({signal.Signals(s).name for s in self.received}))
                    detail = f"{detail + '; ' if detail else ''}pglockkit once received {names}"
                try:
                    recorded = runs.finish_run(conn, run_id, ok, detail)
                except psycopg.OperationalError as lost:  # a server restart, a dropped path
                    return self.unrecorded(code, _calls.connection_lost(lost) + "; the slot may run again")
                if not recorded:
                    # This session no longer holds the slot (its lock was let go of by hand, or
                    # another attempt took the run over): the outcome is not this run's to record.
                    return self.unrecorded(code, "this session no longer holds the slot, which may run again")
                _calls.run_event("succeeded" if ok else "failed", self.job, self.slot, run_id)
                return code
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    def unrecorded(self, code: int, why: str) -> int:
        """Say that the command's outcome (its exit status ``code``) was not recorded, and why:
        exit 1, whatever the command's status (docs/runs.md), which the message names."""
        print(
            f"pglockkit once: {self.job}/{self.slot}: the outcome (exit status {code}) was not "
            f"recorded: {why}",
            file=sys.stderr,
        )
        return 1

    def supervise(self) -> tuple[int, str | None]:
        """Run the command to its end; its exit status as a shell reports it, and a detail."""
        try:
            self.child = subprocess.Popen(self.command, preexec_fn=_die_with_parent())
        except OSError as exc:
            print(f"pglockkit once: cannot run {self.command[0]!r}: {exc.strerror}", file=sys.stderr)
            # As a shell reports it: 127 not found, 126 found but not executable.
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            return code, f"cannot run {self.command[0]!r}: {exc.strerror} (exit status {code})"
        for signum in self.pending:  # arrived while the command was being started
            self.received.append(signum)
            self.child.send_signal(signum)
        self.pending.clear()
        status = self.child.wait()
        if status < 0:
            name = signal.Signals(-status).name
            return 128 - status, f"killed by {name} (exit status {128 - status})"
        return status, None if status == 0 else f"exit status {status}"


def _in_terminal_foreground(pid: int) -> bool:
    """Whether ``pid`` is in the foreground process group of this process's terminal. Then Ctrl-C's
    SIGINT, which the terminal sends to that whole group, reached it already."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False  # no controlling terminal (cron, a container): the signal came from kill
    try:
        return os.tcgetpgrp(fd) == os.getpgid(pid)
    except OSError:
        return False
    finally:
        os.close(fd)


def _die_with_parent():
    """On Linux, a ``preexec_fn`` that makes the kernel SIGKILL the command if the wrapper dies
    (PR_SET_PDEATHSIG), so that a SIGKILLed wrapper, whose lock the server then frees, does not
    leave its command running. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # fails only for a bad signal number
        if os.getppid() != parent:  # the wrapper died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


_PR_SET_PDEATHSIG = 1
