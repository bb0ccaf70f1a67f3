-- pglockkit 0014: what an adversarial review of the queue and monitoring found.
-- * retry_dead_jobs failed as a whole (23505 on jobs_dedup), retrying nothing, when two dead jobs
--   of a queue had one dedup key (a key can die more than once: dedup keys are unique among
--   unfinished jobs only) or a dead job's key had been enqueued again. Now the newest dead job of
--   a key is queued again unless an unfinished job has the key; the others stay dead.
-- * lock_waits found waiters through pg_stat_activity.wait_event_type, which is NULL for another
--   role's session unless the reader has pg_read_all_stats: a pglockkit_user reader (and so the
--   exporter, top) saw no waits. It also listed other databases' waits, decoded with this
--   database's registry and catalog. Now: sessions of this database with a lock not granted.
-- * list_jobs(queue, with_status, lim): what pglockkit jobs lists, for pglockkit_admin (no role
--   has privileges on the table, so the operators could not read the dead jobs they may retry).

SET LOCAL search_path = pg_catalog, pg_temp;

-- Queues dead jobs again; its UPDATE, once for all of them and, if a concurrent enqueue took a
-- dedup key meanwhile, once per job. A dead job whose dedup key an unfinished job of the queue has
-- stays dead (dedup keys are unique among unfinished jobs, index jobs_dedup).
CREATE FUNCTION pglockkit._requeue_dead(queue text, ids bigint[])
RETURNS TABLE (n integer, keys text[], limits integer[])
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    WITH requeued AS (
        UPDATE pglockkit.jobs j
           SET status = 'queued', attempt = 0, run_at = pg_catalog.clock_timestamp(), finished_at = NULL, lease_expires_at = NULL
         WHERE j.id OPERATOR(pg_catalog.=) ANY (_requeue_dead.ids) AND j.queue = _requeue_dead.queue AND j.status = 'dead'
           AND (j.dedup_key IS NULL
                OR NOT EXISTS (SELECT FROM pglockkit.jobs p
                                WHERE p.queue = j.queue AND p.dedup_key = j.dedup_key AND p.status IN ('queued', 'running')))
        RETURNING j.concurrency_key, j.concurrency_limit
    )
    SELECT pg_catalog.count(*)::int,
           pg_catalog.array_agg(r.concurrency_key) FILTER (WHERE r.concurrency_key IS NOT NULL),
           pg_catalog.array_agg(r.concurrency_limit) FILTER (WHERE r.concurrency_key IS NOT NULL)
      FROM requeued r
$$;
COMMENT ON FUNCTION pglockkit._requeue_dead(text, bigint[]) IS
    'Private: retry_dead_jobs''s UPDATE of the dead jobs in ids (a dead job whose dedup key an unfinished job has is left dead): how many, and the concurrency keys and limits of those queued again. Runs with its caller''s rights.';

CREATE OR REPLACE FUNCTION pglockkit.retry_dead_jobs(queue text, ids bigint[] DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_ids    bigint[];
    v_id     bigint;
    v_one    integer;
    v_n      integer := 0;
    v_keys   text[];
    v_limits integer[];
    v_k      text[];
    v_l      integer[];
BEGIN
    PERFORM pglockkit._check_queue(retry_dead_jobs.queue);
    -- Dedup keys are unique among unfinished jobs, so a key can die more than once (a daily digest
    -- that fails each day): of its dead jobs, the newest is queued again (0014).
    SELECT pg_catalog.array_agg(c.id) INTO v_ids
      FROM (SELECT j.id FROM pglockkit.jobs j
             WHERE j.queue = retry_dead_jobs.queue AND j.status = 'dead' AND j.dedup_key IS NULL
               AND (retry_dead_jobs.ids IS NULL OR j.id OPERATOR(pg_catalog.=) ANY (retry_dead_jobs.ids))
            UNION ALL
            SELECT d.id FROM (SELECT DISTINCT ON (j.dedup_key) j.id FROM pglockkit.jobs j
                               WHERE j.queue = retry_dead_jobs.queue AND j.status = 'dead' AND j.dedup_key IS NOT NULL
                                 AND (retry_dead_jobs.ids IS NULL OR j.id OPERATOR(pg_catalog.=) ANY (retry_dead_jobs.ids))
                               ORDER BY j.dedup_key, j.id DESC) d) c;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    BEGIN
        SELECT r.n, r.keys, r.limits INTO v_n, v_keys, v_limits
          FROM pglockkit._requeue_dead(retry_dead_jobs.queue, v_ids) r;
    EXCEPTION WHEN unique_violation THEN
        -- An enqueue took the dedup key of one of them after the check: one job at a time, each
        -- that meets such an enqueue staying dead.
        v_n := 0;
        FOREACH v_id IN ARRAY v_ids LOOP
            BEGIN
                SELECT r.n, r.keys, r.limits INTO v_one, v_k, v_l
                  FROM pglockkit._requeue_dead(retry_dead_jobs.queue, ARRAY[v_id]) r;
                v_n := v_n OPERATOR(pg_catalog.+) v_one;
                v_keys := v_keys OPERATOR(pg_catalog.||) v_k;
                v_limits := v_limits OPERATOR(pg_catalog.||) v_l;
            EXCEPTION WHEN unique_violation THEN
                NULL;
            END;
        END LOOP;
    END;
    IF v_keys IS NOT NULL THEN
        -- The keys of the jobs queued again keep (or get back) their rows: prune_jobs may have
        -- deleted them while the jobs were dead.
        PERFORM pglockkit._pin_job_key(retry_dead_jobs.queue, g.key, g.lim)
           FROM (SELECT x.key, pg_catalog.min(x.lim) AS lim
                   FROM ROWS FROM (pg_catalog.unnest(v_keys), pg_catalog.unnest(v_limits)) AS x(key, lim)
                  GROUP BY x.key ORDER BY x.key) g;
    END IF;
    IF v_n > 0 THEN
        PERFORM pg_catalog.pg_notify('pglockkit_jobs', retry_dead_jobs.queue);
    END IF;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit.retry_dead_jobs(text, bigint[]) IS
    'Queues dead jobs of a queue again (all, or those in ids) with a fresh set of attempts; returns how many. Of the dead jobs with one dedup key, the newest is queued again, unless an unfinished job of the queue has the key; the others stay dead. last_error is kept until the next failure.';

-- What `pglockkit jobs` lists. No role has privileges on the table; this lets the operators'
-- role read the jobs it may retry or cancel (pglockkit_admin only, like retry_dead_jobs).
CREATE FUNCTION pglockkit.list_jobs(queue text, with_status text DEFAULT NULL, lim integer DEFAULT 50)
RETURNS TABLE (id bigint, status text, priority integer, attempt integer, max_attempts integer,
               run_at timestamptz, worker text, payload jsonb, last_error text, created_at timestamptz,
               finished_at timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pglockkit._check_queue(list_jobs.queue);
    IF list_jobs.with_status IS NOT NULL
       AND list_jobs.with_status <> ALL ('{queued,running,done,dead,cancelled}'::text[]) THEN
        RAISE EXCEPTION 'unknown job status "%"', list_jobs.with_status USING ERRCODE = 'invalid_parameter_value',
            HINT = 'A job is queued, running, done, dead or cancelled.';
    END IF;
    IF list_jobs.lim IS NULL THEN
        RAISE EXCEPTION 'lim must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF list_jobs.lim < 1 THEN
        RAISE EXCEPTION 'lim must be a positive number of jobs, got %', list_jobs.lim
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY
        SELECT j.id, j.status, j.priority, j.attempt, j.max_attempts, j.run_at, j.worker, j.payload,
               j.last_error, j.created_at, j.finished_at
          FROM pglockkit.jobs j
         WHERE j.queue = list_jobs.queue AND (list_jobs.with_status IS NULL OR j.status = list_jobs.with_status)
         ORDER BY j.id DESC
         LIMIT list_jobs.lim;
END
$$;
COMMENT ON FUNCTION pglockkit.list_jobs(text, text, integer) IS
    'A queue''s jobs, newest first, at most lim (with status with_status only, if given): what pglockkit jobs prints. pglockkit_admin only. 22004 for a NULL queue or lim, 22023 for an empty queue, an unknown status or a lim under 1.';

-- The waiters are the sessions of this database with a lock not granted in pg_locks, which every
-- reader sees (pg_stat_activity's wait_event_type is NULL for another role's session, unless the
-- reader has pg_read_all_stats), and decoded with this database's registry and catalog (0014).
CREATE OR REPLACE VIEW pglockkit.lock_waits AS
WITH RECURSIVE waiting AS (
    SELECT a.pid, pg_catalog.pg_blocking_pids(a.pid) AS blocked_by
      FROM pg_catalog.pg_stat_activity a
     WHERE a.datid OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database d
                                            WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
       AND EXISTS (SELECT FROM pg_catalog.pg_locks l
                    WHERE l.pid OPERATOR(pg_catalog.=) a.pid AND NOT l.granted)
), up (pid, blocker, depth) AS (
    SELECT w.pid, b.blocker, 1 FROM waiting w, pg_catalog.unnest(w.blocked_by) AS b(blocker)
    UNION
    SELECT u.pid, b.blocker, u.depth OPERATOR(pg_catalog.+) 1
      FROM up u JOIN waiting w ON w.pid OPERATOR(pg_catalog.=) u.blocker, pg_catalog.unnest(w.blocked_by) AS b(blocker)
     WHERE u.depth OPERATOR(pg_catalog.<) 100
), roots AS (
    -- The blockers at the top of each chain: not waiting themselves.
    SELECT u.pid, pg_catalog.min(u.blocker) AS root
      FROM up u
     WHERE NOT EXISTS (SELECT FROM waiting w WHERE w.pid OPERATOR(pg_catalog.=) u.blocker
                                                AND pg_catalog.cardinality(w.blocked_by) OPERATOR(pg_catalog.>) 0)
     GROUP BY u.pid
)
SELECT w.pid, w.blocked_by, r.root AS root_blocker,
       (SELECT pg_catalog.count(*) FROM roots r2 WHERE r2.root OPERATOR(pg_catalog.=) r.root) AS sessions_behind_root,
       l.locktype, l.mode,
       CASE WHEN l.locktype OPERATOR(pg_catalog.=) 'advisory' THEN pglockkit._advisory_label(l.objsubid, l.classid, l.objid) END AS namespace,
       l.relation::regclass AS relation,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) l.waitstart AS wait_time,
       a.application_name, a.usename AS "user", a.query
  FROM waiting w
  JOIN pg_catalog.pg_locks l ON l.pid OPERATOR(pg_catalog.=) w.pid AND NOT l.granted
  LEFT JOIN roots r ON r.pid OPERATOR(pg_catalog.=) w.pid
  LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) w.pid
 WHERE pg_catalog.cardinality(w.blocked_by) OPERATOR(pg_catalog.>) 0;
COMMENT ON VIEW pglockkit.lock_waits IS
    'Every session of this database waiting on a lock of any type: its blockers, the root blocker of its chain (a session that is not itself waiting) and how many sessions wait behind that root, the lock (namespace for advisory locks, relation otherwise), and how long it has waited. A blocker 0 is a prepared transaction (pg_blocking_pids).';

CREATE OR REPLACE FUNCTION pglockkit._admin_only(proname name) RETURNS boolean
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT proname OPERATOR(pg_catalog.=) ANY ('{register_namespace,list_jobs,prune_jobs,prune_leases,prune_runs,retry_dead_jobs,sample,schedule,set_max_payload_bytes,unschedule,set_rate_limit,remove_rate_limit,pause_queue,resume_queue}'::name[]) $$;

SELECT pglockkit._grant_privileges();
