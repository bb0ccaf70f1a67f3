"""``pglockkit demo``: a swarm serialized behind one advisory lock, measured live on a real server.

A swarm of agents (threads, one connection each) does units of simulated work, a sleep plus one
``INSERT``, coordinated in three ways, for each agent count of a sweep:

1. ``global``: every unit under ONE advisory lock, ``xact_lock('demo', 'global')``;
2. ``queue``: the units are jobs, claimed with ``claim_job`` (``FOR UPDATE SKIP LOCKED``);
3. ``sharded``: a lock per tenant, ``xact_lock('demo', 'tenant:' || t)``, plus one shared refresh
   that exactly one agent does, behind a lease (``acquire_lease`` / ``check_fence``).

A sampler thread calls ``pglockkit.sample()`` every ``sample_every`` seconds and reads
``pglockkit.advisory_locks`` live; after each step ``contention_report`` is read for the step's
window. Every number printed is measured in this run. The demo works in schema ``pglockkit_demo``
(dropped at start and at the end), a queue named per run (its jobs are pruned at the end) and the
lease ``demo:shared-refresh``; samples stay in the contention history like any other.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from pglockkit.demo.model import (
    DESIGNS,
    LEASE,
    NAMESPACE,
    SCHEMA,
    TITLES,
    NotInstalled,
    Settings,
    Step,
    default_steps,
)
from pglockkit.demo.report import environment, plot, summary
from pglockkit.demo.swarm import Demo

__all__ = [
    "DESIGNS",
    "LEASE",
    "NAMESPACE",
    "SCHEMA",
    "TITLES",
    "Demo",
    "NotInstalled",
    "Settings",
    "Step",
    "default_steps",
    "environment",
    "main",
    "plot",
    "summary",
]


def main(args: argparse.Namespace, dsn: str, dsn_label: str, out: TextIO = sys.stdout) -> int:
    """Run the demo from parsed ``pglockkit demo`` arguments on ``dsn``."""
    steps = args.steps or default_steps(args.agents)
    settings = Settings(args.agents, steps, args.seconds, args.work_ms, args.tenants)
    demo = Demo(dsn, settings, out)
    counts = sorted({1, *steps})
    expected = len(counts) * len(DESIGNS) * settings.seconds
    out.write(
        f"pglockkit demo: {settings.agents} agents, steps {','.join(map(str, counts))}, "
        f"{settings.seconds:g} s per step (about {expected:.0f} s); a unit of work = "
        f"{settings.work_ms:g} ms sleep + one INSERT\n"
    )
    try:
        measured = demo.run()
    except NotInstalled as exc:
        print(f"pglockkit demo: error: {exc}", file=sys.stderr)
        return 1
    env = environment(dsn_label, demo.server)
    out.write(summary(measured, settings) + "\n")
    out.write(
        f"\nMeasured {env['date']} on {env['server']} ({dsn_label}), {env['cores']} cores, "
        f"{env['platform']}.\n"
    )
    if args.plot:
        plot(measured, args.plot)
        out.write(f"wrote {args.plot}\n")
    if args.json:
        data = {"environment": env, "settings": asdict(settings), "steps": [asdict(s) for s in measured]}
        Path(args.json).write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
        out.write(f"wrote {args.json}\n")
    return 0
