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


def span(job, conn):
    """Record when the handler ran (its start and end, by the worker's clock) after sleeping."""
    started = time.time()
    time.sleep(job.payload.get("sleep", 0))
    conn.execute(
        "INSERT INTO spans (job_id, key, s, e) VALUES (%s, %s, to_timestamp(%s), to_timestamp(%s))",
        (job.id, job.payload.get("key"), started, time.time()),
    )


async def span_async(job, conn):
    """``span`` for the asyncio worker."""
    import asyncio

    started = time.time()
    await asyncio.sleep(job.payload.get("sleep", 0))
    await conn.execute(
        "INSERT INTO spans (job_id, key, s, e) VALUES (%s, %s, to_timestamp(%s), to_timestamp(%s))",
        (job.id, job.payload.get("key"), started, time.time()),
    )


async def record_async(job, conn):
    """``record`` for the asyncio worker."""
    import asyncio

    await asyncio.sleep(job.payload.get("sleep", 0))
    await conn.execute(
        "INSERT INTO done_log (job_id, token, pid) VALUES (%s, %s, %s)", (job.id, job.token, os.getpid())
    )
