"""pg_cron ticking the schedules, as docs/schedules.md says it can: Debian's pg_cron
(``postgresql-15-cron``) preloaded in a PostgreSQL 15 server of its own, its jobs run by background
workers. Debian 12's pg_cron (1.4) schedules by the minute, so the test waits for the next minute
boundary: about 30 s, at most a minute."""

from __future__ import annotations

import time

import psycopg
from psycopg.conninfo import make_conninfo

import pglockkit

TICK = "SELECT pglockkit.tick_schedules()"


def test_pg_cron_ticks_the_schedules_as_a_worker_role_and_each_slot_is_one_job(pg15_cron_proc):
    """A role that is only a pglockkit_user member schedules the tick with pg_cron; at the next
    minute pg_cron runs it as that role, and the schedule's slot becomes one job with the
    schedule's payload. A worker that ticks the same slot as well adds no second job."""
    proc = pg15_cron_proc
    admin_dsn = make_conninfo(host=proc.host, port=proc.port, user=proc.user, dbname="postgres")
    pglockkit.install(admin_dsn)
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute("CREATE EXTENSION IF NOT EXISTS pg_cron")
        admin.execute("DROP ROLE IF EXISTS cron_ticker")
        admin.execute("CREATE ROLE cron_ticker LOGIN IN ROLE pglockkit_user")
        admin.execute("GRANT USAGE ON SCHEMA cron TO cron_ticker")
        admin.execute("""SELECT pglockkit.schedule('digest', '* * * * *', 'reports', '{"kind": "digest"}')""")
        with psycopg.connect(make_conninfo(admin_dsn, user="cron_ticker"), autocommit=True) as ticker:
            cron_job = ticker.execute("SELECT cron.schedule('pglockkit-tick', '* * * * *', %s)", (TICK,))
            cron_job = cron_job.fetchone()[0]
        deadline = time.monotonic() + 125  # the next minute boundary, with room for a slow start
        while True:
            runs = admin.execute(
                "SELECT status, return_message, username FROM cron.job_run_details WHERE jobid = %s",
                (cron_job,),
            ).fetchall()
            assert not [r for r in runs if r[0] == "failed"], runs
            if [r for r in runs if r[0] == "succeeded"]:
                break
            assert time.monotonic() < deadline, f"pg_cron did not run the tick in time: {runs}"
            time.sleep(0.5)
        _, message, username = next(r for r in runs if r[0] == "succeeded")
        assert username == "cron_ticker" and message == "SELECT 1", runs
        jobs = admin.execute(
            "SELECT payload->>'_slot', payload->>'kind', payload->>'_schedule' FROM pglockkit.jobs "
            "WHERE queue = 'reports' ORDER BY id"
        ).fetchall()
        assert len(jobs) == 1 and jobs[0][1:] == ("digest", "digest"), jobs
        slot = jobs[0][0]
        admin.execute(TICK)  # a worker ticking the same slot (or the next, if a minute has passed)
        slots = [
            r[0]
            for r in admin.execute("SELECT payload->>'_slot' FROM pglockkit.jobs WHERE queue = 'reports'")
        ]
        assert slots.count(slot) == 1, slots
        admin.execute("SELECT cron.unschedule(%s)", (cron_job,))
