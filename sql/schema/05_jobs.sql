-- Jobs: the queue
--
-- The current definition of each object, once. A change edits this file and adds a delta
-- migration (see CONTRIBUTING.md); a test checks that both build the same schema.

CREATE SEQUENCE pglockkit.job_tokens AS bigint MAXVALUE 140737488355327 NO CYCLE;
COMMENT ON SEQUENCE pglockkit.job_tokens IS 'The low 47 bits of job claims'' fencing tokens (_next_token puts the epoch above them): one per claim, never reused.';

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
    rate_key          text,
    CHECK ((concurrency_key IS NULL) = (concurrency_limit IS NULL)),
    CONSTRAINT jobs_queue_length CHECK (pg_catalog.octet_length(queue) OPERATOR(pg_catalog.<=) 1024),
    CONSTRAINT jobs_dedup_key_length CHECK (pg_catalog.octet_length(dedup_key) OPERATOR(pg_catalog.<=) 1024),
    CONSTRAINT jobs_concurrency_key_length CHECK (pg_catalog.octet_length(concurrency_key) OPERATOR(pg_catalog.<=) 1024)
    -- rate_key (non-empty, at most 1024 bytes) is checked by enqueue_job and enqueue_jobs, its only
    -- writers, not by a constraint: every claim and completion updates the row and would evaluate
    -- it again, while the enqueue checks it once.
);
COMMENT ON TABLE pglockkit.jobs IS
    'The job queue. Write it through enqueue_job / claim_job / complete_job / fail_job / extend_job / release_job / cancel_job; read pglockkit.queue_stats.';

-- The claim path: due jobs in priority order, and expired leases. Both partial, so done, dead
-- and cancelled jobs (however many) are not in them.
CREATE INDEX jobs_ready ON pglockkit.jobs (queue, priority DESC, run_at, id) WHERE status = 'queued';

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
    PRIMARY KEY (queue, key),
    CONSTRAINT job_keys_queue_length CHECK (pg_catalog.octet_length(queue) OPERATOR(pg_catalog.<=) 1024),
    CONSTRAINT job_keys_key_length CHECK (pg_catalog.octet_length(key) OPERATOR(pg_catalog.<=) 1024)
);
COMMENT ON TABLE pglockkit.job_keys IS
    'Running jobs per (queue, concurrency key) and the limit that governed the key''s last claim (the smallest concurrency_limit among its unfinished jobs). Maintained by the queue functions; prune_jobs deletes the rows of keys with no queued or running job.';

-- Per-key rate limits (GCRA, the generic cell rate algorithm): one row per limited (queue, rate
-- key), set by set_rate_limit. tat, the key's theoretical arrival time, is how far ahead of the
-- clock the key's past claims have run: a claim at time t may take n jobs of the key when
-- max(tat, t) + n * step <= t + burst * step, and moves tat to max(tat, t) + n * step. claim_job
-- does this on the row it locked (FOR NO KEY UPDATE SKIP LOCKED) in the statement that claims the
-- jobs, so two claimers cannot both take the last token, and no claimer waits for the row. In any
-- window of length w, a key's claims number at most burst + w / step.
CREATE TABLE pglockkit.job_rates (
    queue text        NOT NULL,
    key   text        NOT NULL,
    rate  integer     NOT NULL CONSTRAINT job_rates_rate_positive CHECK (rate OPERATOR(pg_catalog.>) 0),
    per   interval    NOT NULL,
    burst integer     NOT NULL CONSTRAINT job_rates_burst_range CHECK (burst BETWEEN 1 AND 1000000),
    step  interval    NOT NULL,
    tat   timestamptz NOT NULL,
    PRIMARY KEY (queue, key),
    CONSTRAINT job_rates_queue_length CHECK (pg_catalog.octet_length(queue) OPERATOR(pg_catalog.<=) 1024),
    CONSTRAINT job_rates_key_length CHECK (pg_catalog.octet_length(key) OPERATOR(pg_catalog.<=) 1024)
);
COMMENT ON TABLE pglockkit.job_rates IS
    'Rate limits per (queue, rate key): rate jobs per per, bursts of up to burst; step is per / rate rounded up to a whole microsecond, tat the key''s theoretical arrival time (GCRA). Written by set_rate_limit / remove_rate_limit and claim_job; read pglockkit.rate_limits.';

-- The due jobs of a rate key (rate_limits counts them) and nothing else: jobs without a rate key
-- are not in it.
CREATE INDEX jobs_rate_keys ON pglockkit.jobs (queue, rate_key) WHERE rate_key IS NOT NULL AND status = 'queued';

-- Paused queues: claim_job claims no job of a queue with a row here.
CREATE TABLE pglockkit.paused_queues (
    queue     text        PRIMARY KEY,
    paused_at timestamptz NOT NULL,
    paused_by text        NOT NULL,
    CONSTRAINT paused_queues_queue_length CHECK (pg_catalog.octet_length(queue) OPERATOR(pg_catalog.<=) 1024)
);
COMMENT ON TABLE pglockkit.paused_queues IS
    'The paused queues, with when and by whom (session user). Written by pause_queue / resume_queue; queue_stats shows paused.';

-- Pruning and history.
CREATE INDEX jobs_finished ON pglockkit.jobs (finished_at) WHERE status IN ('done', 'dead', 'cancelled');

CREATE TYPE pglockkit.claimed_job AS (
    id               bigint,
    queue            text,
    payload          jsonb,
    attempt          integer,
    max_attempts     integer,
    token            bigint,
    lease_expires_at timestamptz,
    concurrency_key  text
);
COMMENT ON TYPE pglockkit.claimed_job IS
    'A job handed out by claim_job: pass id and token to complete_job / fail_job / extend_job / release_job. concurrency_key is the job''s (NULL if none): a transaction that records outcomes of keyed jobs in several statements orders them by (queue, concurrency_key) COLLATE "C", the order the queue functions lock key rows in.';

CREATE INDEX jobs_leases ON pglockkit.jobs (queue, lease_expires_at) WHERE lease_expires_at IS NOT NULL;

-- The smallest limit among a key's unfinished jobs, and whether a key has any: one index probe.
CREATE INDEX jobs_keys ON pglockkit.jobs (queue, concurrency_key, concurrency_limit)
    WHERE concurrency_key IS NOT NULL AND status IN ('queued', 'running');

CREATE TABLE pglockkit.config (
    singleton         boolean PRIMARY KEY DEFAULT true CONSTRAINT config_one_row CHECK (singleton),
    max_payload_bytes integer NOT NULL DEFAULT 1048576
                      CONSTRAINT config_max_payload_bytes_range CHECK (max_payload_bytes BETWEEN 4096 AND 268435455)
);
COMMENT ON TABLE pglockkit.config IS
    'pglockkit''s settings: one row. Change them with the set_* functions (pglockkit_admin); read them in pglockkit.settings.';

INSERT INTO pglockkit.config DEFAULT VALUES;

-- Constants of the queue live here, once.
CREATE FUNCTION pglockkit._longest_job_lease() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN interval '7 days';
COMMENT ON FUNCTION pglockkit._longest_job_lease() IS
    'Private: the longest job lease pglockkit accepts, 7 days (a long job extends its lease while it runs).';

CREATE FUNCTION pglockkit._retry_delay(attempt integer) RETURNS interval
LANGUAGE sql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    -- Exponential backoff with "equal jitter": half of 2^(attempt-1) seconds fixed, half random,
    -- capped at one hour, so failing jobs spread out instead of retrying in lockstep.
    SELECT pg_catalog.make_interval(secs =>
        (d / 2) + ((pg_catalog.random() * d) / 2))
      FROM (SELECT LEAST(3600.0, pg_catalog.power(2.0, GREATEST(attempt, 1) - 1))::float8 AS d) s
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
    IF queue = '' THEN
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
    -- Positive in effect too: with calendar months, '-2 mon 61 days' compares as positive but can
    -- move the clock back, a lease expired when it is given (0013). The sum only within range:
    -- '300000 years' would overflow the timestamp (22008) (0015).
    IF lease <= interval '0'
       OR (lease <= pglockkit._longest_job_lease()
           AND pg_catalog.statement_timestamp() + lease <= pg_catalog.statement_timestamp()) THEN
        RAISE EXCEPTION 'lease must be positive, got %', lease USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF lease > pglockkit._longest_job_lease() THEN
        RAISE EXCEPTION 'lease % is out of range', lease USING ERRCODE = 'numeric_value_out_of_range',
            HINT = pg_catalog.format('Leases are at most %s; extend a long job''s lease with extend_job while it runs.',
                                     pglockkit._longest_job_lease());
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
    IF NOT EXISTS (SELECT FROM pglockkit.jobs j WHERE j.id = _job_not_found.id) THEN
        RAISE EXCEPTION 'no job with id %', id
            USING ERRCODE = 'undefined_object', SCHEMA = 'pglockkit', TABLE = 'jobs';
    END IF;
    RETURN false;
END
$$;
COMMENT ON FUNCTION pglockkit._job_not_found(bigint) IS
    'Private: 42704 for an unknown job id (its TABLE field says jobs), else false (stale token or job not running).';

CREATE FUNCTION pglockkit._keys_left(queues text[], keys text[]) RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    -- Jobs (one array entry each; NULL keys ignored) of these queues and concurrency keys
    -- stopped running. One UPDATE, each key's row once, the rows locked in (queue, key) order
    -- first: two transactions lowering the counts of the same keys wait for each other in one
    -- order, never in a cycle. (Claims do not wait for key rows at all.) The order is bytewise
    -- (COLLATE "C"), whatever the database's collation, so that a client can sort keys the same
    -- way (code points) and record outcomes over several statements in it: the worker does.
    WITH left_keys AS (
        SELECT x.queue, x.key, pg_catalog.count(*)::int AS n
          FROM ROWS FROM (pg_catalog.unnest(queues), pg_catalog.unnest(keys)) AS x(queue, key)
         WHERE x.key IS NOT NULL GROUP BY x.queue, x.key
    ), locked AS (
        SELECT k.queue, k.key, g.n
          FROM pglockkit.job_keys k
          JOIN left_keys g ON k.queue = g.queue AND k.key = g.key
         ORDER BY k.queue COLLATE "C", k.key COLLATE "C"
           FOR NO KEY UPDATE OF k
    )
    UPDATE pglockkit.job_keys k
       SET running = k.running - l.n
      FROM locked l
     WHERE k.queue = l.queue AND k.key = l.key
$$;
COMMENT ON FUNCTION pglockkit._keys_left(text[], text[]) IS
    'Private: lowers the running counts of per-key concurrency when jobs with these (queue, key) pairs leave ''running''; locks the rows in (queue, key) order, bytewise (COLLATE "C").';

CREATE FUNCTION pglockkit._lock_jobs(ids bigint[], tokens bigint[]) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    -- Locks the running jobs of these (id, token) pairs, in id order, waiting for each, before a
    -- caller writes their rows and their keys' rows. A row whose token went stale while this ran
    -- is locked too: PostgreSQL locks the newest version of a row updated since the snapshot
    -- before it rechecks it, and keeps the lock to the end of the transaction. Two transactions
    -- that lock job rows in id order, and key rows (_keys_left) only after them, never wait for
    -- each other in a cycle; in the order of their arrays, a caller whose leases expired while it
    -- ran and the claimer that had reclaimed its jobs each held a row the other waited for.
    PERFORM
       FROM pglockkit.jobs j
       JOIN ROWS FROM (pg_catalog.unnest(ids), pg_catalog.unnest(tokens)) AS c(id, token)
         ON j.id = c.id AND j.token = c.token
      WHERE j.status = 'running'
      ORDER BY j.id
        FOR NO KEY UPDATE OF j;
END
$$;
COMMENT ON FUNCTION pglockkit._lock_jobs(bigint[], bigint[]) IS
    'Private: locks the running jobs of these (id, token) pairs in id order, waiting for each: what complete_jobs does in its one statement, for a worker''s group that records its outcomes in several, so that job rows are always locked in one order and before key rows.';

CREATE FUNCTION pglockkit.enqueue_job(
    queue text, payload jsonb DEFAULT '{}', run_at timestamptz DEFAULT pg_catalog.now(), priority integer DEFAULT 0,
    dedup_key text DEFAULT NULL, max_attempts integer DEFAULT 5,
    concurrency_key text DEFAULT NULL, concurrency_limit integer DEFAULT NULL, rate_key text DEFAULT NULL)
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
    IF NOT pg_catalog.isfinite(enqueue_job.run_at) THEN
        RAISE EXCEPTION 'run_at must be a finite time, got %', enqueue_job.run_at USING ERRCODE = 'invalid_parameter_value',
            HINT = 'A job due now takes now(); one that should never run is not enqueued (or is cancelled).';
    END IF;
    -- The payload limit: read only for a payload over its smallest value, or compressed.
    IF pg_catalog.pg_column_size(enqueue_job.payload) > 4096
       OR pg_catalog.pg_column_compression(enqueue_job.payload) IS NOT NULL THEN
        PERFORM pglockkit._check_payloads(ARRAY[enqueue_job.payload]);
    END IF;
    IF enqueue_job.max_attempts NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'max_attempts % is out of range', enqueue_job.max_attempts
            USING ERRCODE = 'numeric_value_out_of_range', HINT = 'max_attempts is 1 to 1000.';
    END IF;
    IF (enqueue_job.concurrency_key IS NULL) <> (enqueue_job.concurrency_limit IS NULL) THEN
        RAISE EXCEPTION 'concurrency_key and concurrency_limit go together' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Pass both (at most concurrency_limit jobs with this key run at once) or neither.';
    END IF;
    IF enqueue_job.concurrency_key = '' THEN
        RAISE EXCEPTION 'concurrency_key must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue_job.concurrency_limit NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'concurrency_limit % is out of range', enqueue_job.concurrency_limit
            USING ERRCODE = 'numeric_value_out_of_range', HINT = 'concurrency_limit is 1 to 10000.';
    END IF;
    IF pg_catalog.octet_length(enqueue_job.rate_key) > 1024 THEN
        RAISE EXCEPTION 'rate_key is % bytes, over 1024', pg_catalog.octet_length(enqueue_job.rate_key)
            USING ERRCODE = 'check_violation', HINT = 'A rate key is at most 1024 bytes, like a queue name.';
    END IF;
    IF enqueue_job.rate_key = '' THEN
        RAISE EXCEPTION 'rate_key must not be empty' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Pass NULL for a job without a rate key.';
    END IF;
    IF enqueue_job.concurrency_key IS NOT NULL THEN
        -- The key's row exists before any job with the key: claim_job's plain path relies on it.
        INSERT INTO pglockkit.job_keys AS k (queue, key, running, lim)
        VALUES (enqueue_job.queue, enqueue_job.concurrency_key, 0, enqueue_job.concurrency_limit)
        ON CONFLICT DO NOTHING;
    END IF;
    LOOP
        INSERT INTO pglockkit.jobs AS j (queue, payload, run_at, priority, dedup_key, max_attempts,
                                         concurrency_key, concurrency_limit, rate_key)
        VALUES (enqueue_job.queue, enqueue_job.payload, enqueue_job.run_at, enqueue_job.priority,
                enqueue_job.dedup_key, enqueue_job.max_attempts, enqueue_job.concurrency_key, enqueue_job.concurrency_limit,
                enqueue_job.rate_key)
        ON CONFLICT (queue, dedup_key) WHERE dedup_key IS NOT NULL AND status IN ('queued', 'running') DO NOTHING
        RETURNING j.id INTO v_id;
        IF v_id IS NOT NULL THEN
            PERFORM pg_catalog.pg_notify('pglockkit_jobs', enqueue_job.queue);
            RETURN v_id;
        END IF;
        -- A pending job has this dedup key: return it. (If it finished in between, insert again.)
        SELECT j.id INTO v_id FROM pglockkit.jobs j
         WHERE j.queue = enqueue_job.queue AND j.dedup_key = enqueue_job.dedup_key
           AND j.status IN ('queued', 'running');
        IF v_id IS NOT NULL THEN
            RETURN v_id;
        END IF;
    END LOOP;
END
$$;
COMMENT ON FUNCTION pglockkit.enqueue_job(text, jsonb, timestamptz, integer, text, integer, text, integer, text) IS
    'Adds a job and returns its id; NOTIFY pglockkit_jobs with the queue name wakes workers. A job is invisible until run_at. Higher priority is claimed first, then earlier run_at, then lower id. With a dedup_key, an unfinished (queued or running) job of the queue with that key is returned instead of a duplicate. With concurrency_key and concurrency_limit, at most that many jobs of the queue with that key run at once (other keys are not held up). With a rate_key, claims of the queue''s jobs with that key follow the key''s rate limit (set_rate_limit; none set: no limit); an empty rate_key is 22023. run_at must be finite (22023); a payload over max_payload_bytes (pglockkit.settings) is refused with 54000.';

CREATE FUNCTION pglockkit.enqueue_jobs(
    queue text, payloads jsonb[], run_at timestamptz DEFAULT pg_catalog.now(), priority integer DEFAULT 0,
    max_attempts integer DEFAULT 5, rate_key text DEFAULT NULL)
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
    IF NOT pg_catalog.isfinite(enqueue_jobs.run_at) THEN
        RAISE EXCEPTION 'run_at must be a finite time, got %', enqueue_jobs.run_at USING ERRCODE = 'invalid_parameter_value',
            HINT = 'A job due now takes now(); one that should never run is not enqueued (or is cancelled).';
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.unnest(payloads) AS p(payload)
                WHERE pg_catalog.pg_column_size(p.payload) > 4096
                   OR pg_catalog.pg_column_compression(p.payload) IS NOT NULL) THEN
        PERFORM pglockkit._check_payloads(payloads);
    END IF;
    IF enqueue_jobs.max_attempts NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'max_attempts % is out of range', enqueue_jobs.max_attempts
            USING ERRCODE = 'numeric_value_out_of_range', HINT = 'max_attempts is 1 to 1000.';
    END IF;
    IF pg_catalog.octet_length(enqueue_jobs.rate_key) > 1024 THEN
        RAISE EXCEPTION 'rate_key is % bytes, over 1024', pg_catalog.octet_length(enqueue_jobs.rate_key)
            USING ERRCODE = 'check_violation', HINT = 'A rate key is at most 1024 bytes, like a queue name.';
    END IF;
    IF enqueue_jobs.rate_key = '' THEN
        RAISE EXCEPTION 'rate_key must not be empty' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Pass NULL for jobs without a rate key.';
    END IF;
    WITH inserted AS (
        INSERT INTO pglockkit.jobs (queue, payload, run_at, priority, max_attempts, rate_key)
        SELECT enqueue_jobs.queue, p.payload, enqueue_jobs.run_at, enqueue_jobs.priority, enqueue_jobs.max_attempts,
               enqueue_jobs.rate_key
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
COMMENT ON FUNCTION pglockkit.enqueue_jobs(text, jsonb[], timestamptz, integer, integer, text) IS
    'Adds one job per payload in one statement (ids in payload order) and notifies once; rate_key (optional) is every job''s rate key, as in enqueue_job. run_at must be finite (22023); one payload over max_payload_bytes (pglockkit.settings) refuses the whole batch (54000).';

CREATE FUNCTION pglockkit._take_rate_token(queue text, key text, t timestamptz) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_spent boolean;
BEGIN
    -- claim_job's single-job paths call this for the one job with a rate key they are about to
    -- claim, last among its conditions (a function costs more than a column test, so the planner
    -- orders it last), after the checks that gate the statement: it takes a token only for a job
    -- that is then claimed in the same statement. The key's row is locked SKIP LOCKED (a row
    -- another claimer holds: false, and the job is left to claim_job's other paths) and tat is
    -- re-checked on the row locked, its newest version. A key without a limit: true. (A function
    -- and not a NOT EXISTS in the claim itself: in the claim's generic plan that became a hashed
    -- subplan, set up at every claim, jobs without a rate key too; measured a few percent of
    -- claim + complete.)
    WITH locked AS (
        SELECT q.key FROM pglockkit.job_rates q
         WHERE q.queue = _take_rate_token.queue AND q.key = _take_rate_token.key
           AND q.tat <= _take_rate_token.t + q.step * (q.burst - 1)
           FOR NO KEY UPDATE SKIP LOCKED
    ), spent AS (
        UPDATE pglockkit.job_rates q
           SET tat = GREATEST(q.tat, _take_rate_token.t) + q.step
          FROM locked l
         WHERE q.queue = _take_rate_token.queue AND q.key = l.key
        RETURNING q.key
    )
    SELECT EXISTS (SELECT FROM spent) INTO v_spent;
    RETURN v_spent OR NOT EXISTS (SELECT FROM pglockkit.job_rates q
                                   WHERE q.queue = _take_rate_token.queue AND q.key = _take_rate_token.key);
END
$$;
COMMENT ON FUNCTION pglockkit._take_rate_token(text, text, timestamptz) IS
    'Private: takes one token of a rate-limited key for a claim at time t (GCRA: tat moves to max(tat, t) + step) if the key has one now and its row is not held by another transaction; true if taken, or if the key has no limit. Never waits.';

CREATE FUNCTION pglockkit.claim_job(
    queue text, worker text, lease interval DEFAULT '5 minutes', batch integer DEFAULT 1)
RETURNS SETOF pglockkit.claimed_job
LANGUAGE plpgsql VOLATILE SECURITY DEFINER ROWS 1
SET search_path = pg_catalog, pg_temp
SET enable_bitmapscan = off
SET enable_seqscan = off
-- A generic plan, made once per session: under the default (auto) mode PL/pgSQL re-planned this
-- multi-CTE statement at every call, which cost more than executing it (measured: claim+complete
-- 0.46 -> 0.74 of the bare statements).
SET plan_cache_mode = force_generic_plan
-- The longest a claim waits for a lock before it gives up and returns nothing (see the block).
SET lock_timeout = '10ms'
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := pg_catalog.clock_timestamp();
    v_keyed   boolean;
    v_expired boolean;
    v_job     pglockkit.claimed_job;
    v_found   boolean;
    v_held    boolean;
    v_pause   float8;
    v_rated   boolean;
    v_paused  boolean;
BEGIN
    -- (use_column: ON CONFLICT (queue, key) names columns; every parameter below is qualified.)
    -- The argument checks, as one expression when the arguments are good (each IF is an
    -- expression evaluation of its own); the statements inside say which one is bad.
    IF claim_job.queue IS NULL OR claim_job.queue = ''
       OR claim_job.lease IS NULL OR claim_job.lease <= interval '0'
       OR claim_job.lease > pglockkit._longest_job_lease()  -- before the sum, which it keeps in range
       OR v_now + claim_job.lease <= v_now
       OR claim_job.worker IS NULL OR claim_job.batch IS NULL OR claim_job.worker = ''
       OR claim_job.batch NOT BETWEEN 1 AND 1000 THEN
        IF claim_job.queue IS NULL THEN
            RAISE EXCEPTION 'queue must not be null' USING ERRCODE = 'null_value_not_allowed';
        END IF;
        IF claim_job.queue = '' THEN
            RAISE EXCEPTION 'queue name must not be empty' USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF claim_job.lease IS NULL THEN
            RAISE EXCEPTION 'lease must not be null' USING ERRCODE = 'null_value_not_allowed';
        END IF;
        PERFORM pglockkit._check_lease(claim_job.lease);
        IF claim_job.worker IS NULL OR claim_job.batch IS NULL THEN
            RAISE EXCEPTION 'worker and batch must not be null' USING ERRCODE = 'null_value_not_allowed';
        END IF;
        IF claim_job.worker = '' THEN
            RAISE EXCEPTION 'worker must not be empty' USING ERRCODE = 'invalid_parameter_value',
                HINT = 'Name the worker (e.g. host:pid) so that a stuck job says who had it.';
        END IF;
        IF claim_job.batch NOT BETWEEN 1 AND 1000 THEN
            RAISE EXCEPTION 'batch % is out of range', claim_job.batch
                USING ERRCODE = 'invalid_parameter_value', HINT = 'batch is 1 to 1000.';
        END IF;
    END IF;

    -- Every statement below locks with SKIP LOCKED, but PostgreSQL still waits in one case: when
    -- the updater of a row ended just as this claim reached it, the newer versions of the row are
    -- locked by following its update chain, and that walk waits for a transaction that holds the
    -- newest one, whatever the wait policy (heap_lock_updated_tuple). Such a wait, while this claim
    -- held rows it had locked in claim order, now and then closed a cycle with a completion that
    -- locks in id order (40P01, about once in an hour of racing claims). So the claim runs in a
    -- block of its own under lock_timeout 10 ms (the function's SET): a claim that would wait
    -- longer, or that the deadlock detector picks, undoes what it did, which frees every row it
    -- locked, and returns nothing, as a claim that found every job taken does. Every statement
    -- that can wait runs before any row is returned (the rows come from the statement that locks).
    BEGIN
        -- The common case first, as the bare statement. Batch 1, the usual worker loop: claim the
        -- first due job in claim order if it has no concurrency key and the queue has no expired lease
        -- (checked inside the statement, before any row is locked: the planner makes it a one-time
        -- filter). A keyed first job is locked but not claimed here, and the keyed path below runs
        -- (the lock lasts until the caller's transaction ends, at once for an autocommit claim; other
        -- claimers skip that job meanwhile). For one job this is what that path would pick, without
        -- its per-key bookkeeping, whether or not the queue has other keyed jobs. A job with a rate
        -- key: claimed here if _take_rate_token finds the key without a limit or takes one of its
        -- tokens in this statement (a call for such jobs only: a job without a rate key costs one
        -- column test); otherwise left to the keyed path. A paused queue: a one-time filter too.
        IF claim_job.batch = 1
           AND pg_catalog.current_setting('server_version_num')::integer >= 180000 THEN
            -- PostgreSQL 18 and later: the scan in claim order is the bare statement's. Its btree skip
            -- scan jumps over the entries of jobs_ready that are scheduled for later (run_at is an index
            -- condition under the skipped priority column), so the walk over priorities below is not
            -- needed, and cost a third of this function's own time. Checked at each call, not at
            -- install, so that a pg_upgrade to 18 takes this branch without a migration.
            RETURN QUERY
            UPDATE pglockkit.jobs j
               SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                   token = pglockkit._next_token('pglockkit.job_tokens', j.token), lease_expires_at = v_now + claim_job.lease,
                   started_at = v_now
             WHERE j.id = (
                   SELECT r.id
                     FROM pglockkit.jobs r
                    WHERE r.queue = claim_job.queue AND r.status = 'queued'
                      AND r.run_at <= v_now
                    ORDER BY r.priority DESC, r.run_at, r.id
                    LIMIT 1
                      FOR UPDATE SKIP LOCKED)
               AND j.concurrency_key IS NULL
               AND (j.rate_key IS NULL OR pglockkit._take_rate_token(claim_job.queue, j.rate_key, v_now))
               AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                                WHERE e.queue = claim_job.queue AND e.lease_expires_at <= v_now)
               AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
            RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key;
        ELSIF claim_job.batch = 1 THEN
            -- Before 18, first the queue's highest priority alone (one probe finds it): the common
            -- case, a queue whose top priority has a due job, costs two index probes and no walk.
            RETURN QUERY
            UPDATE pglockkit.jobs j
               SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                   token = pglockkit._next_token('pglockkit.job_tokens', j.token), lease_expires_at = v_now + claim_job.lease,
                   started_at = v_now
             WHERE j.id = (
                   SELECT r.id
                     FROM pglockkit.jobs r
                    WHERE r.queue = claim_job.queue AND r.status = 'queued'
                      AND r.priority = (
                          SELECT t.priority FROM pglockkit.jobs t
                           WHERE t.queue = claim_job.queue AND t.status = 'queued'
                           ORDER BY t.priority DESC LIMIT 1)
                      AND r.run_at <= v_now
                    ORDER BY r.run_at, r.id
                    LIMIT 1
                      FOR UPDATE SKIP LOCKED)
               AND j.concurrency_key IS NULL
               AND (j.rate_key IS NULL OR pglockkit._take_rate_token(claim_job.queue, j.rate_key, v_now))
               AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                                WHERE e.queue = claim_job.queue AND e.lease_expires_at <= v_now)
               AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
            RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key;
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
                      WHERE r.queue = claim_job.queue AND r.status = 'queued'
                      ORDER BY r.priority DESC LIMIT 1)
                    UNION ALL
                    SELECT (SELECT r.priority FROM pglockkit.jobs r
                             WHERE r.queue = claim_job.queue AND r.status = 'queued'
                               AND r.priority < p.priority
                             ORDER BY r.priority DESC LIMIT 1)
                      FROM priorities p WHERE p.priority IS NOT NULL
                )
                UPDATE pglockkit.jobs j
                   SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                       token = pglockkit._next_token('pglockkit.job_tokens', j.token), lease_expires_at = v_now + claim_job.lease,
                       started_at = v_now
                 WHERE j.id = (
                       SELECT x.id
                         FROM priorities p CROSS JOIN LATERAL (
                              SELECT r.id
                                FROM pglockkit.jobs r
                               WHERE r.queue = claim_job.queue AND r.status = 'queued'
                                 AND r.priority = p.priority AND r.run_at <= v_now
                               ORDER BY r.run_at, r.id
                               LIMIT 1
                                 FOR UPDATE SKIP LOCKED) x
                        LIMIT 1)
                   AND j.concurrency_key IS NULL
                   AND (j.rate_key IS NULL OR pglockkit._take_rate_token(claim_job.queue, j.rate_key, v_now))
                   AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                                    WHERE e.queue = claim_job.queue AND e.lease_expires_at <= v_now)
                   AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
                RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key;
            END IF;
        ELSE
            -- A batch: the first due jobs in claim order, if the queue has no concurrency keys (no key
            -- row: no queued or running job of it has a key, or had one since prune_jobs last ran;
            -- the enqueue creates the key's row first), no rate limit, no expired lease and is not
            -- paused, then sorted into claim order.
            RETURN QUERY
            WITH RECURSIVE
            -- The queue's priorities with queued jobs, highest first, one index probe each.
            priorities(priority) AS (
                (SELECT r.priority FROM pglockkit.jobs r
                  WHERE r.queue = claim_job.queue AND r.status = 'queued'
                  ORDER BY r.priority DESC LIMIT 1)
                UNION ALL
                SELECT (SELECT r.priority FROM pglockkit.jobs r
                         WHERE r.queue = claim_job.queue AND r.status = 'queued'
                           AND r.priority < p.priority
                         ORDER BY r.priority DESC LIMIT 1)
                  FROM priorities p WHERE p.priority IS NOT NULL
            ), claimed AS (
                UPDATE pglockkit.jobs j
                   SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                       token = pglockkit._next_token('pglockkit.job_tokens', j.token), lease_expires_at = v_now + claim_job.lease,
                       started_at = v_now
                 WHERE j.id = ANY (ARRAY(
                       SELECT x.id
                         FROM priorities p CROSS JOIN LATERAL (
                              SELECT r.id
                                FROM pglockkit.jobs r
                               WHERE r.queue = claim_job.queue AND r.status = 'queued'
                                 AND r.priority = p.priority AND r.run_at <= v_now
                                 AND r.concurrency_key IS NULL
                               ORDER BY r.run_at, r.id
                               LIMIT claim_job.batch
                                 FOR UPDATE SKIP LOCKED) x
                        LIMIT claim_job.batch))
                   AND NOT EXISTS (SELECT FROM pglockkit.job_keys k WHERE k.queue = claim_job.queue)
                   AND NOT EXISTS (SELECT FROM pglockkit.job_rates q WHERE q.queue = claim_job.queue)
                   AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                                    WHERE e.queue = claim_job.queue AND e.lease_expires_at <= v_now)
                   AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
                RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key, j.priority, j.run_at
            )
            SELECT c.id, c.queue, c.payload, c.attempt, c.max_attempts, c.token, c.lease_expires_at, c.concurrency_key
              FROM claimed c
             ORDER BY c.priority DESC, c.run_at, c.id;
        END IF;
        IF FOUND THEN
            RETURN;
        END IF;

        -- Nothing claimed: no job was due, or the queue has keys, rate limits or expired leases, or
        -- is paused. Which one? (Separate statements, so separate snapshots under READ COMMITTED: a
        -- lease found expired only now, or a key added only now, is handled here or by the next claim.
        -- A pause committed only now is seen by every statement below as well: each checks it.)
        SELECT EXISTS (SELECT FROM pglockkit.job_keys k WHERE k.queue = claim_job.queue),
               EXISTS (SELECT FROM pglockkit.jobs j
                        WHERE j.queue = claim_job.queue AND j.lease_expires_at <= v_now),
               EXISTS (SELECT FROM pglockkit.job_rates q WHERE q.queue = claim_job.queue),
               EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
          INTO v_keyed, v_expired, v_rated, v_paused;
        IF v_paused OR (NOT v_keyed AND NOT v_rated AND NOT v_expired) THEN
            RETURN;  -- paused, or no job due (or every due job is being claimed by someone else)
        END IF;

        IF NOT v_keyed AND NOT v_rated THEN
            -- No key of this queue has a row (every queued or running keyed job's key has one: the
            -- enqueue creates it first, and prune_jobs deletes only the rows of keys without such
            -- jobs), and it has no rate limit, but leases expired: reclaim them first, without the
            -- per-key bookkeeping. Keyed jobs are excluded anyway, should one be committed meanwhile.
            RETURN QUERY
            WITH RECURSIVE
            -- The queue's priorities with queued jobs, highest first, one index probe each (none if
            -- the queue is paused).
            priorities(priority) AS (
                (SELECT r.priority FROM pglockkit.jobs r
                  WHERE r.queue = claim_job.queue AND r.status = 'queued'
                    AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
                  ORDER BY r.priority DESC LIMIT 1)
                UNION ALL
                SELECT (SELECT r.priority FROM pglockkit.jobs r
                         WHERE r.queue = claim_job.queue AND r.status = 'queued'
                           AND r.priority < p.priority
                         ORDER BY r.priority DESC LIMIT 1)
                  FROM priorities p WHERE p.priority IS NOT NULL
            ), expired AS (
                SELECT j.id, j.attempt >= j.max_attempts AS exhausted
                  FROM pglockkit.jobs j
                 WHERE j.queue = claim_job.queue AND j.status = 'running'
                   AND j.lease_expires_at <= v_now
                   AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
                 ORDER BY j.lease_expires_at
                 LIMIT claim_job.batch
                   FOR UPDATE SKIP LOCKED
            ), buried AS (
                UPDATE pglockkit.jobs j
                   SET status = 'dead', last_error = 'lease expired', finished_at = v_now, lease_expires_at = NULL
                  FROM expired e
                 WHERE j.id = e.id AND e.exhausted
            ), ready AS (
                SELECT x.id
                  FROM priorities p CROSS JOIN LATERAL (
                       SELECT r.id
                         FROM pglockkit.jobs r
                        WHERE r.queue = claim_job.queue AND r.status = 'queued'
                          AND r.priority = p.priority AND r.run_at <= v_now
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
                   SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                       token = pglockkit._next_token('pglockkit.job_tokens', j.token), lease_expires_at = v_now + claim_job.lease,
                       started_at = v_now
                 WHERE j.id = ANY (ARRAY(SELECT p.id FROM picked p))
                RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key, j.priority, j.run_at
            )
            SELECT c.id, c.queue, c.payload, c.attempt, c.max_attempts, c.token, c.lease_expires_at, c.concurrency_key
              FROM claimed c
             ORDER BY c.priority DESC, c.run_at, c.id;
            RETURN;
        END IF;

        -- One statement: expired leases first (their workers died or hung; a reclaim counts as an
        -- attempt, and on the last attempt the job goes dead), then due jobs in priority order.
        -- SKIP LOCKED: a row another claimer holds is skipped, never waited for.
        --
        -- Per-key concurrency: a job of a key starts only while the key's running jobs are fewer than
        -- the smallest concurrency_limit among the key's unfinished (queued or running) jobs, its
        -- limit (one probe of jobs_keys). Due jobs whose key is at its limit (by this statement's
        -- snapshot) are passed over. Then the rows of the keys this claim may change are locked in key
        -- order, SKIP LOCKED: a key whose row another transaction holds (a claim or a completion of
        -- that key, until it commits) is passed over too, so a claim never waits for a lock and can
        -- be in no deadlock, whatever else its transaction holds. Within the batch at most
        -- limit - running jobs per key are kept, running read from the locked row. A key with a job
        -- buried here (dead on its last attempt's expiry) is not claimed in the same call, so that
        -- each key's row changes at most once per statement; a job whose key's row is held is not
        -- buried now, the next claim does it. A key with no row at all (deleted by hand) gets one.
        --
        -- Per-key rate limits (job_rates, GCRA): due jobs whose rate key has no token by this
        -- statement's snapshot are passed over; the rows of the limited rate keys among the
        -- candidates are locked in key order, SKIP LOCKED, and each key gives at most the tokens its
        -- locked row allows, in claim order (reclaims of expired leases count too, a claim is a claim);
        -- its tat then moves by one step per job taken, in this statement. A limited key whose row
        -- another claimer holds is passed over. Rate limits are applied first, then the concurrency
        -- limits to the jobs within their rate; a job is claimed only within both. A rate key without
        -- a limit has none. A paused queue claims nothing (its priorities and expired leases are empty).
        -- The statement ends with one row of NULLs if a key was passed over because its row was held.
        -- (The variables of this path are set here, not declared with values: the fast paths above
        -- would pay for that.)
        v_found := false;
        v_pause := 0.001;
        LOOP
            v_held := false;
            FOR v_job IN
            WITH RECURSIVE
            -- The queue's priorities with queued jobs, highest first, one index probe each (none if
            -- the queue is paused).
            priorities(priority) AS (
                (SELECT r.priority FROM pglockkit.jobs r
                  WHERE r.queue = claim_job.queue AND r.status = 'queued'
                    AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
                  ORDER BY r.priority DESC LIMIT 1)
                UNION ALL
                SELECT (SELECT r.priority FROM pglockkit.jobs r
                         WHERE r.queue = claim_job.queue AND r.status = 'queued'
                           AND r.priority < p.priority
                         ORDER BY r.priority DESC LIMIT 1)
                  FROM priorities p WHERE p.priority IS NOT NULL
            ), expired AS (
                SELECT j.id, j.attempt >= j.max_attempts AS exhausted, j.concurrency_key, j.rate_key, j.priority, j.run_at
                  FROM pglockkit.jobs j
                 WHERE j.queue = claim_job.queue AND j.status = 'running'
                   AND j.lease_expires_at <= v_now
                   AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
                 ORDER BY j.lease_expires_at
                 LIMIT claim_job.batch
                   FOR UPDATE SKIP LOCKED
            ), ready AS (
                SELECT x.id, x.priority, x.run_at, x.concurrency_key, x.concurrency_limit, x.rate_key
                  FROM priorities p CROSS JOIN LATERAL (
                       SELECT r.id, r.priority, r.run_at, r.concurrency_key, r.concurrency_limit, r.rate_key
                         FROM pglockkit.jobs r
                        WHERE r.queue = claim_job.queue AND r.status = 'queued'
                          AND r.priority = p.priority AND r.run_at <= v_now
                          AND (r.concurrency_key IS NULL OR NOT EXISTS (
                          SELECT FROM pglockkit.job_keys k
                           WHERE k.queue = claim_job.queue AND k.key = r.concurrency_key
                             AND (k.running >= r.concurrency_limit
                                  OR (k.running > 0 AND k.running >= (
                                      SELECT pg_catalog.min(m.concurrency_limit) FROM pglockkit.jobs m
                                       WHERE m.queue = claim_job.queue
                                         AND m.concurrency_key = r.concurrency_key
                                         AND m.status IN ('queued', 'running'))))))
                          -- A rate key without a token now (by this snapshot) is passed over.
                          AND (r.rate_key IS NULL OR NOT EXISTS (
                          SELECT FROM pglockkit.job_rates q
                           WHERE q.queue = claim_job.queue AND q.key = r.rate_key
                             AND q.tat > v_now + q.step * (q.burst - 1)))
                        ORDER BY r.run_at, r.id
                        LIMIT claim_job.batch
                          FOR UPDATE SKIP LOCKED) x
                 LIMIT claim_job.batch
            ), keyed AS (
                -- The keys whose rows this claim may change.
                SELECT r.concurrency_key AS key FROM ready r WHERE r.concurrency_key IS NOT NULL
                UNION
                SELECT e.concurrency_key FROM expired e WHERE e.exhausted AND e.concurrency_key IS NOT NULL
            ), locked AS (
                -- Their rows, in key order, but none that another transaction holds: never waits.
                -- running is read from the newest row version (the one locked). (Keys as an array,
                -- here and below: one index probe each, whatever the generic plan's estimates.)
                SELECT k.key, k.running
                  FROM pglockkit.job_keys k
                 WHERE k.queue = claim_job.queue
                   AND k.key = ANY (ARRAY(SELECT y.key FROM keyed y))
                 ORDER BY k.key
                   FOR NO KEY UPDATE OF k SKIP LOCKED
            ), missing AS (
                -- Keys without a row in this statement's snapshot.
                SELECT y.key FROM keyed y
                 WHERE y.key <> ALL (ARRAY(
                       SELECT k.key FROM pglockkit.job_keys k
                        WHERE k.queue = claim_job.queue
                          AND k.key = ANY (ARRAY(SELECT y.key FROM keyed y))))
            ), limits AS (
                SELECT y.key, (SELECT pg_catalog.min(m.concurrency_limit) FROM pglockkit.jobs m
                                WHERE m.queue = claim_job.queue AND m.concurrency_key = y.key
                                  AND m.status IN ('queued', 'running')) AS lim
                  FROM keyed y
            ), candidates AS (
                -- What this claim may take: reclaims of expired leases (rank 0), then due jobs.
                SELECT e.id, 0 AS rank, e.priority, e.run_at, e.concurrency_key, NULL::integer AS concurrency_limit, e.rate_key
                  FROM expired e WHERE NOT e.exhausted
                UNION ALL
                SELECT r.id, 1, r.priority, r.run_at, r.concurrency_key, r.concurrency_limit, r.rate_key FROM ready r
            ), rated AS (
                SELECT DISTINCT c.rate_key AS key FROM candidates c WHERE c.rate_key IS NOT NULL
            ), rate_rows AS (
                -- The rate keys with a limit in this statement's snapshot (a key without one has no limit).
                SELECT q.key FROM pglockkit.job_rates q
                 WHERE q.queue = claim_job.queue AND q.key = ANY (ARRAY(SELECT y.key FROM rated y))
            ), rate_locked AS (
                -- Their rows, in key order, but none that another transaction holds (a claim of the
                -- key, until it commits): never waits. The jobs the key may start now, from the newest
                -- row version (the one locked): floor((t + burst * step - max(tat, t)) / step).
                SELECT q.key,
                       GREATEST(pg_catalog.floor(EXTRACT(epoch FROM v_now + q.step * q.burst - GREATEST(q.tat, v_now))
                                                 / EXTRACT(epoch FROM q.step)), 0)::integer AS tokens
                  FROM pglockkit.job_rates q
                 WHERE q.queue = claim_job.queue AND q.key = ANY (ARRAY(SELECT y.key FROM rated y))
                 ORDER BY q.key
                   FOR NO KEY UPDATE OF q SKIP LOCKED
            ), rate_ok AS (
                -- Candidates within their key's rate: the first tokens of each limited key, in claim
                -- order. A limited key whose row is held has no token for this claim.
                SELECT c.* FROM (
                    SELECT c.*, pg_catalog.row_number() OVER (PARTITION BY c.rate_key
                                                             ORDER BY c.rank, c.priority DESC, c.run_at, c.id) AS rate_nth,
                           rr.key IS NOT NULL AS rate_limited, coalesce(rl.tokens, 0) AS tokens
                      FROM candidates c
                      LEFT JOIN rate_rows rr ON rr.key = c.rate_key
                      LEFT JOIN rate_locked rl ON rl.key = c.rate_key) c
                 WHERE NOT c.rate_limited OR c.rate_nth <= c.tokens
            ), allowed AS (
                SELECT r.*, pg_catalog.row_number() OVER (ORDER BY r.priority DESC, r.run_at, r.id) AS pos
                  FROM (SELECT r.*, pg_catalog.row_number() OVER (PARTITION BY r.concurrency_key
                                                               ORDER BY r.priority DESC, r.run_at, r.id) AS nth,
                               coalesce(l.running, 0) AS running_now, l.key IS NOT NULL AS have_row,
                               m.key IS NOT NULL AS create_row, coalesce(lm.lim, r.concurrency_limit) AS key_limit
                          FROM rate_ok r
                          LEFT JOIN locked l ON l.key = r.concurrency_key
                          LEFT JOIN missing m ON m.key = r.concurrency_key
                          LEFT JOIN limits lm ON lm.key = r.concurrency_key
                         WHERE r.rank = 1) r
                 WHERE r.concurrency_key IS NULL
                    OR ((r.have_row OR r.create_row)
                        AND r.nth <= (r.key_limit - r.running_now)
                        AND r.concurrency_key NOT IN (SELECT e.concurrency_key FROM expired e
                                                       WHERE e.exhausted AND e.concurrency_key IS NOT NULL))
            ), kept AS (
                SELECT a.* FROM allowed a
                 WHERE a.pos <= (claim_job.batch - (SELECT pg_catalog.count(*) FROM rate_ok o WHERE o.rank = 0))
            ), buried AS (
                UPDATE pglockkit.jobs j
                   SET status = 'dead', last_error = 'lease expired', finished_at = v_now, lease_expires_at = NULL
                  FROM expired e
                 WHERE j.id = e.id AND e.exhausted
                   AND (e.concurrency_key IS NULL OR e.concurrency_key IN (SELECT l.key FROM locked l)
                        OR e.concurrency_key IN (SELECT m.key FROM missing m))
                RETURNING j.concurrency_key
            ), unbury AS (
                SELECT b.concurrency_key AS key, pg_catalog.count(*)::int AS n
                  FROM buried b WHERE b.concurrency_key IS NOT NULL GROUP BY b.concurrency_key
            ), unburied AS (
                -- Rows locked above (or missing): no wait.
                UPDATE pglockkit.job_keys k
                   SET running = k.running - b.n
                  FROM unbury b
                 WHERE k.queue = claim_job.queue
                   AND k.key = ANY (ARRAY(SELECT u.key FROM unbury u)) AND k.key = b.key
            ), reserve AS (
                SELECT kk.concurrency_key AS key, pg_catalog.count(*)::int AS n, pg_catalog.min(kk.key_limit) AS lim
                  FROM kept kk WHERE kk.have_row GROUP BY kk.concurrency_key
            ), reserved AS (
                -- Rows locked above: no wait. (The re-check of the limit cannot fail; it guards the count.)
                UPDATE pglockkit.job_keys k
                   SET running = k.running + g.n, lim = g.lim
                  FROM reserve g
                 WHERE k.queue = claim_job.queue
                   AND k.key = ANY (ARRAY(SELECT r.key FROM reserve r)) AND k.key = g.key
                   AND (k.running + g.n) <= g.lim
                RETURNING k.key
            ), created AS (
                INSERT INTO pglockkit.job_keys AS k (queue, key, running, lim)
                SELECT claim_job.queue, kk.concurrency_key, pg_catalog.count(*)::int, pg_catalog.min(kk.key_limit)
                  FROM kept kk WHERE kk.create_row GROUP BY kk.concurrency_key ORDER BY kk.concurrency_key
                ON CONFLICT DO NOTHING
                RETURNING k.key
            ), spend AS (
                -- The tokens the kept jobs take, per limited rate key.
                SELECT t.rate_key AS key, pg_catalog.count(*)::int AS n
                  FROM (SELECT o.rate_key FROM rate_ok o WHERE o.rank = 0 AND o.rate_limited
                        UNION ALL
                        SELECT kk.rate_key FROM kept kk WHERE kk.rate_limited) t
                 GROUP BY t.rate_key
            ), spent AS (
                -- Rows locked above: no wait. At most tokens jobs per key were kept, so tat stays
                -- within t + burst * step.
                UPDATE pglockkit.job_rates q
                   SET tat = GREATEST(q.tat, v_now) + q.step * g.n
                  FROM spend g
                 WHERE q.queue = claim_job.queue
                   AND q.key = ANY (ARRAY(SELECT s.key FROM spend s)) AND q.key = g.key
                RETURNING q.key
            ), picked AS (
                SELECT o.id, 0 AS rank, 0::int8 AS pos FROM rate_ok o
                 WHERE o.rank = 0 AND (NOT o.rate_limited OR o.rate_key IN (SELECT sp.key FROM spent sp))
                UNION ALL
                SELECT kk.id, 1, kk.pos FROM kept kk
                 WHERE (kk.concurrency_key IS NULL
                        OR kk.concurrency_key IN (SELECT rs.key FROM reserved rs UNION ALL SELECT c.key FROM created c))
                   AND (NOT kk.rate_limited OR kk.rate_key IN (SELECT sp.key FROM spent sp))
            ), claimed AS (
                UPDATE pglockkit.jobs j
                   SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                       token = pglockkit._next_token('pglockkit.job_tokens', j.token), lease_expires_at = v_now + claim_job.lease,
                       started_at = v_now
                 -- = ANY(array), not a join: the row estimates of the CTEs above are rough in a generic
                 -- plan, and a join estimated at hundreds of rows turned into a hash join over the table.
                 WHERE j.id = ANY (ARRAY(SELECT p.id FROM picked p))
                RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key, j.priority, j.run_at
            )
            (SELECT c.id, c.queue, c.payload, c.attempt, c.max_attempts, c.token, c.lease_expires_at, c.concurrency_key
               FROM claimed c
              ORDER BY c.priority DESC, c.run_at, c.id)
            UNION ALL
            SELECT NULL::bigint, NULL::text, NULL::jsonb, NULL::integer, NULL::integer, NULL::bigint, NULL::timestamptz, NULL::text
             WHERE EXISTS (SELECT FROM ready r
                            WHERE r.concurrency_key IS NOT NULL
                              AND r.concurrency_key NOT IN (SELECT l.key FROM locked l)
                              AND r.concurrency_key NOT IN (SELECT m.key FROM missing m))
                OR EXISTS (SELECT FROM rate_rows rr WHERE rr.key NOT IN (SELECT rl.key FROM rate_locked rl))
            LOOP
                IF v_job.id IS NULL THEN
                    v_held := true;
                ELSE
                    v_found := true;
                    RETURN NEXT v_job;
                END IF;
            END LOOP;
            -- Nothing claimed only because key rows were held (for the moment of someone's commit, as
            -- a rule): try again after 1, 2, 4 and 8 ms rather than send the worker to sleep until its
            -- next poll. Meanwhile this transaction keeps the job rows it locked and did not claim:
            -- other claimers skip them, a completion or cancel of one of them waits (for 15 ms at
            -- most); this claim waits for no lock (but see the block).
            EXIT WHEN v_found OR NOT v_held OR v_pause > 0.008;
            PERFORM pg_catalog.pg_sleep(v_pause);
            v_pause := v_pause * 2;
            v_now := pg_catalog.clock_timestamp();
        END LOOP;
    EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
        RETURN;
    END;
END
$$;
COMMENT ON FUNCTION pglockkit.claim_job(text, text, interval, integer) IS
    'Claims up to batch (1..1000) jobs of queue for worker, with a lease; never waits for a lock (SKIP LOCKED; in the rare case where PostgreSQL waits anyway, following a row''s update chain, the claim gives up after 10 ms, undoes what it did and returns no rows). Jobs whose lease expired are reclaimed first (counting an attempt; on the last attempt they go dead with "lease expired"), then due jobs by priority (higher first), run_at, id. A job with a concurrency key starts only while the key''s running jobs are fewer than the smallest concurrency_limit among its queued and running jobs; a key whose counter row another transaction holds at that moment is passed over by this claim. A job with a rate key that has a rate limit (set_rate_limit) is claimed only within the key''s rate, in the same statement: jobs over it are passed over, not waited for, and other keys'' jobs are claimed instead. A paused queue (pause_queue) claims nothing. Each row carries a new fencing token for complete_job / fail_job / extend_job / release_job.';

CREATE FUNCTION pglockkit.complete_job(id bigint, token bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_queue text;
    v_key   text;
BEGIN
    UPDATE pglockkit.jobs j
       SET status = 'done', finished_at = pg_catalog.clock_timestamp(), lease_expires_at = NULL
     WHERE j.id = complete_job.id AND j.token = complete_job.token
       AND j.status = 'running'
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
SET enable_seqscan = off
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
    IF pg_catalog.cardinality(ids) <> pg_catalog.cardinality(tokens) THEN
        RAISE EXCEPTION 'ids and tokens differ in length (% and %)', pg_catalog.cardinality(ids), pg_catalog.cardinality(tokens)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The job rows are locked first, in id order, whatever the order of the arrays. A row whose
    -- token went stale while this statement ran is locked too (its newest version, to the end of
    -- the transaction: PostgreSQL locks a concurrently updated row before it rechecks it), so two
    -- calls that locked in their arrays' orders could each hold a row the other waited for: a
    -- stale caller and the claimer that had reclaimed its jobs deadlocked. Then the key rows, in
    -- key order (_keys_left).
    WITH mine AS (
        SELECT j.id
          FROM pglockkit.jobs j
          JOIN ROWS FROM (pg_catalog.unnest(ids), pg_catalog.unnest(tokens)) AS c(id, token)
            ON j.id = c.id AND j.token = c.token
         WHERE j.status = 'running'
         ORDER BY j.id
           FOR NO KEY UPDATE OF j
    ), done AS (
        UPDATE pglockkit.jobs j
           SET status = 'done', finished_at = pg_catalog.clock_timestamp(), lease_expires_at = NULL
          FROM mine m
         WHERE j.id = m.id
        RETURNING j.queue, j.concurrency_key
    )
    SELECT pg_catalog.count(*)::int, pg_catalog.array_agg(d.queue), pg_catalog.array_agg(d.concurrency_key)
      INTO v_done, v_queues, v_keys
      FROM done d;
    IF v_done > 0 THEN
        PERFORM pglockkit._keys_left(v_queues, v_keys);
    END IF;
    RETURN v_done;
END
$$;
COMMENT ON FUNCTION pglockkit.complete_jobs(bigint[], bigint[]) IS
    'Completes many claimed jobs in one statement (one commit for a whole batch); returns how many (id, token) pairs were current. Stale or unknown pairs are skipped. Locks the job rows in id order, then their keys'' rows in key order.';

CREATE FUNCTION pglockkit.fail_job(id bigint, token bigint, error text, retry_in interval DEFAULT NULL) RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    v_now    timestamptz := pg_catalog.clock_timestamp();
    v_status text;
    v_queue  text;
    v_key    text;
BEGIN
    IF NOT pg_catalog.isfinite(retry_in) THEN  -- infinite intervals exist from PostgreSQL 17 on
        RAISE EXCEPTION 'retry_in must be finite, got %', retry_in USING ERRCODE = 'invalid_parameter_value',
            HINT = 'To stop retrying a job, cancel_job it.';
    END IF;
    IF retry_in IS NOT NULL AND retry_in < interval '0' THEN
        RAISE EXCEPTION 'retry_in must not be negative, got %', retry_in USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE pglockkit.jobs j
       SET status = CASE WHEN j.attempt >= j.max_attempts THEN 'dead' ELSE 'queued' END,
           run_at = CASE WHEN j.attempt >= j.max_attempts THEN j.run_at
                         ELSE v_now + coalesce(retry_in, pglockkit._retry_delay(j.attempt)) END,
           finished_at = CASE WHEN j.attempt >= j.max_attempts THEN v_now END,
           last_error = fail_job.error, lease_expires_at = NULL
     WHERE j.id = fail_job.id AND j.token = fail_job.token
       AND j.status = 'running'
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
    'Records a failed attempt: returns ''queued'' (retried after retry_in, else exponential backoff with jitter), ''dead'' (that was the last attempt; kept for inspection and retry_dead_jobs), or ''stale'' (token not current: nothing changed). retry_in must be finite and not negative (22023).';

CREATE FUNCTION pglockkit.extend_job(id bigint, token bigint, lease interval) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    PERFORM pglockkit._check_lease(extend_job.lease);
    UPDATE pglockkit.jobs j
       SET lease_expires_at = pg_catalog.clock_timestamp() + extend_job.lease
     WHERE j.id = extend_job.id AND j.token = extend_job.token
       AND j.status = 'running';
    RETURN FOUND OR pglockkit._job_not_found(extend_job.id);
END
$$;
COMMENT ON FUNCTION pglockkit.extend_job(bigint, bigint, interval) IS
    'Heartbeat: the job''s lease now ends lease from now. False if the token is stale: stop working on it.';

CREATE FUNCTION pglockkit.release_job(id bigint, token bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_queue text;
    v_key   text;
BEGIN
    UPDATE pglockkit.jobs j
       SET status = 'queued', attempt = j.attempt - 1, lease_expires_at = NULL,
           run_at = LEAST(j.run_at, pg_catalog.clock_timestamp())
     WHERE j.id = release_job.id AND j.token = release_job.token
       AND j.status = 'running'
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
SET enable_seqscan = off
AS $$
DECLARE
    v_queue text;
    v_key   text;
BEGIN
    WITH old AS (
        SELECT j.id, j.status FROM pglockkit.jobs j
         WHERE j.id = cancel_job.id AND j.status IN ('queued', 'running')
           FOR UPDATE
    )
    UPDATE pglockkit.jobs j
       SET status = 'cancelled', finished_at = pg_catalog.clock_timestamp(), lease_expires_at = NULL
      FROM old
     WHERE j.id = old.id
    RETURNING j.queue, CASE WHEN old.status = 'running' THEN j.concurrency_key END
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
         WHERE j.id = ANY (_requeue_dead.ids) AND j.queue = _requeue_dead.queue AND j.status = 'dead'
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

CREATE FUNCTION pglockkit.retry_dead_jobs(queue text, ids bigint[] DEFAULT NULL) RETURNS integer
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
               AND (retry_dead_jobs.ids IS NULL OR j.id = ANY (retry_dead_jobs.ids))
            UNION ALL
            SELECT d.id FROM (SELECT DISTINCT ON (j.dedup_key) j.id FROM pglockkit.jobs j
                               WHERE j.queue = retry_dead_jobs.queue AND j.status = 'dead' AND j.dedup_key IS NOT NULL
                                 AND (retry_dead_jobs.ids IS NULL OR j.id = ANY (retry_dead_jobs.ids))
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
                v_n := v_n + v_one;
                v_keys := v_keys || v_k;
                v_limits := v_limits || v_l;
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

CREATE FUNCTION pglockkit.prune_jobs(older_than interval, queue text DEFAULT NULL, include_dead boolean DEFAULT false)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_n      bigint;
    v_queues text[];
    v_keys   text[];
BEGIN
    IF older_than IS NULL OR include_dead IS NULL THEN
        RAISE EXCEPTION 'older_than and include_dead must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF older_than < interval '0' THEN
        RAISE EXCEPTION 'older_than must not be negative, got %', older_than USING ERRCODE = 'invalid_parameter_value';
    END IF;
    DELETE FROM pglockkit.jobs j
     WHERE j.status IN ('done', 'cancelled', CASE WHEN include_dead THEN 'dead' END)
       AND j.finished_at < (pg_catalog.clock_timestamp() - older_than)
       AND (prune_jobs.queue IS NULL OR j.queue = prune_jobs.queue);
    GET DIAGNOSTICS v_n = ROW_COUNT;

    -- The rows of idle concurrency keys (no queued or running job; each such row also turned the
    -- batch fast path of claim_job off for its queue). First lock them, skipping any row another
    -- transaction holds: a claim or completion of the key, or an enqueue or retry_dead_jobs
    -- adding work to it (they pin the row, see _pin_job_key); never waits.
    SELECT pg_catalog.array_agg(i.queue), pg_catalog.array_agg(i.key) INTO v_queues, v_keys
      FROM (SELECT k.queue, k.key FROM pglockkit.job_keys k
             WHERE (prune_jobs.queue IS NULL OR k.queue = prune_jobs.queue)
               AND k.running = 0
               AND NOT EXISTS (SELECT FROM pglockkit.jobs m
                                WHERE m.queue = k.queue AND m.concurrency_key = k.key
                                  AND m.status IN ('queued', 'running'))
               FOR UPDATE OF k SKIP LOCKED) i;
    -- Then delete those still idle, seen with a snapshot taken after the locks: work added by a
    -- transaction that committed before them is seen here; one still open pinned its row (skipped
    -- above), or will find the row gone and create it again.
    IF v_keys IS NOT NULL THEN
        DELETE FROM pglockkit.job_keys k
         USING ROWS FROM (pg_catalog.unnest(v_queues), pg_catalog.unnest(v_keys)) AS c(queue, key)
         WHERE k.queue = c.queue AND k.key = c.key
           AND k.running = 0
           AND NOT EXISTS (SELECT FROM pglockkit.jobs m
                            WHERE m.queue = k.queue AND m.concurrency_key = k.key
                              AND m.status IN ('queued', 'running'));
    END IF;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit.prune_jobs(interval, text, boolean) IS
    'Deletes done and cancelled jobs (and dead ones with include_dead) that finished more than older_than ago, in one queue or all; returns how many. Also deletes the job_keys rows of concurrency keys with no queued or running job (whatever older_than), which gives a queue whose keys are all idle the claim path of a queue without keys again. Never waits for a claim. Run it from cron, e.g. prune_jobs(''7 days'').';

-- A worker whose claim came back empty while the queue's due jobs wait only for a rate token
-- sleeps until that token, not its whole poll interval (nothing NOTIFYs when a token comes): a key
-- limited to 10 a second ran at one job per poll interval (0016). Keys with a token now are left
-- out: what holds their jobs back is not the rate (a claim of another lane, a concurrency limit).
CREATE FUNCTION pglockkit.next_rate_token(queue text) RETURNS interval
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := pg_catalog.clock_timestamp();
BEGIN
    PERFORM pglockkit._check_queue(next_rate_token.queue);
    IF EXISTS (SELECT FROM pglockkit.paused_queues p WHERE p.queue = next_rate_token.queue) THEN
        RETURN NULL;
    END IF;
    RETURN (SELECT pg_catalog.min(q.tat - q.step * (q.burst - 1)) - v_now
              FROM pglockkit.job_rates q
             WHERE q.queue = next_rate_token.queue
               AND q.tat - q.step * (q.burst - 1) > v_now
               AND EXISTS (SELECT FROM pglockkit.jobs j
                            WHERE j.queue = q.queue AND j.rate_key = q.key
                              AND j.status = 'queued' AND j.run_at <= v_now));
END
$$;
COMMENT ON FUNCTION pglockkit.next_rate_token(text) IS
    'How long until a rate-limited key of queue that has due queued jobs gets its next token (what a worker whose claim came back empty sleeps at most); NULL when no due job waits for a token, or the queue is paused. 22004 for a NULL queue, 22023 for an empty one.';

CREATE FUNCTION pglockkit.set_rate_limit(queue text, key text, rate integer, per interval, burst integer DEFAULT 1)
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now  timestamptz := clock_timestamp();
    v_step interval;
BEGIN
    PERFORM pglockkit._check_queue(set_rate_limit.queue);
    IF set_rate_limit.key IS NULL OR set_rate_limit.rate IS NULL OR set_rate_limit.per IS NULL
       OR set_rate_limit.burst IS NULL THEN
        RAISE EXCEPTION 'key, rate, per and burst must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF set_rate_limit.key = '' THEN
        RAISE EXCEPTION 'rate key must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF set_rate_limit.rate <= 0 THEN
        RAISE EXCEPTION 'rate must be positive, got %', set_rate_limit.rate USING ERRCODE = 'invalid_parameter_value',
            HINT = 'To stop a key''s jobs, pause the queue (pause_queue); to lift the limit, remove_rate_limit.';
    END IF;
    -- Checked by its length in seconds, the measure the step is computed in: compared as an
    -- interval, a month is 30 days and a year 360, so '-1 year +365 days 6 hours' is "positive"
    -- and 0 s long (0011).
    IF NOT isfinite(set_rate_limit.per) OR EXTRACT(epoch FROM set_rate_limit.per) <= 0 THEN
        RAISE EXCEPTION 'per must be a positive finite interval, got %', set_rate_limit.per
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXTRACT(epoch FROM set_rate_limit.per) > 31622400 THEN  -- 366 days
        RAISE EXCEPTION 'per % is out of range', set_rate_limit.per USING ERRCODE = 'numeric_value_out_of_range',
            HINT = 'per is at most 366 days.';
    END IF;
    IF set_rate_limit.burst < 1 THEN
        RAISE EXCEPTION 'burst must be at least 1, got %', set_rate_limit.burst USING ERRCODE = 'invalid_parameter_value',
            HINT = 'burst is how many jobs of the key may start at once; 1 spaces them evenly.';
    END IF;
    IF set_rate_limit.burst > 1000000 THEN
        RAISE EXCEPTION 'burst % is out of range', set_rate_limit.burst USING ERRCODE = 'numeric_value_out_of_range',
            HINT = 'burst is 1 to 1000000.';
    END IF;
    -- The spacing of the key's jobs, rounded up to a whole microsecond (timestamptz's resolution):
    -- the limit is never looser than asked.
    v_step := make_interval(secs => ceil(EXTRACT(epoch FROM set_rate_limit.per) * 1000000 / set_rate_limit.rate) / 1000000);
    IF EXTRACT(epoch FROM v_step) * set_rate_limit.burst > 316224000 THEN
        RAISE EXCEPTION 'a burst of % jobs at % per % is out of range', set_rate_limit.burst, set_rate_limit.rate, set_rate_limit.per
            USING ERRCODE = 'numeric_value_out_of_range',
                  HINT = 'burst * per / rate (the time a full burst takes to come back) is at most 3660 days.';
    END IF;
    -- A new key starts with a full burst; a changed one keeps its place (tat), but owes at most
    -- one full burst of the new limit.
    INSERT INTO pglockkit.job_rates AS q (queue, key, rate, per, burst, step, tat)
    VALUES (set_rate_limit.queue, set_rate_limit.key, set_rate_limit.rate, set_rate_limit.per, set_rate_limit.burst,
            v_step, v_now)
    ON CONFLICT (queue, key) DO UPDATE
       SET rate = EXCLUDED.rate, per = EXCLUDED.per, burst = EXCLUDED.burst, step = EXCLUDED.step,
           tat = LEAST(q.tat, v_now + EXCLUDED.step * EXCLUDED.burst);
    PERFORM pg_notify('pglockkit_jobs', set_rate_limit.queue);
END
$$;
COMMENT ON FUNCTION pglockkit.set_rate_limit(text, text, integer, interval, integer) IS
    'Limits how fast claim_job starts the jobs of queue whose rate_key is key: at most rate per per on average, bursts of up to burst at once (in any window of length w, at most burst + rate * w / per claims; per / rate is rounded up to a whole microsecond). Jobs over the rate are passed over, never waited for. Replaces the key''s limit if it has one. pglockkit_admin only. 22004 for a NULL argument; 22023 for an empty queue or key, rate <= 0, per not positive and finite, burst < 1; 22003 for per over 366 days, burst over 1000000, or burst * per / rate over 3660 days; 23514 for a queue or key over 1024 bytes.';

CREATE FUNCTION pglockkit.remove_rate_limit(queue text, key text) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pglockkit._check_queue(remove_rate_limit.queue);
    IF remove_rate_limit.key IS NULL THEN
        RAISE EXCEPTION 'key must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    DELETE FROM pglockkit.job_rates q WHERE q.queue = remove_rate_limit.queue AND q.key = remove_rate_limit.key;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pg_notify('pglockkit_jobs', remove_rate_limit.queue);
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.remove_rate_limit(text, text) IS
    'Lifts the rate limit of a queue''s rate key: true if it had one, false if not (nothing changed). pglockkit_admin only. 22004 for a NULL queue or key; 22023 for an empty queue.';

CREATE FUNCTION pglockkit.pause_queue(queue text) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pglockkit._check_queue(pause_queue.queue);
    INSERT INTO pglockkit.paused_queues AS p (queue, paused_at, paused_by)
    VALUES (pause_queue.queue, clock_timestamp(), session_user)
    ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION pglockkit.pause_queue(text) IS
    'Pauses a queue: once this commits, claim_job claims none of its jobs (a claim whose statement started before still may). Jobs already running go on, and complete_job / fail_job / extend_job work as before; enqueue_job still adds jobs. True if the queue was running, false if it was paused already. pglockkit_admin only. 22004 for a NULL queue, 22023 for an empty one.';

CREATE FUNCTION pglockkit.resume_queue(queue text) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pglockkit._check_queue(resume_queue.queue);
    DELETE FROM pglockkit.paused_queues p WHERE p.queue = resume_queue.queue;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pg_notify('pglockkit_jobs', resume_queue.queue);  -- wakes the workers
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.resume_queue(text) IS
    'Resumes a paused queue (NOTIFY pglockkit_jobs wakes its workers): true if it was paused, false if not. pglockkit_admin only. 22004 for a NULL queue, 22023 for an empty one.';

CREATE FUNCTION pglockkit.extend_jobs(ids bigint[], tokens bigint[], lease interval) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    v_n integer;
BEGIN
    IF ids IS NULL OR tokens IS NULL THEN
        RAISE EXCEPTION 'ids and tokens must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF pg_catalog.cardinality(ids) <> pg_catalog.cardinality(tokens) THEN
        RAISE EXCEPTION 'ids and tokens differ in length (% and %)', pg_catalog.cardinality(ids), pg_catalog.cardinality(tokens)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pglockkit._check_lease(extend_jobs.lease);
    WITH mine AS (
        SELECT j.id
          FROM pglockkit.jobs j
          JOIN ROWS FROM (pg_catalog.unnest(ids), pg_catalog.unnest(tokens)) AS c(id, token)
            ON j.id = c.id AND j.token = c.token
         WHERE j.status = 'running'
           FOR NO KEY UPDATE OF j SKIP LOCKED
    )
    UPDATE pglockkit.jobs j
       SET lease_expires_at = pg_catalog.clock_timestamp() + extend_jobs.lease
      FROM mine
     WHERE j.id = mine.id;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit.extend_jobs(bigint[], bigint[], interval) IS
    'Heartbeat for many jobs in one statement: each job whose (id, token) is its current claim and that is running now has its lease end lease from now. Returns how many were extended. Stale or unknown pairs are skipped, and so is a job row locked by another transaction (it is being completed, failed or claimed right now): never waits.';

CREATE FUNCTION pglockkit._pin_job_key(queue text, key text, lim integer) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    -- Work for this key is being added by the calling transaction: keep the key's row until it
    -- commits, so that prune_jobs cannot delete it meanwhile (prune_jobs skips rows it cannot
    -- lock FOR UPDATE). FOR KEY SHARE does not conflict with the claims' FOR NO KEY UPDATE.
    IF _pin_job_key.queue IS NULL OR _pin_job_key.key IS NULL OR _pin_job_key.lim IS NULL THEN
        RAISE EXCEPTION 'queue, key and lim must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    LOOP
        PERFORM FROM pglockkit.job_keys k
          WHERE k.queue = _pin_job_key.queue AND k.key = _pin_job_key.key
            FOR KEY SHARE;
        EXIT WHEN FOUND;
        -- Pruned meanwhile (or never there): create it; ours until commit. If another transaction
        -- created it first, lock that one.
        INSERT INTO pglockkit.job_keys AS k (queue, key, running, lim)
        VALUES (_pin_job_key.queue, _pin_job_key.key, 0, _pin_job_key.lim)
        ON CONFLICT DO NOTHING;
        EXIT WHEN FOUND;
    END LOOP;
END
$$;
COMMENT ON FUNCTION pglockkit._pin_job_key(text, text, integer) IS
    'Private: locks the job_keys row of (queue, key) FOR KEY SHARE until the transaction ends, creating it (running 0, limit lim) if it is gone, so that prune_jobs cannot delete the row of a key the transaction adds work to.';

CREATE FUNCTION pglockkit._pin_job_key_on_insert() RETURNS trigger
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pglockkit._pin_job_key(NEW.queue, NEW.concurrency_key, NEW.concurrency_limit);
    RETURN NEW;
END
$$;
COMMENT ON FUNCTION pglockkit._pin_job_key_on_insert() IS
    'Private: BEFORE INSERT trigger of pglockkit.jobs for keyed jobs: pins the key''s job_keys row (see _pin_job_key).';

CREATE TRIGGER jobs_pin_key BEFORE INSERT ON pglockkit.jobs
    FOR EACH ROW WHEN (NEW.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION pglockkit._pin_job_key_on_insert();

CREATE FUNCTION pglockkit.set_max_payload_bytes(bytes integer) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_old integer;
BEGIN
    IF set_max_payload_bytes.bytes IS NULL THEN
        RAISE EXCEPTION 'bytes must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF set_max_payload_bytes.bytes NOT BETWEEN 4096 AND 268435455 THEN
        RAISE EXCEPTION 'max_payload_bytes % is out of range', set_max_payload_bytes.bytes
            USING ERRCODE = 'numeric_value_out_of_range',
                  HINT = 'max_payload_bytes is 4096 (4 kB) to 268435455 (jsonb''s own maximum, 256 MB).';
    END IF;
    SELECT c.max_payload_bytes INTO v_old FROM pglockkit.config c FOR UPDATE;
    UPDATE pglockkit.config c SET max_payload_bytes = set_max_payload_bytes.bytes;
    RETURN v_old;
END
$$;
COMMENT ON FUNCTION pglockkit.set_max_payload_bytes(integer) IS
    'Sets the largest job payload enqueue_job and enqueue_jobs accept (bytes of the uncompressed jsonb, 4096 to 268435455; default 1048576) and returns the previous limit. pglockkit_admin only. Jobs already queued are kept.';

CREATE FUNCTION pglockkit._check_payloads(payloads jsonb[]) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_limit integer;
    v_n     bigint;
    v_size  integer;
BEGIN
    -- Called (by the enqueue functions, as their owner) only when a payload arrived over 4096
    -- bytes or TOAST-compressed (read from a table): #> '{}' returns the value uncompressed.
    SELECT c.max_payload_bytes INTO v_limit FROM pglockkit.config c;
    SELECT p.n, s.size INTO v_n, v_size
      FROM pg_catalog.unnest(payloads) WITH ORDINALITY AS p(payload, n),
           LATERAL (SELECT pg_catalog.pg_column_size(p.payload #> '{}'::text[]) AS size) s
     WHERE s.size > v_limit
     ORDER BY p.n
     LIMIT 1;
    IF v_n IS NOT NULL THEN
        RAISE EXCEPTION 'job payload%is % bytes, over the limit max_payload_bytes %',
            CASE WHEN pg_catalog.cardinality(payloads) > 1
                 THEN pg_catalog.format(' %s of %s ', v_n, pg_catalog.cardinality(payloads)) ELSE ' ' END,
            v_size, v_limit
            USING ERRCODE = 'program_limit_exceeded',
                  DETAIL = 'The size is pg_column_size of the uncompressed jsonb value. Nothing was enqueued.',
                  HINT = 'Store large data elsewhere and enqueue a reference to it; or pglockkit_admin raises the limit: SELECT pglockkit.set_max_payload_bytes(n);';
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._check_payloads(jsonb[]) IS
    'Private: 54000 naming the first payload over max_payload_bytes (uncompressed jsonb size), with its size and the limit.';

CREATE VIEW pglockkit.queue_stats AS
SELECT coalesce(s.queue, p.queue) AS queue,
       coalesce(s.ready, 0) AS ready, coalesce(s.scheduled, 0) AS scheduled, coalesce(s.running, 0) AS running,
       coalesce(s.expired_leases, 0) AS expired_leases, coalesce(s.done, 0) AS done, coalesce(s.dead, 0) AS dead,
       coalesce(s.cancelled, 0) AS cancelled, s.oldest_ready_age, coalesce(s.done_last_minute, 0) AS done_last_minute,
       p.queue IS NOT NULL AS paused
  FROM (SELECT j.queue,
               pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'queued' AND j.run_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()) AS ready,
               pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'queued' AND j.run_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()) AS scheduled,
               pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'running') AS running,
               pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'running' AND j.lease_expires_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()) AS expired_leases,
               pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'done') AS done,
               pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'dead') AS dead,
               pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'cancelled') AS cancelled,
               pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-)
                   -- A run_at of -infinity (stored before such times were refused) counts from the job's created_at.
                   pg_catalog.min(CASE WHEN pg_catalog.isfinite(j.run_at) THEN j.run_at ELSE j.created_at END) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'queued' AND j.run_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()) AS oldest_ready_age,
               pg_catalog.count(*) FILTER (WHERE j.finished_at OPERATOR(pg_catalog.>) (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) interval '1 minute')
                                            AND j.status OPERATOR(pg_catalog.=) 'done') AS done_last_minute
          FROM pglockkit.jobs j
         GROUP BY j.queue) s
  FULL JOIN pglockkit.paused_queues p ON p.queue OPERATOR(pg_catalog.=) s.queue;
COMMENT ON VIEW pglockkit.queue_stats IS
    'Per queue: jobs ready, scheduled for later, running, with expired leases (workers gone), done, dead, cancelled; the age of the oldest ready job (lag: since its run_at, or its created_at for a run_at of -infinity), jobs done in the last minute, and whether the queue is paused (pause_queue; a paused queue without jobs has a row of zeros). Scans the table: for dashboards, not hot paths.';

CREATE VIEW pglockkit.rate_limits AS
SELECT q.queue, q.key, q.rate, q.per, q.burst,
       GREATEST(q.tat OPERATOR(pg_catalog.-) (q.step OPERATOR(pg_catalog.*) (q.burst OPERATOR(pg_catalog.-) 1)), n.t) AS next_allowed_at,
       GREATEST(pg_catalog.floor(EXTRACT(epoch FROM (n.t OPERATOR(pg_catalog.+) (q.step OPERATOR(pg_catalog.*) q.burst))
                                                    OPERATOR(pg_catalog.-) GREATEST(q.tat, n.t))
                                 OPERATOR(pg_catalog./) EXTRACT(epoch FROM q.step)), 0)::integer AS tokens,
       (SELECT pg_catalog.count(*) FROM pglockkit.jobs j
         WHERE j.queue OPERATOR(pg_catalog.=) q.queue AND j.rate_key OPERATOR(pg_catalog.=) q.key
           AND j.status OPERATOR(pg_catalog.=) 'queued' AND j.run_at OPERATOR(pg_catalog.<=) n.t) AS waiting
  FROM pglockkit.job_rates q
 CROSS JOIN (SELECT pg_catalog.clock_timestamp() AS t) n;
COMMENT ON VIEW pglockkit.rate_limits IS
    'One row per rate-limited key of a queue (set_rate_limit): rate jobs per per, burst; next_allowed_at, when claim_job may next start a job of the key (now if it may now); tokens, how many it may start at once now; waiting, the key''s due queued jobs.';

CREATE VIEW pglockkit.settings AS
SELECT 'max_payload_bytes'::text AS name, c.max_payload_bytes::bigint AS value,
       'The largest job payload enqueue_job and enqueue_jobs accept, in bytes of the uncompressed jsonb value (pg_column_size); 54000 above it. Set with set_max_payload_bytes.'::text AS description
  FROM pglockkit.config c;
COMMENT ON VIEW pglockkit.settings IS
    'pglockkit''s settings, one row each: name, value, what it does. Readable by every pglockkit_user; pglockkit_admin changes them with the set_* functions.';
