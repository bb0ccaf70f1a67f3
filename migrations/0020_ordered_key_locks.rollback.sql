-- Back to 0013's claim_job and 0004's key bookkeeping: no jobs_keys index, no pinning of key
-- rows, prune_jobs deletes jobs only.

DROP TRIGGER jobs_pin_key ON pglockkit.jobs;
DROP FUNCTION pglockkit._pin_job_key_on_insert();
DROP FUNCTION pglockkit._pin_job_key(text, text, integer);
DROP INDEX pglockkit.jobs_keys;

COMMENT ON TABLE pglockkit.job_keys IS
    'Running jobs per (queue, concurrency key) and the key''s limit (the last one claimed with). Maintained by the queue functions.';

CREATE OR REPLACE FUNCTION pglockkit._keys_left(queues text[], keys text[]) RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    -- Jobs (one array entry each; NULL keys ignored) of these queues and concurrency keys
    -- stopped running. One UPDATE, each key's row once.
    UPDATE pglockkit.job_keys k
       SET running = k.running OPERATOR(pg_catalog.-) g.n
      FROM (SELECT x.queue, x.key, pg_catalog.count(*)::int AS n
              FROM ROWS FROM (pg_catalog.unnest(queues), pg_catalog.unnest(keys)) AS x(queue, key)
             WHERE x.key IS NOT NULL GROUP BY x.queue, x.key) g
     WHERE k.queue OPERATOR(pg_catalog.=) g.queue AND k.key OPERATOR(pg_catalog.=) g.key
$$;
COMMENT ON FUNCTION pglockkit._keys_left(text[], text[]) IS
    'Private: lowers the running counts of per-key concurrency when jobs with these (queue, key) pairs leave ''running''.';

CREATE OR REPLACE FUNCTION pglockkit.retry_dead_jobs(queue text, ids bigint[] DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_n integer;
BEGIN
    PERFORM pglockkit._check_queue(retry_dead_jobs.queue);
    UPDATE pglockkit.jobs j
       SET status = 'queued', attempt = 0, run_at = pg_catalog.clock_timestamp(), finished_at = NULL, lease_expires_at = NULL
     WHERE j.queue OPERATOR(pg_catalog.=) retry_dead_jobs.queue AND j.status OPERATOR(pg_catalog.=) 'dead'
       AND (retry_dead_jobs.ids IS NULL OR j.id OPERATOR(pg_catalog.=) ANY (retry_dead_jobs.ids));
    GET DIAGNOSTICS v_n = ROW_COUNT;
    IF v_n OPERATOR(pg_catalog.>) 0 THEN
        PERFORM pg_catalog.pg_notify('pglockkit_jobs', retry_dead_jobs.queue);
    END IF;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit.retry_dead_jobs(text, bigint[]) IS
    'Queues dead jobs of a queue again (all, or those in ids) with a fresh set of attempts; returns how many. last_error is kept until the next failure.';

CREATE OR REPLACE FUNCTION pglockkit.prune_jobs(older_than interval, queue text DEFAULT NULL, include_dead boolean DEFAULT false)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_n bigint;
BEGIN
    IF older_than IS NULL OR include_dead IS NULL THEN
        RAISE EXCEPTION 'older_than and include_dead must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF older_than OPERATOR(pg_catalog.<) interval '0' THEN
        RAISE EXCEPTION 'older_than must not be negative, got %', older_than USING ERRCODE = 'invalid_parameter_value';
    END IF;
    DELETE FROM pglockkit.jobs j
     WHERE j.status IN ('done', 'cancelled', CASE WHEN include_dead THEN 'dead' END)
       AND j.finished_at OPERATOR(pg_catalog.<) (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) older_than)
       AND (prune_jobs.queue IS NULL OR j.queue OPERATOR(pg_catalog.=) prune_jobs.queue);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit.prune_jobs(interval, text, boolean) IS
    'Deletes done and cancelled jobs (and dead ones with include_dead) that finished more than older_than ago, in one queue or all; returns how many. Run it from cron, e.g. prune_jobs(''7 days'').';

CREATE OR REPLACE FUNCTION pglockkit.claim_job(
    queue text, worker text, lease interval DEFAULT '5 minutes', batch integer DEFAULT 1)
RETURNS SETOF pglockkit.claimed_job
LANGUAGE plpgsql VOLATILE SECURITY DEFINER ROWS 1
SET search_path = pg_catalog, pg_temp
-- A generic plan, made once per session: under the default (auto) mode PL/pgSQL re-planned this
-- multi-CTE statement at every call, which cost more than executing it (measured: claim+complete
-- 0.46 -> 0.74 of the bare statements).
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := pg_catalog.clock_timestamp();
    v_keyed   boolean;
    v_expired boolean;
BEGIN
    -- (use_column: ON CONFLICT (queue, key) names columns; every parameter below is qualified.)
    -- The argument checks, as one expression when the arguments are good (each IF is an
    -- expression evaluation of its own); the statements inside say which one is bad.
    IF claim_job.queue IS NULL OR claim_job.queue OPERATOR(pg_catalog.=) ''
       OR claim_job.lease IS NULL OR claim_job.lease OPERATOR(pg_catalog.<=) interval '0'
       OR claim_job.lease OPERATOR(pg_catalog.>) interval '7 days'
       OR claim_job.worker IS NULL OR claim_job.batch IS NULL OR claim_job.worker OPERATOR(pg_catalog.=) ''
       OR claim_job.batch NOT BETWEEN 1 AND 1000 THEN
        IF claim_job.queue IS NULL THEN
            RAISE EXCEPTION 'queue must not be null' USING ERRCODE = 'null_value_not_allowed';
        END IF;
        IF claim_job.queue OPERATOR(pg_catalog.=) '' THEN
            RAISE EXCEPTION 'queue name must not be empty' USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF claim_job.lease IS NULL THEN
            RAISE EXCEPTION 'lease must not be null' USING ERRCODE = 'null_value_not_allowed';
        END IF;
        IF claim_job.lease OPERATOR(pg_catalog.<=) interval '0' THEN
            RAISE EXCEPTION 'lease must be positive, got %', claim_job.lease USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF claim_job.lease OPERATOR(pg_catalog.>) interval '7 days' THEN
            RAISE EXCEPTION 'lease % is out of range', claim_job.lease USING ERRCODE = 'numeric_value_out_of_range',
                HINT = 'Leases are at most 7 days; extend a long job''s lease with extend_job while it runs.';
        END IF;
        IF claim_job.worker IS NULL OR claim_job.batch IS NULL THEN
            RAISE EXCEPTION 'worker and batch must not be null' USING ERRCODE = 'null_value_not_allowed';
        END IF;
        IF claim_job.worker OPERATOR(pg_catalog.=) '' THEN
            RAISE EXCEPTION 'worker must not be empty' USING ERRCODE = 'invalid_parameter_value',
                HINT = 'Name the worker (e.g. host:pid) so that a stuck job says who had it.';
        END IF;
        IF claim_job.batch NOT BETWEEN 1 AND 1000 THEN
            RAISE EXCEPTION 'batch % is out of range', claim_job.batch
                USING ERRCODE = 'invalid_parameter_value', HINT = 'batch is 1 to 1000.';
        END IF;
    END IF;

    -- The common case first, as the bare statement. Batch 1, the usual worker loop: claim the
    -- first due job in claim order if it has no concurrency key and the queue has no expired lease
    -- (checked inside the statement, before any row is locked: the planner makes it a one-time
    -- filter). A keyed first job is locked but not claimed here, and the keyed path below runs
    -- (the lock lasts until the caller's transaction ends, at once for an autocommit claim; other
    -- claimers skip that job meanwhile). For one job this is what that path would pick, without
    -- its per-key bookkeeping, whether or not the queue has other keyed jobs.
    IF claim_job.batch OPERATOR(pg_catalog.=) 1
       AND pg_catalog.current_setting('server_version_num')::integer OPERATOR(pg_catalog.>=) 180000 THEN
        -- PostgreSQL 18 and later: the scan in claim order is the bare statement's. Its btree skip
        -- scan jumps over the entries of jobs_ready that are scheduled for later (run_at is an index
        -- condition under the skipped priority column), so the walk over priorities below is not
        -- needed, and cost a third of this function's own time. Checked at each call, not at
        -- install, so that a pg_upgrade to 18 takes this branch without a migration.
        RETURN QUERY
        UPDATE pglockkit.jobs j
           SET status = 'running', attempt = j.attempt OPERATOR(pg_catalog.+) 1, worker = claim_job.worker,
               token = pg_catalog.nextval('pglockkit.job_tokens'), lease_expires_at = v_now OPERATOR(pg_catalog.+) claim_job.lease,
               started_at = v_now
         WHERE j.id OPERATOR(pg_catalog.=) (
               SELECT r.id
                 FROM pglockkit.jobs r
                WHERE r.queue OPERATOR(pg_catalog.=) claim_job.queue AND r.status OPERATOR(pg_catalog.=) 'queued'
                  AND r.run_at OPERATOR(pg_catalog.<=) v_now
                ORDER BY r.priority DESC, r.run_at, r.id
                LIMIT 1
                  FOR UPDATE SKIP LOCKED)
           AND j.concurrency_key IS NULL
           AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                            WHERE e.queue OPERATOR(pg_catalog.=) claim_job.queue AND e.lease_expires_at OPERATOR(pg_catalog.<=) v_now)
        RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at;
    ELSIF claim_job.batch OPERATOR(pg_catalog.=) 1 THEN
        -- Before 18, first the queue's highest priority alone (one probe finds it): the common
        -- case, a queue whose top priority has a due job, costs two index probes and no walk.
        RETURN QUERY
        UPDATE pglockkit.jobs j
           SET status = 'running', attempt = j.attempt OPERATOR(pg_catalog.+) 1, worker = claim_job.worker,
               token = pg_catalog.nextval('pglockkit.job_tokens'), lease_expires_at = v_now OPERATOR(pg_catalog.+) claim_job.lease,
               started_at = v_now
         WHERE j.id OPERATOR(pg_catalog.=) (
               SELECT r.id
                 FROM pglockkit.jobs r
                WHERE r.queue OPERATOR(pg_catalog.=) claim_job.queue AND r.status OPERATOR(pg_catalog.=) 'queued'
                  AND r.priority OPERATOR(pg_catalog.=) (
                      SELECT t.priority FROM pglockkit.jobs t
                       WHERE t.queue OPERATOR(pg_catalog.=) claim_job.queue AND t.status OPERATOR(pg_catalog.=) 'queued'
                       ORDER BY t.priority DESC LIMIT 1)
                  AND r.run_at OPERATOR(pg_catalog.<=) v_now
                ORDER BY r.run_at, r.id
                LIMIT 1
                  FOR UPDATE SKIP LOCKED)
           AND j.concurrency_key IS NULL
           AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                            WHERE e.queue OPERATOR(pg_catalog.=) claim_job.queue AND e.lease_expires_at OPERATOR(pg_catalog.<=) v_now)
        RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at;
        IF NOT FOUND THEN
            -- The top priority has no due job free (or its first is keyed): walk the priorities.
            -- (Batches walk on every version: the walk's cost is shared by the batch.)
            RETURN QUERY
            WITH RECURSIVE
            -- The queue's priorities with queued jobs, highest first, one index probe each. Joined
            -- laterally to each priority's due jobs (run_at, id order) under a LIMIT, the rows come in
            -- claim order: the recursive union yields the priorities in the order it finds them, and
            -- the nested loop keeps that order (it cannot be another join: the subquery is lateral).
            priorities(priority) AS (
                (SELECT r.priority FROM pglockkit.jobs r
                  WHERE r.queue OPERATOR(pg_catalog.=) claim_job.queue AND r.status OPERATOR(pg_catalog.=) 'queued'
                  ORDER BY r.priority DESC LIMIT 1)
                UNION ALL
                SELECT (SELECT r.priority FROM pglockkit.jobs r
                         WHERE r.queue OPERATOR(pg_catalog.=) claim_job.queue AND r.status OPERATOR(pg_catalog.=) 'queued'
                           AND r.priority OPERATOR(pg_catalog.<) p.priority
                         ORDER BY r.priority DESC LIMIT 1)
                  FROM priorities p WHERE p.priority IS NOT NULL
            )
            UPDATE pglockkit.jobs j
               SET status = 'running', attempt = j.attempt OPERATOR(pg_catalog.+) 1, worker = claim_job.worker,
                   token = pg_catalog.nextval('pglockkit.job_tokens'), lease_expires_at = v_now OPERATOR(pg_catalog.+) claim_job.lease,
                   started_at = v_now
             WHERE j.id OPERATOR(pg_catalog.=) (
                   SELECT x.id
                     FROM priorities p CROSS JOIN LATERAL (
                          SELECT r.id
                            FROM pglockkit.jobs r
                           WHERE r.queue OPERATOR(pg_catalog.=) claim_job.queue AND r.status OPERATOR(pg_catalog.=) 'queued'
                             AND r.priority OPERATOR(pg_catalog.=) p.priority AND r.run_at OPERATOR(pg_catalog.<=) v_now
                           ORDER BY r.run_at, r.id
                           LIMIT 1
                             FOR UPDATE SKIP LOCKED) x
                    LIMIT 1)
               AND j.concurrency_key IS NULL
               AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                                WHERE e.queue OPERATOR(pg_catalog.=) claim_job.queue AND e.lease_expires_at OPERATOR(pg_catalog.<=) v_now)
            RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at;
        END IF;
    ELSE
        -- A batch: the first due jobs in claim order, if the queue has no concurrency keys (no job
        -- of it was ever enqueued with one; enqueue_job creates the key's row first) and no expired
        -- lease, then sorted into claim order.
        RETURN QUERY
        WITH RECURSIVE
        -- The queue's priorities with queued jobs, highest first, one index probe each.
        priorities(priority) AS (
            (SELECT r.priority FROM pglockkit.jobs r
              WHERE r.queue OPERATOR(pg_catalog.=) claim_job.queue AND r.status OPERATOR(pg_catalog.=) 'queued'
              ORDER BY r.priority DESC LIMIT 1)
            UNION ALL
            SELECT (SELECT r.priority FROM pglockkit.jobs r
                     WHERE r.queue OPERATOR(pg_catalog.=) claim_job.queue AND r.status OPERATOR(pg_catalog.=) 'queued'
                       AND r.priority OPERATOR(pg_catalog.<) p.priority
                     ORDER BY r.priority DESC LIMIT 1)
              FROM priorities p WHERE p.priority IS NOT NULL
        ), claimed AS (
            UPDATE pglockkit.jobs j
               SET status = 'running', attempt = j.attempt OPERATOR(pg_catalog.+) 1, worker = claim_job.worker,
                   token = pg_catalog.nextval('pglockkit.job_tokens'), lease_expires_at = v_now OPERATOR(pg_catalog.+) claim_job.lease,
                   started_at = v_now
             WHERE j.id OPERATOR(pg_catalog.=) ANY (ARRAY(
                   SELECT x.id
                     FROM priorities p CROSS JOIN LATERAL (
                          SELECT r.id
                            FROM pglockkit.jobs r
                           WHERE r.queue OPERATOR(pg_catalog.=) claim_job.queue AND r.status OPERATOR(pg_catalog.=) 'queued'
                             AND r.priority OPERATOR(pg_catalog.=) p.priority AND r.run_at OPERATOR(pg_catalog.<=) v_now
                             AND r.concurrency_key IS NULL
                           ORDER BY r.run_at, r.id
                           LIMIT claim_job.batch
                             FOR UPDATE SKIP LOCKED) x
                    LIMIT claim_job.batch))
               AND NOT EXISTS (SELECT FROM pglockkit.job_keys k WHERE k.queue OPERATOR(pg_catalog.=) claim_job.queue)
               AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                                WHERE e.queue OPERATOR(pg_catalog.=) claim_job.queue AND e.lease_expires_at OPERATOR(pg_catalog.<=) v_now)
            RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.priority, j.run_at
        )
        SELECT c.id, c.queue, c.payload, c.attempt, c.max_attempts, c.token, c.lease_expires_at
          FROM claimed c
         ORDER BY c.priority DESC, c.run_at, c.id;
    END IF;
    IF FOUND THEN
        RETURN;
    END IF;

    -- Nothing claimed: no job was due, or the queue has keys or expired leases. Which one?
    -- (Separate statements, so separate snapshots under READ COMMITTED: a lease found expired only
    -- now, or a key added only now, is handled here or by the next claim.)
    SELECT EXISTS (SELECT FROM pglockkit.job_keys k WHERE k.queue OPERATOR(pg_catalog.=) claim_job.queue),
           EXISTS (SELECT FROM pglockkit.jobs j
                    WHERE j.queue OPERATOR(pg_catalog.=) claim_job.queue AND j.lease_expires_at OPERATOR(pg_catalog.<=) v_now)
      INTO v_keyed, v_expired;
    IF NOT v_keyed AND NOT v_expired THEN
        RETURN;  -- no job due (or every due job is being claimed by someone else)
    END IF;

    IF NOT v_keyed THEN
        -- No job of this queue was ever enqueued with a concurrency key (enqueue_job creates the
        -- key's row first), but leases expired: reclaim them first, without the per-key
        -- bookkeeping. Keyed jobs are excluded anyway, should one be committed meanwhile.
        RETURN QUERY
        WITH RECURSIVE
        -- The queue's priorities with queued jobs, highest first, one index probe each.
        priorities(priority) AS (
            (SELECT r.priority FROM pglockkit.jobs r
              WHERE r.queue OPERATOR(pg_catalog.=) claim_job.queue AND r.status OPERATOR(pg_catalog.=) 'queued'
              ORDER BY r.priority DESC LIMIT 1)
            UNION ALL
            SELECT (SELECT r.priority FROM pglockkit.jobs r
                     WHERE r.queue OPERATOR(pg_catalog.=) claim_job.queue AND r.status OPERATOR(pg_catalog.=) 'queued'
                       AND r.priority OPERATOR(pg_catalog.<) p.priority
                     ORDER BY r.priority DESC LIMIT 1)
              FROM priorities p WHERE p.priority IS NOT NULL
        ), expired AS (
            SELECT j.id, j.attempt OPERATOR(pg_catalog.>=) j.max_attempts AS exhausted
              FROM pglockkit.jobs j
             WHERE j.queue OPERATOR(pg_catalog.=) claim_job.queue AND j.status OPERATOR(pg_catalog.=) 'running'
               AND j.lease_expires_at OPERATOR(pg_catalog.<=) v_now
             ORDER BY j.lease_expires_at
             LIMIT claim_job.batch
               FOR UPDATE SKIP LOCKED
        ), buried AS (
            UPDATE pglockkit.jobs j
               SET status = 'dead', last_error = 'lease expired', finished_at = v_now, lease_expires_at = NULL
              FROM expired e
             WHERE j.id OPERATOR(pg_catalog.=) e.id AND e.exhausted
        ), ready AS (
            SELECT x.id
              FROM priorities p CROSS JOIN LATERAL (
                   SELECT r.id
                     FROM pglockkit.jobs r
                    WHERE r.queue OPERATOR(pg_catalog.=) claim_job.queue AND r.status OPERATOR(pg_catalog.=) 'queued'
                      AND r.priority OPERATOR(pg_catalog.=) p.priority AND r.run_at OPERATOR(pg_catalog.<=) v_now
                      AND r.concurrency_key IS NULL
                    ORDER BY r.run_at, r.id
                    LIMIT claim_job.batch
                      FOR UPDATE SKIP LOCKED) x
             LIMIT claim_job.batch
        ), picked AS (
            SELECT c.id FROM (SELECT e.id, 0 AS rank FROM expired e WHERE NOT e.exhausted
                              UNION ALL SELECT r.id, 1 AS rank FROM ready r) c
             ORDER BY c.rank
             LIMIT claim_job.batch
        ), claimed AS (
            UPDATE pglockkit.jobs j
               SET status = 'running', attempt = j.attempt OPERATOR(pg_catalog.+) 1, worker = claim_job.worker,
                   token = pg_catalog.nextval('pglockkit.job_tokens'), lease_expires_at = v_now OPERATOR(pg_catalog.+) claim_job.lease,
                   started_at = v_now
             WHERE j.id OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT p.id FROM picked p))
            RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.priority, j.run_at
        )
        SELECT c.id, c.queue, c.payload, c.attempt, c.max_attempts, c.token, c.lease_expires_at
          FROM claimed c
         ORDER BY c.priority DESC, c.run_at, c.id;
        RETURN;
    END IF;

    -- One statement: expired leases first (their workers died or hung; a reclaim counts as an
    -- attempt, and on the last attempt the job goes dead), then due jobs in priority order.
    -- SKIP LOCKED: a row another claimer holds is skipped, never waited for.
    --
    -- Per-key concurrency: due jobs whose key is at its limit (by this statement's snapshot) are
    -- passed over; within the batch at most limit - running jobs per key are kept; then one
    -- upsert per key raises its running count only if the newest row version still has room
    -- (ON CONFLICT re-checks its WHERE after waiting for a concurrent claimer). Jobs of a key that
    -- got no room stay queued. A key with a job buried here (dead on its last attempt's expiry)
    -- is not claimed in the same call, so that each key's row changes at most once per statement.
    RETURN QUERY
    WITH RECURSIVE
    -- The queue's priorities with queued jobs, highest first, one index probe each.
    priorities(priority) AS (
        (SELECT r.priority FROM pglockkit.jobs r
          WHERE r.queue OPERATOR(pg_catalog.=) claim_job.queue AND r.status OPERATOR(pg_catalog.=) 'queued'
          ORDER BY r.priority DESC LIMIT 1)
        UNION ALL
        SELECT (SELECT r.priority FROM pglockkit.jobs r
                 WHERE r.queue OPERATOR(pg_catalog.=) claim_job.queue AND r.status OPERATOR(pg_catalog.=) 'queued'
                   AND r.priority OPERATOR(pg_catalog.<) p.priority
                 ORDER BY r.priority DESC LIMIT 1)
          FROM priorities p WHERE p.priority IS NOT NULL
    ), expired AS (
        SELECT j.id, j.attempt OPERATOR(pg_catalog.>=) j.max_attempts AS exhausted, j.concurrency_key
          FROM pglockkit.jobs j
         WHERE j.queue OPERATOR(pg_catalog.=) claim_job.queue AND j.status OPERATOR(pg_catalog.=) 'running'
           AND j.lease_expires_at OPERATOR(pg_catalog.<=) v_now
         ORDER BY j.lease_expires_at
         LIMIT claim_job.batch
           FOR UPDATE SKIP LOCKED
    ), buried AS (
        UPDATE pglockkit.jobs j
           SET status = 'dead', last_error = 'lease expired', finished_at = v_now, lease_expires_at = NULL
          FROM expired e
         WHERE j.id OPERATOR(pg_catalog.=) e.id AND e.exhausted
    ), ready AS (
        SELECT x.id, x.priority, x.run_at, x.concurrency_key, x.concurrency_limit
          FROM priorities p CROSS JOIN LATERAL (
               SELECT r.id, r.priority, r.run_at, r.concurrency_key, r.concurrency_limit
                 FROM pglockkit.jobs r
                WHERE r.queue OPERATOR(pg_catalog.=) claim_job.queue AND r.status OPERATOR(pg_catalog.=) 'queued'
                  AND r.priority OPERATOR(pg_catalog.=) p.priority AND r.run_at OPERATOR(pg_catalog.<=) v_now
                  AND (r.concurrency_key IS NULL OR NOT EXISTS (
                  SELECT FROM pglockkit.job_keys k
                   WHERE k.queue OPERATOR(pg_catalog.=) claim_job.queue AND k.key OPERATOR(pg_catalog.=) r.concurrency_key
                     AND k.running OPERATOR(pg_catalog.>=) r.concurrency_limit))
                ORDER BY r.run_at, r.id
                LIMIT claim_job.batch
                  FOR UPDATE SKIP LOCKED) x
         LIMIT claim_job.batch
    ), allowed AS (
        SELECT r.*, pg_catalog.row_number() OVER (ORDER BY r.priority DESC, r.run_at, r.id) AS pos
          FROM (SELECT r.*, pg_catalog.row_number() OVER (PARTITION BY r.concurrency_key
                                                       ORDER BY r.priority DESC, r.run_at, r.id) AS nth,
                       coalesce(k.running, 0) AS running_now
                  FROM ready r
                  LEFT JOIN pglockkit.job_keys k
                    ON k.queue OPERATOR(pg_catalog.=) claim_job.queue AND k.key OPERATOR(pg_catalog.=) r.concurrency_key) r
         WHERE r.concurrency_key IS NULL
            OR (r.nth OPERATOR(pg_catalog.<=) (r.concurrency_limit OPERATOR(pg_catalog.-) r.running_now)
                AND r.concurrency_key NOT IN (SELECT e.concurrency_key FROM expired e
                                               WHERE e.exhausted AND e.concurrency_key IS NOT NULL))
    ), kept AS (
        SELECT a.* FROM allowed a
         WHERE a.pos OPERATOR(pg_catalog.<=) (claim_job.batch OPERATOR(pg_catalog.-) (SELECT pg_catalog.count(*) FROM expired e WHERE NOT e.exhausted))
    ), unburied AS (
        UPDATE pglockkit.job_keys k
           SET running = k.running OPERATOR(pg_catalog.-) b.n
          FROM (SELECT e.concurrency_key AS key, pg_catalog.count(*)::int AS n
                  FROM expired e WHERE e.exhausted AND e.concurrency_key IS NOT NULL GROUP BY e.concurrency_key) b
         WHERE k.queue OPERATOR(pg_catalog.=) claim_job.queue AND k.key OPERATOR(pg_catalog.=) b.key
    ), reserved AS (
        INSERT INTO pglockkit.job_keys AS k (queue, key, running, lim)
        SELECT claim_job.queue, kk.concurrency_key, pg_catalog.count(*)::int, pg_catalog.min(kk.concurrency_limit)
          FROM kept kk WHERE kk.concurrency_key IS NOT NULL GROUP BY kk.concurrency_key
        ON CONFLICT (queue, key) DO UPDATE
           SET running = k.running OPERATOR(pg_catalog.+) excluded.running, lim = excluded.lim
         WHERE (k.running OPERATOR(pg_catalog.+) excluded.running) OPERATOR(pg_catalog.<=) excluded.lim
        RETURNING k.key
    ), picked AS (
        SELECT e.id, 0 AS rank, 0::int8 AS pos FROM expired e WHERE NOT e.exhausted
        UNION ALL
        SELECT kk.id, 1, kk.pos FROM kept kk
         WHERE kk.concurrency_key IS NULL OR kk.concurrency_key IN (SELECT rs.key FROM reserved rs)
    ), claimed AS (
        UPDATE pglockkit.jobs j
           SET status = 'running', attempt = j.attempt OPERATOR(pg_catalog.+) 1, worker = claim_job.worker,
               token = pg_catalog.nextval('pglockkit.job_tokens'), lease_expires_at = v_now OPERATOR(pg_catalog.+) claim_job.lease,
               started_at = v_now
         -- = ANY(array), not a join: the row estimates of the CTEs above are rough in a generic
         -- plan, and a join estimated at hundreds of rows turned into a hash join over the table.
         WHERE j.id OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT p.id FROM picked p))
        RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.priority, j.run_at
    )
    SELECT c.id, c.queue, c.payload, c.attempt, c.max_attempts, c.token, c.lease_expires_at
      FROM claimed c
     ORDER BY c.priority DESC, c.run_at, c.id;
END
$$;
COMMENT ON FUNCTION pglockkit.claim_job(text, text, interval, integer) IS
    'Claims up to batch (1..1000) jobs of queue for worker, with a lease; never waits on another claimer (SKIP LOCKED). Jobs whose lease expired are reclaimed first (counting an attempt; on the last attempt they go dead with "lease expired"), then due jobs by priority (higher first), run_at, id. Each row carries a new fencing token for complete_job / fail_job / extend_job / release_job.';
