-- pglockkit 0004: the job queue.
--
-- Workers claim jobs with FOR UPDATE SKIP LOCKED, so claimers never wait on each other and the
-- swarm stays parallel (seed 001). Every claim hands out a new fencing token and a lease; a job
-- whose lease expired is claimable again, and the old worker's complete/fail with its stale token
-- changes nothing. Finished jobs stay out of the claim path: every index the claim uses is
-- partial on the status it looks for.

CREATE SEQUENCE pglockkit.job_tokens AS bigint NO CYCLE;
COMMENT ON SEQUENCE pglockkit.job_tokens IS 'Fencing tokens of job claims: one per claim, never reused.';

CREATE TABLE pglockkit.jobs (
    id                bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue             text        NOT NULL CHECK (queue OPERATOR(pg_catalog.<>) ''),
    payload           jsonb       NOT NULL DEFAULT '{}',
    priority          integer     NOT NULL DEFAULT 0,
    run_at            timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    status            text        NOT NULL DEFAULT 'queued'
                                  CHECK (status IN ('queued', 'running', 'done', 'dead', 'cancelled')),
    attempt           integer     NOT NULL DEFAULT 0,
    max_attempts      integer     NOT NULL DEFAULT 5 CHECK (max_attempts BETWEEN 1 AND 1000),
    worker            text,
    token             bigint,
    lease_expires_at  timestamptz,
    dedup_key         text,
    concurrency_key   text        CHECK (concurrency_key OPERATOR(pg_catalog.<>) ''),
    concurrency_limit integer     CHECK (concurrency_limit BETWEEN 1 AND 10000),
    last_error        text,
    created_at        timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    started_at        timestamptz,
    finished_at       timestamptz,
    CHECK ((concurrency_key IS NULL) = (concurrency_limit IS NULL))
);
COMMENT ON TABLE pglockkit.jobs IS
    'The job queue. Write it through enqueue_job / claim_job / complete_job / fail_job / extend_job / release_job / cancel_job; read pglockkit.queue_stats.';

-- The claim path: due jobs in priority order, and expired leases. Both partial, so done, dead
-- and cancelled jobs (however many) are not in them.
CREATE INDEX jobs_ready ON pglockkit.jobs (queue, priority DESC, run_at, id) WHERE status = 'queued';
CREATE INDEX jobs_leases ON pglockkit.jobs (queue, lease_expires_at) WHERE status = 'running';
-- Dedup keys are unique among unfinished jobs of a queue.
CREATE UNIQUE INDEX jobs_dedup ON pglockkit.jobs (queue, dedup_key)
    WHERE dedup_key IS NOT NULL AND status IN ('queued', 'running');
-- Per-key concurrency: how many jobs of each (queue, concurrency key) run now. claim_job raises
-- the count with an upsert whose WHERE re-checks the limit on the newest row version, so two
-- claimers cannot both take the last slot; every way out of 'running' lowers it again.
CREATE TABLE pglockkit.job_keys (
    queue   text    NOT NULL,
    key     text    NOT NULL,
    running integer NOT NULL DEFAULT 0 CHECK (running OPERATOR(pg_catalog.>=) 0),
    lim     integer NOT NULL,
    PRIMARY KEY (queue, key)
);
COMMENT ON TABLE pglockkit.job_keys IS
    'Running jobs per (queue, concurrency key) and the key''s limit (the last one claimed with). Maintained by the queue functions.';

-- Pruning and history.
CREATE INDEX jobs_finished ON pglockkit.jobs (finished_at) WHERE status IN ('done', 'dead', 'cancelled');

CREATE TYPE pglockkit.claimed_job AS (
    id               bigint,
    queue            text,
    payload          jsonb,
    attempt          integer,
    max_attempts     integer,
    token            bigint,
    lease_expires_at timestamptz
);
COMMENT ON TYPE pglockkit.claimed_job IS
    'A job handed out by claim_job: pass id and token to complete_job / fail_job / extend_job / release_job.';

-- Constants of the queue live here, once. (Note: every OPERATOR(pg_catalog.x) has the same
-- precedence, so mixed arithmetic below is fully parenthesised.)
CREATE FUNCTION pglockkit._retry_delay(attempt integer) RETURNS interval
LANGUAGE sql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    -- Exponential backoff with "equal jitter": half of 2^(attempt-1) seconds fixed, half random,
    -- capped at one hour, so failing jobs spread out instead of retrying in lockstep.
    SELECT pg_catalog.make_interval(secs =>
        (d OPERATOR(pg_catalog./) 2) OPERATOR(pg_catalog.+) ((pg_catalog.random() OPERATOR(pg_catalog.*) d) OPERATOR(pg_catalog./) 2))
      FROM (SELECT LEAST(3600.0, pg_catalog.power(2.0, GREATEST(attempt, 1) OPERATOR(pg_catalog.-) 1))::float8 AS d) s
$$;
COMMENT ON FUNCTION pglockkit._retry_delay(integer) IS
    'Private: the pause before retry n of a failed job: d/2 + random()*d/2 with d = 2^(n-1) s, capped at 1 h.';

CREATE FUNCTION pglockkit._check_queue(queue text) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION 'queue must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF queue OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'queue name must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._check_queue(text) IS 'Private: 22004 for a NULL queue, 22023 for an empty one.';

CREATE FUNCTION pglockkit._check_lease(lease interval) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF lease IS NULL THEN
        RAISE EXCEPTION 'lease must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF lease OPERATOR(pg_catalog.<=) interval '0' THEN
        RAISE EXCEPTION 'lease must be positive, got %', lease USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF lease OPERATOR(pg_catalog.>) interval '7 days' THEN
        RAISE EXCEPTION 'lease % is out of range', lease USING ERRCODE = 'numeric_value_out_of_range',
            HINT = 'Leases are at most 7 days; extend a long job''s lease with extend_job while it runs.';
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._check_lease(interval) IS 'Private: a job lease must be positive and at most 7 days.';

CREATE FUNCTION pglockkit._job_not_found(id bigint) RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Called when an update by (id, token) matched nothing: an unknown id is an error, a known
    -- one means the token is stale or the job is no longer running (false: nothing changed).
    IF id IS NULL THEN
        RAISE EXCEPTION 'job id must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF NOT EXISTS (SELECT FROM pglockkit.jobs j WHERE j.id OPERATOR(pg_catalog.=) _job_not_found.id) THEN
        RAISE EXCEPTION 'no job with id %', id USING ERRCODE = 'undefined_object';
    END IF;
    RETURN false;
END
$$;
COMMENT ON FUNCTION pglockkit._job_not_found(bigint) IS
    'Private: 42704 for an unknown job id, else false (stale token or job not running).';

CREATE FUNCTION pglockkit._keys_left(queues text[], keys text[]) RETURNS void
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

CREATE FUNCTION pglockkit.enqueue_job(
    queue text, payload jsonb DEFAULT '{}', run_at timestamptz DEFAULT pg_catalog.now(), priority integer DEFAULT 0,
    dedup_key text DEFAULT NULL, max_attempts integer DEFAULT 5,
    concurrency_key text DEFAULT NULL, concurrency_limit integer DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_id bigint;
BEGIN
    -- (use_column: the ON CONFLICT target names columns; every parameter below is qualified.)
    PERFORM pglockkit._check_queue(enqueue_job.queue);
    IF enqueue_job.payload IS NULL OR enqueue_job.run_at IS NULL OR enqueue_job.priority IS NULL
       OR enqueue_job.max_attempts IS NULL THEN
        RAISE EXCEPTION 'payload, run_at, priority and max_attempts must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF enqueue_job.max_attempts NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'max_attempts % is out of range', enqueue_job.max_attempts
            USING ERRCODE = 'numeric_value_out_of_range', HINT = 'max_attempts is 1 to 1000.';
    END IF;
    IF (enqueue_job.concurrency_key IS NULL) OPERATOR(pg_catalog.<>) (enqueue_job.concurrency_limit IS NULL) THEN
        RAISE EXCEPTION 'concurrency_key and concurrency_limit go together' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Pass both (at most concurrency_limit jobs with this key run at once) or neither.';
    END IF;
    IF enqueue_job.concurrency_key OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'concurrency_key must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue_job.concurrency_limit NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'concurrency_limit % is out of range', enqueue_job.concurrency_limit
            USING ERRCODE = 'numeric_value_out_of_range', HINT = 'concurrency_limit is 1 to 10000.';
    END IF;
    IF enqueue_job.concurrency_key IS NOT NULL THEN
        -- The key's row exists before any job with the key: claim_job's plain path relies on it.
        INSERT INTO pglockkit.job_keys AS k (queue, key, running, lim)
        VALUES (enqueue_job.queue, enqueue_job.concurrency_key, 0, enqueue_job.concurrency_limit)
        ON CONFLICT DO NOTHING;
    END IF;
    LOOP
        INSERT INTO pglockkit.jobs AS j (queue, payload, run_at, priority, dedup_key, max_attempts,
                                         concurrency_key, concurrency_limit)
        VALUES (enqueue_job.queue, enqueue_job.payload, enqueue_job.run_at, enqueue_job.priority,
                enqueue_job.dedup_key, enqueue_job.max_attempts, enqueue_job.concurrency_key, enqueue_job.concurrency_limit)
        ON CONFLICT (queue, dedup_key) WHERE dedup_key IS NOT NULL AND status IN ('queued', 'running') DO NOTHING
        RETURNING j.id INTO v_id;
        IF v_id IS NOT NULL THEN
            PERFORM pg_catalog.pg_notify('pglockkit_jobs', enqueue_job.queue);
            RETURN v_id;
        END IF;
        -- A pending job has this dedup key: return it. (If it finished in between, insert again.)
        SELECT j.id INTO v_id FROM pglockkit.jobs j
         WHERE j.queue OPERATOR(pg_catalog.=) enqueue_job.queue AND j.dedup_key OPERATOR(pg_catalog.=) enqueue_job.dedup_key
           AND j.status IN ('queued', 'running');
        IF v_id IS NOT NULL THEN
            RETURN v_id;
        END IF;
    END LOOP;
END
$$;
COMMENT ON FUNCTION pglockkit.enqueue_job(text, jsonb, timestamptz, integer, text, integer, text, integer) IS
    'Adds a job and returns its id; NOTIFY pglockkit_jobs with the queue name wakes workers. A job is invisible until run_at. Higher priority is claimed first, then earlier run_at, then lower id. With a dedup_key, an unfinished (queued or running) job of the queue with that key is returned instead of a duplicate. With concurrency_key and concurrency_limit, at most that many jobs of the queue with that key run at once (other keys are not held up).';

CREATE FUNCTION pglockkit.enqueue_jobs(
    queue text, payloads jsonb[], run_at timestamptz DEFAULT pg_catalog.now(), priority integer DEFAULT 0,
    max_attempts integer DEFAULT 5)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_ids bigint[];
BEGIN
    PERFORM pglockkit._check_queue(enqueue_jobs.queue);
    IF payloads IS NULL OR pg_catalog.array_position(payloads, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'payloads must be an array without nulls' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF enqueue_jobs.run_at IS NULL OR enqueue_jobs.priority IS NULL OR enqueue_jobs.max_attempts IS NULL THEN
        RAISE EXCEPTION 'run_at, priority and max_attempts must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF enqueue_jobs.max_attempts NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'max_attempts % is out of range', enqueue_jobs.max_attempts
            USING ERRCODE = 'numeric_value_out_of_range', HINT = 'max_attempts is 1 to 1000.';
    END IF;
    WITH inserted AS (
        INSERT INTO pglockkit.jobs (queue, payload, run_at, priority, max_attempts)
        SELECT enqueue_jobs.queue, p.payload, enqueue_jobs.run_at, enqueue_jobs.priority, enqueue_jobs.max_attempts
          FROM pg_catalog.unnest(payloads) WITH ORDINALITY AS p(payload, n)
         ORDER BY p.n
        RETURNING id
    )
    SELECT pg_catalog.array_agg(i.id ORDER BY i.id) INTO v_ids FROM inserted i;
    IF v_ids IS NOT NULL THEN
        PERFORM pg_catalog.pg_notify('pglockkit_jobs', enqueue_jobs.queue);
    END IF;
    RETURN coalesce(v_ids, '{}');
END
$$;
COMMENT ON FUNCTION pglockkit.enqueue_jobs(text, jsonb[], timestamptz, integer, integer) IS
    'Adds one job per payload in one statement (ids in payload order) and notifies once.';

CREATE FUNCTION pglockkit.claim_job(
    queue text, worker text, lease interval DEFAULT '5 minutes', batch integer DEFAULT 1)
RETURNS SETOF pglockkit.claimed_job
LANGUAGE plpgsql VOLATILE SECURITY DEFINER ROWS 1
SET search_path = pg_catalog, pg_temp
-- A generic plan, made once per session: under the default (auto) mode PL/pgSQL re-planned this
-- multi-CTE statement at every call, which cost more than executing it (measured: claim+complete
-- 0.46 -> 0.74 of the bare statements).
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := pg_catalog.clock_timestamp();
BEGIN
    -- (use_column: ON CONFLICT (queue, key) names columns; every parameter below is qualified.)
    PERFORM pglockkit._check_queue(claim_job.queue);
    PERFORM pglockkit._check_lease(claim_job.lease);
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

    IF NOT EXISTS (SELECT FROM pglockkit.job_keys k WHERE k.queue OPERATOR(pg_catalog.=) claim_job.queue) THEN
        -- No job of this queue was ever enqueued with a concurrency key (enqueue_job creates the
        -- key's row first): the plain claim, without the per-key bookkeeping, which costs a fifth
        -- of the throughput. Keyed jobs are excluded anyway, should one be committed meanwhile.
        RETURN QUERY
        WITH expired AS (
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
            SELECT j.id
              FROM pglockkit.jobs j
             WHERE j.queue OPERATOR(pg_catalog.=) claim_job.queue AND j.status OPERATOR(pg_catalog.=) 'queued'
               AND j.run_at OPERATOR(pg_catalog.<=) v_now AND j.concurrency_key IS NULL
             ORDER BY j.priority DESC, j.run_at, j.id
             LIMIT claim_job.batch
               FOR UPDATE SKIP LOCKED
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
    WITH expired AS (
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
        SELECT j.id, j.priority, j.run_at, j.concurrency_key, j.concurrency_limit
          FROM pglockkit.jobs j
         WHERE j.queue OPERATOR(pg_catalog.=) claim_job.queue AND j.status OPERATOR(pg_catalog.=) 'queued'
           AND j.run_at OPERATOR(pg_catalog.<=) v_now
           AND (j.concurrency_key IS NULL OR NOT EXISTS (
                SELECT FROM pglockkit.job_keys k
                 WHERE k.queue OPERATOR(pg_catalog.=) claim_job.queue AND k.key OPERATOR(pg_catalog.=) j.concurrency_key
                   AND k.running OPERATOR(pg_catalog.>=) j.concurrency_limit))
         ORDER BY j.priority DESC, j.run_at, j.id
         LIMIT claim_job.batch
           FOR UPDATE SKIP LOCKED
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

CREATE FUNCTION pglockkit.complete_job(id bigint, token bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_queue text;
    v_key   text;
BEGIN
    UPDATE pglockkit.jobs j
       SET status = 'done', finished_at = pg_catalog.clock_timestamp(), lease_expires_at = NULL
     WHERE j.id OPERATOR(pg_catalog.=) complete_job.id AND j.token OPERATOR(pg_catalog.=) complete_job.token
       AND j.status OPERATOR(pg_catalog.=) 'running'
    RETURNING j.queue, j.concurrency_key INTO v_queue, v_key;
    IF NOT FOUND THEN
        RETURN pglockkit._job_not_found(complete_job.id);
    END IF;
    IF v_key IS NOT NULL THEN
        PERFORM pglockkit._keys_left(ARRAY[v_queue], ARRAY[v_key]);
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.complete_job(bigint, bigint) IS
    'Marks a running job done. True if token is the job''s current claim; false (nothing changed) if the token is stale (the job was reclaimed) or the job is not running; 42704 for an unknown id.';

CREATE FUNCTION pglockkit.complete_jobs(ids bigint[], tokens bigint[]) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_done   integer;
    v_queues text[];
    v_keys   text[];
BEGIN
    IF ids IS NULL OR tokens IS NULL THEN
        RAISE EXCEPTION 'ids and tokens must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF pg_catalog.cardinality(ids) OPERATOR(pg_catalog.<>) pg_catalog.cardinality(tokens) THEN
        RAISE EXCEPTION 'ids and tokens differ in length (% and %)', pg_catalog.cardinality(ids), pg_catalog.cardinality(tokens)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    WITH done AS (
        UPDATE pglockkit.jobs j
           SET status = 'done', finished_at = pg_catalog.clock_timestamp(), lease_expires_at = NULL
          FROM ROWS FROM (pg_catalog.unnest(ids), pg_catalog.unnest(tokens)) AS c(id, token)
         WHERE j.id OPERATOR(pg_catalog.=) c.id AND j.token OPERATOR(pg_catalog.=) c.token
           AND j.status OPERATOR(pg_catalog.=) 'running'
        RETURNING j.queue, j.concurrency_key
    )
    SELECT pg_catalog.count(*)::int, pg_catalog.array_agg(d.queue), pg_catalog.array_agg(d.concurrency_key)
      INTO v_done, v_queues, v_keys
      FROM done d;
    IF v_done OPERATOR(pg_catalog.>) 0 THEN
        PERFORM pglockkit._keys_left(v_queues, v_keys);
    END IF;
    RETURN v_done;
END
$$;
COMMENT ON FUNCTION pglockkit.complete_jobs(bigint[], bigint[]) IS
    'Completes many claimed jobs in one statement (one commit for a whole batch); returns how many (id, token) pairs were current. Stale or unknown pairs are skipped.';

CREATE FUNCTION pglockkit.fail_job(id bigint, token bigint, error text, retry_in interval DEFAULT NULL) RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_now    timestamptz := pg_catalog.clock_timestamp();
    v_status text;
    v_queue  text;
    v_key    text;
BEGIN
    IF retry_in IS NOT NULL AND retry_in OPERATOR(pg_catalog.<) interval '0' THEN
        RAISE EXCEPTION 'retry_in must not be negative, got %', retry_in USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE pglockkit.jobs j
       SET status = CASE WHEN j.attempt OPERATOR(pg_catalog.>=) j.max_attempts THEN 'dead' ELSE 'queued' END,
           run_at = CASE WHEN j.attempt OPERATOR(pg_catalog.>=) j.max_attempts THEN j.run_at
                         ELSE v_now OPERATOR(pg_catalog.+) coalesce(retry_in, pglockkit._retry_delay(j.attempt)) END,
           finished_at = CASE WHEN j.attempt OPERATOR(pg_catalog.>=) j.max_attempts THEN v_now END,
           last_error = fail_job.error, lease_expires_at = NULL
     WHERE j.id OPERATOR(pg_catalog.=) fail_job.id AND j.token OPERATOR(pg_catalog.=) fail_job.token
       AND j.status OPERATOR(pg_catalog.=) 'running'
    RETURNING j.status, j.queue, j.concurrency_key INTO v_status, v_queue, v_key;
    IF v_status IS NULL THEN
        PERFORM pglockkit._job_not_found(fail_job.id);
        RETURN 'stale';
    END IF;
    IF v_key IS NOT NULL THEN
        PERFORM pglockkit._keys_left(ARRAY[v_queue], ARRAY[v_key]);
    END IF;
    RETURN v_status;
END
$$;
COMMENT ON FUNCTION pglockkit.fail_job(bigint, bigint, text, interval) IS
    'Records a failed attempt: returns ''queued'' (retried after retry_in, else exponential backoff with jitter), ''dead'' (that was the last attempt; kept for inspection and retry_dead_jobs), or ''stale'' (token not current: nothing changed).';

CREATE FUNCTION pglockkit.extend_job(id bigint, token bigint, lease interval) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    PERFORM pglockkit._check_lease(extend_job.lease);
    UPDATE pglockkit.jobs j
       SET lease_expires_at = pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) extend_job.lease
     WHERE j.id OPERATOR(pg_catalog.=) extend_job.id AND j.token OPERATOR(pg_catalog.=) extend_job.token
       AND j.status OPERATOR(pg_catalog.=) 'running';
    RETURN FOUND OR pglockkit._job_not_found(extend_job.id);
END
$$;
COMMENT ON FUNCTION pglockkit.extend_job(bigint, bigint, interval) IS
    'Heartbeat: the job''s lease now ends lease from now. False if the token is stale: stop working on it.';

CREATE FUNCTION pglockkit.release_job(id bigint, token bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_queue text;
    v_key   text;
BEGIN
    UPDATE pglockkit.jobs j
       SET status = 'queued', attempt = j.attempt OPERATOR(pg_catalog.-) 1, lease_expires_at = NULL,
           run_at = LEAST(j.run_at, pg_catalog.clock_timestamp())
     WHERE j.id OPERATOR(pg_catalog.=) release_job.id AND j.token OPERATOR(pg_catalog.=) release_job.token
       AND j.status OPERATOR(pg_catalog.=) 'running'
    RETURNING j.queue, j.concurrency_key INTO v_queue, v_key;
    IF NOT FOUND THEN
        RETURN pglockkit._job_not_found(release_job.id);
    END IF;
    IF v_key IS NOT NULL THEN
        PERFORM pglockkit._keys_left(ARRAY[v_queue], ARRAY[v_key]);
    END IF;
    PERFORM pg_catalog.pg_notify('pglockkit_jobs', v_queue);
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.release_job(bigint, bigint) IS
    'Gives a claimed job back unstarted (a worker shutting down): queued again at once, the attempt not counted. False if the token is stale.';

CREATE FUNCTION pglockkit.cancel_job(id bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_queue text;
    v_key   text;
BEGIN
    WITH old AS (
        SELECT j.id, j.status FROM pglockkit.jobs j
         WHERE j.id OPERATOR(pg_catalog.=) cancel_job.id AND j.status IN ('queued', 'running')
           FOR UPDATE
    )
    UPDATE pglockkit.jobs j
       SET status = 'cancelled', finished_at = pg_catalog.clock_timestamp(), lease_expires_at = NULL
      FROM old
     WHERE j.id OPERATOR(pg_catalog.=) old.id
    RETURNING j.queue, CASE WHEN old.status OPERATOR(pg_catalog.=) 'running' THEN j.concurrency_key END
         INTO v_queue, v_key;
    IF NOT FOUND THEN
        RETURN pglockkit._job_not_found(cancel_job.id);
    END IF;
    IF v_key IS NOT NULL THEN
        PERFORM pglockkit._keys_left(ARRAY[v_queue], ARRAY[v_key]);
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.cancel_job(bigint) IS
    'Cancels a queued or running job (a running job''s worker then gets false from complete_job). False if it had already finished; 42704 for an unknown id.';

CREATE FUNCTION pglockkit.retry_dead_jobs(queue text, ids bigint[] DEFAULT NULL) RETURNS integer
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

CREATE FUNCTION pglockkit.prune_jobs(older_than interval, queue text DEFAULT NULL, include_dead boolean DEFAULT false)
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

CREATE VIEW pglockkit.queue_stats AS
SELECT j.queue,
       pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'queued' AND j.run_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()) AS ready,
       pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'queued' AND j.run_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()) AS scheduled,
       pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'running') AS running,
       pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'running' AND j.lease_expires_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()) AS expired_leases,
       pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'done') AS done,
       pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'dead') AS dead,
       pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'cancelled') AS cancelled,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-)
           pg_catalog.min(j.run_at) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'queued' AND j.run_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()) AS oldest_ready_age,
       pg_catalog.count(*) FILTER (WHERE j.finished_at OPERATOR(pg_catalog.>) (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) interval '1 minute')
                                    AND j.status OPERATOR(pg_catalog.=) 'done') AS done_last_minute
  FROM pglockkit.jobs j
 GROUP BY j.queue;
COMMENT ON VIEW pglockkit.queue_stats IS
    'Per queue: jobs ready, scheduled for later, running, with expired leases (workers gone), done, dead, cancelled; the age of the oldest ready job (lag) and jobs done in the last minute. Scans the table: for dashboards, not hot paths.';

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;
