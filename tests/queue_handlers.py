"""Handlers for worker processes started by the queue tests (``pglockkit work --handler``)."""

from __future__ import annotations

import os
import time


def record(job, conn):
    """Record the job's id and claim token in the handler's transaction (committed together with
    the job's completion, or not at all), after a little work."""
    time.sleep(job.payload.get("sleep", 0))
    conn.execute(
        "INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, %s)", (job.id, job.token, os.getpid())
    )


def explode(job, conn):
    raise RuntimeError(f"handler failed on job {job.id}")
