"""The demo's output: the markdown summary, the environment line and the plot."""

from __future__ import annotations

import os
import platform
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pglockkit import _format as fmt
from pglockkit.demo.model import DESIGNS, LEASE, TITLES, Settings, Step


def _report_text(step: Step) -> str:
    r = step.report
    if r.keys == 0:
        return f"no `demo` lock in {step.samples_taken} samples"
    if r.keys == 1:
        return (
            f"`{r.top_resource}`: waiters in {r.samples_with_waiters}/{r.samples} samples, "
            f"max {r.max_waiters}, avg {r.avg_waiters:.1f}; parallelism {r.parallelism:.2f}"
        )
    waits = f"at most {r.max_waiters} waiting on one" if r.max_waiters else "no waiter"
    return f"{r.keys} keys, {waits}; parallelism {r.parallelism:.2f}"


def summary(steps: list[Step], settings: Settings) -> str:
    """The markdown tables: throughput by agent count, then each design at the largest count."""
    counts = sorted({s.agents for s in steps})
    at = {(s.design, s.agents): s for s in steps}
    top = counts[-1]
    lines = [
        "",
        "Throughput (jobs/s) and effective parallelism (jobs/s / the same design's 1-agent jobs/s):",
        "",
        "| agents | " + " | ".join(TITLES[d] for d in DESIGNS) + " |",
        "|--:|" + "--:|" * len(DESIGNS),
    ]
    for n in counts:
        cells = [f"{at[d, n].jobs_s:,.1f} (x{at[d, n].parallelism:.2f})" for d in DESIGNS if (d, n) in at]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"At {top} agents ({settings.seconds:g} s per step; a unit is {settings.work_ms:g} ms of work "
        "and one INSERT):",
        "",
        "| design | jobs/s | parallelism | longest wait | contention_report: keys, waiters, parallelism |",
        "|---|--:|--:|--:|---|",
    ]
    for d in DESIGNS:
        s = at.get((d, top))
        if s is not None:
            lines.append(
                f"| {TITLES[d]} | {s.jobs_s:,.1f} | {s.parallelism:.2f} | {fmt.ms(s.longest_wait_s)} "
                f"| {_report_text(s)} |"
            )
    g, sh = at.get(("global", top)), at.get(("sharded", top))
    lines.append("")
    if g is not None and g.live is not None:
        live = g.live
        lines.append(
            f"pglockkit.advisory_locks, read live {live.at_s:.1f} s into the global-lock step at {top} "
            "agents: "
            f"`{live.resource}` {live.holding} holding (pid {', '.join(map(str, live.holder_pids))}), "
            f"{live.waiting} waiting, longest wait {fmt.ms(live.longest_wait_s)}."
        )
    if sh is not None:
        who = ", ".join(sh.refreshers) or "nobody"
        lines.append(
            f"Shared refresh at {top} agents: {sh.refreshes} refreshes behind lease `{LEASE}`, "
            f"done by {len(sh.refreshers)} agent(s) ({who}); acquire_lease gave the others NULL at once."
        )
    return "\n".join(lines)


def environment(dsn_label: str, server: str) -> dict[str, Any]:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "server": f"PostgreSQL {server}",
        "target": dsn_label,
        "cores": cores,
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
    }


def plot(steps: list[Step], path: Path) -> None:
    """``figure(steps)``, saved as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(steps)
    fig.savefig(path)
    plt.close(fig)


def figure(steps: list[Step]):
    """Throughput against agents for the three designs, with the ideal (the queue's 1-agent rate x
    N). Both axes are logarithmic and say so: the agent counts double (1, 2, 4, 8, 16), so a log
    axis spaces them evenly, and on a log-log plot the ideal is a straight line, a design that
    scales runs parallel to it and one that serializes is flat. (On a log x and a linear y axis
    the ideal curved upwards, and scaling read as its opposite.)"""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for design, style in zip(DESIGNS, ("o-", "s-", "^-"), strict=True):
        mine = sorted((s for s in steps if s.design == design), key=lambda s: s.agents)
        ax.plot([s.agents for s in mine], [s.jobs_s for s in mine], style, label=TITLES[design])
    counts = sorted({s.agents for s in steps})
    one = next((s.jobs_s for s in steps if s.design == "queue" and s.agents == 1), None)
    if one:
        ideal = [one * n for n in counts]
        ax.plot(counts, ideal, ":", color="grey", label="ideal (queue's 1-agent rate x N)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.xaxis.set_minor_formatter(NullFormatter())
    plain = FuncFormatter(lambda value, _: f"{value:,.0f}" if value >= 1 else f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.set_xlabel("agents (log scale)")
    ax.set_ylabel("jobs/s (log scale)")
    ax.set_title("pglockkit demo: one global lock vs SKIP LOCKED queue vs sharded keys")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig
