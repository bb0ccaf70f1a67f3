-- Back to the definitions before 0022 (those of 0001, 0004, 0009 and 0010): 42704 without the
-- table it looked in, infinite job times accepted, no payload limit.

DROP FUNCTION pglockkit.set_max_payload_bytes(integer);
DROP FUNCTION pglockkit._check_payloads(jsonb[]);
DROP VIEW pglockkit.settings;
DROP TABLE pglockkit.config;

CREATE OR REPLACE FUNCTION pglockkit._ns_id(ns text) RETURNS smallint
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id smallint;
BEGIN
    IF ns IS NULL THEN
        RAISE EXCEPTION 'lock namespace must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    SELECT n.id INTO v_id FROM pglockkit.namespaces n WHERE n.name OPERATOR(pg_catalog.=) ns;
    IF v_id IS NULL THEN
        RAISE EXCEPTION 'unknown lock namespace "%"', ns
            USING ERRCODE = 'undefined_object',
                  HINT = pg_catalog.format('Register it first: SELECT pglockkit.register_namespace(%L);', ns);
    END IF;
    RETURN v_id;
END
$$;
COMMENT ON FUNCTION pglockkit._ns_id(text) IS
    'Private: the id of a registered namespace; 22004 for NULL, 42704 for an unknown name.';

CREATE OR REPLACE FUNCTION pglockkit._job_not_found(id bigint) RETURNS boolean
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

CREATE OR REPLACE FUNCTION pglockkit.enqueue_job(
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

CREATE OR REPLACE FUNCTION pglockkit.enqueue_jobs(
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

CREATE OR REPLACE FUNCTION pglockkit.fail_job(id bigint, token bigint, error text, retry_in interval DEFAULT NULL) RETURNS text
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
ALTER FUNCTION pglockkit.fail_job(bigint, bigint, text, interval) SET enable_seqscan = off;

CREATE OR REPLACE VIEW pglockkit.queue_stats AS
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

CREATE OR REPLACE FUNCTION pglockkit._admin_only(proname name) RETURNS boolean
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT proname OPERATOR(pg_catalog.=) ANY ('{register_namespace,prune_jobs,prune_leases,prune_runs,retry_dead_jobs,sample}'::name[]) $$;
COMMENT ON FUNCTION pglockkit._admin_only(name) IS
    'Private: true for the functions only pglockkit_admin may execute (they change what every worker works with, or delete history).';

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;
