"""Run ``pg_ctl`` as an unprivileged OS user when the tests run as root.

``initdb`` and ``postgres`` refuse to run as root, and CI runs as root. pytest-postgresql drives
every server operation through one executable (``pg_ctl initdb|start|stop|status``), so the test
harness points it at a launcher that runs this script: as root it makes sure the OS user exists,
hands it the directories pg_ctl writes (the data directory's and the log file's parents), drops
privileges, and execs the real ``pg_ctl``. As any other user it execs ``pg_ctl`` directly.

Usage: python pg_ctl_unprivileged.py /path/to/real/pg_ctl ARGS...
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

OS_USER = os.environ.get("PGLOCKKIT_TEST_OS_USER", "pglockkit_pg")


def _user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(OS_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OS_USER],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(OS_USER)


def _hand_over(directory: Path, pw: pwd.struct_passwd) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    os.chown(directory, pw.pw_uid, pw.pw_gid)
    # The user must be able to reach it: let others traverse (not list) every ancestor.
    for parent in directory.parents:
        mode = parent.stat().st_mode
        if mode & 0o001 == 0:
            parent.chmod(mode | 0o001)


def main() -> None:
    real, args = sys.argv[1], sys.argv[2:]
    if os.geteuid() != 0:
        os.execv(real, [real, *args])
    pw = _user()
    workdir = None
    for flag in ("-D", "--pgdata", "-l"):
        if flag in args:
            path = Path(args[args.index(flag) + 1]).resolve()
            _hand_over(path.parent, pw)
            workdir = path.parent
    if workdir is not None:
        os.chdir(workdir)
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    os.execv(real, [real, *args])


if __name__ == "__main__":
    main()
