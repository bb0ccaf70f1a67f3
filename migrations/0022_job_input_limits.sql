-- pglockkit 0022: what enters the job queue.
--
-- * 42704 says which table it looked in. A job id that does not exist and a namespace that is not
--   registered both raise 42704 (undefined_object); the error's SCHEMA and TABLE fields now say
--   pglockkit.jobs or pglockkit.namespaces, so a client tells them apart without parsing the
--   message (Python: UnknownJob and UnknownNamespace). A worker whose job was cancelled and
--   pruned under it got UnknownNamespace.
-- * Job times are finite. enqueue_job(run_at => '-infinity') was accepted: queue_stats' lag became
--   infinite (PostgreSQL 17+) or the view failed with 22008 "cannot subtract infinite timestamps"
--   (before 17), so pglockkit top and doctor showed no lag or stopped. run_at => 'infinity', or
--   fail_job(retry_in => 'infinity') (an interval from 17 on), made a job that never runs.
--   enqueue_job, enqueue_jobs and fail_job now refuse them with 22023 (claim_job, extend_job and
--   extend_jobs already refused an infinite lease: not positive, or over 7 days). queue_stats
--   measures a ready job stored with run_at -infinity (before this migration) from its created_at.
-- * A payload limit. Any payload up to jsonb's own maximum (256 MB) was accepted from any
--   pglockkit_user. Now enqueue_job and enqueue_jobs refuse a payload over max_payload_bytes
--   (default 1 MB, measured as pg_column_size of the uncompressed jsonb) with 54000
--   (program_limit_exceeded), a whole batch when one payload is over. Only pglockkit_admin sets it
--   (set_max_payload_bytes); everyone reads it in the view pglockkit.settings. The limit is at
--   least 4096 bytes, so a payload that arrives uncompressed and no larger than that is accepted
--   without reading the setting: the enqueue fast path runs no extra query.

CREATE TABLE pglockkit.config (
    singleton         boolean PRIMARY KEY DEFAULT true CONSTRAINT config_one_row CHECK (singleton),
    max_payload_bytes integer NOT NULL DEFAULT 1048576
                      CONSTRAINT config_max_payload_bytes_range CHECK (max_payload_bytes BETWEEN 4096 AND 268435455)
);
COMMENT ON TABLE pglockkit.config IS
    'pglockkit''s settings: one row. Change them with the set_* functions (pglockkit_admin); read them in pglockkit.settings.';
INSERT INTO pglockkit.config DEFAULT VALUES;

CREATE VIEW pglockkit.settings AS
SELECT 'max_payload_bytes'::text AS name, c.max_payload_bytes::bigint AS value,
       'The largest job payload enqueue_job and enqueue_jobs accept, in bytes of the uncompressed jsonb value (pg_column_size); 54000 above it. Set with set_max_payload_bytes.'::text AS description
  FROM pglockkit.config c;
COMMENT ON VIEW pglockkit.settings IS
    'pglockkit''s settings, one row each: name, value, what it does. Readable by every pglockkit_user; pglockkit_admin changes them with the set_* functions.';

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
           LATERAL (SELECT pg_catalog.pg_column_size(p.payload OPERATOR(pg_catalog.#>) '{}'::text[]) AS size) s
     WHERE s.size OPERATOR(pg_catalog.>) v_limit
     ORDER BY p.n
     LIMIT 1;
    IF v_n IS NOT NULL THEN
        RAISE EXCEPTION 'job payload%is % bytes, over the limit max_payload_bytes %',
            CASE WHEN pg_catalog.cardinality(payloads) OPERATOR(pg_catalog.>) 1
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
            USING ERRCODE = 'undefined_object', SCHEMA = 'pglockkit', TABLE = 'namespaces',
                  HINT = pg_catalog.format('Register it first: SELECT pglockkit.register_namespace(%L);', ns);
    END IF;
    RETURN v_id;
END
$$;
COMMENT ON FUNCTION pglockkit._ns_id(text) IS
    'Private: the id of a registered namespace; 22004 for NULL, 42704 for an unknown name (its TABLE field says namespaces).';

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
        RAISE EXCEPTION 'no job with id %', id
            USING ERRCODE = 'undefined_object', SCHEMA = 'pglockkit', TABLE = 'jobs';
    END IF;
    RETURN false;
END
$$;
COMMENT ON FUNCTION pglockkit._job_not_found(bigint) IS
    'Private: 42704 for an unknown job id (its TABLE field says jobs), else false (stale token or job not running).';

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
    IF NOT pg_catalog.isfinite(enqueue_job.run_at) THEN
        RAISE EXCEPTION 'run_at must be a finite time, got %', enqueue_job.run_at USING ERRCODE = 'invalid_parameter_value',
            HINT = 'A job due now takes now(); one that should never run is not enqueued (or is cancelled).';
    END IF;
    -- The payload limit: read only for a payload over its smallest value, or compressed.
    IF pg_catalog.pg_column_size(enqueue_job.payload) OPERATOR(pg_catalog.>) 4096
       OR pg_catalog.pg_column_compression(enqueue_job.payload) IS NOT NULL THEN
        PERFORM pglockkit._check_payloads(ARRAY[enqueue_job.payload]);
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
    'Adds a job and returns its id; NOTIFY pglockkit_jobs with the queue name wakes workers. A job is invisible until run_at. Higher priority is claimed first, then earlier run_at, then lower id. With a dedup_key, an unfinished (queued or running) job of the queue with that key is returned instead of a duplicate. With concurrency_key and concurrency_limit, at most that many jobs of the queue with that key run at once (other keys are not held up). run_at must be finite (22023); a payload over max_payload_bytes (pglockkit.settings) is refused with 54000.';

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
    IF NOT pg_catalog.isfinite(enqueue_jobs.run_at) THEN
        RAISE EXCEPTION 'run_at must be a finite time, got %', enqueue_jobs.run_at USING ERRCODE = 'invalid_parameter_value',
            HINT = 'A job due now takes now(); one that should never run is not enqueued (or is cancelled).';
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.unnest(payloads) AS p(payload)
                WHERE pg_catalog.pg_column_size(p.payload) OPERATOR(pg_catalog.>) 4096
                   OR pg_catalog.pg_column_compression(p.payload) IS NOT NULL) THEN
        PERFORM pglockkit._check_payloads(payloads);
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
    'Adds one job per payload in one statement (ids in payload order) and notifies once. run_at must be finite (22023); one payload over max_payload_bytes (pglockkit.settings) refuses the whole batch (54000).';

CREATE OR REPLACE FUNCTION pglockkit.fail_job(id bigint, token bigint, error text, retry_in interval DEFAULT NULL) RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
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
    'Records a failed attempt: returns ''queued'' (retried after retry_in, else exponential backoff with jitter), ''dead'' (that was the last attempt; kept for inspection and retry_dead_jobs), or ''stale'' (token not current: nothing changed). retry_in must be finite and not negative (22023).';

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
           -- A run_at of -infinity (stored before 0022) counts from the job's created_at.
           pg_catalog.min(CASE WHEN pg_catalog.isfinite(j.run_at) THEN j.run_at ELSE j.created_at END) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'queued' AND j.run_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()) AS oldest_ready_age,
       pg_catalog.count(*) FILTER (WHERE j.finished_at OPERATOR(pg_catalog.>) (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) interval '1 minute')
                                    AND j.status OPERATOR(pg_catalog.=) 'done') AS done_last_minute
  FROM pglockkit.jobs j
 GROUP BY j.queue;
COMMENT ON VIEW pglockkit.queue_stats IS
    'Per queue: jobs ready, scheduled for later, running, with expired leases (workers gone), done, dead, cancelled; the age of the oldest ready job (lag: since its run_at, or its created_at for a run_at of -infinity) and jobs done in the last minute. Scans the table: for dashboards, not hot paths.';

CREATE OR REPLACE FUNCTION pglockkit._admin_only(proname name) RETURNS boolean
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT proname OPERATOR(pg_catalog.=) ANY ('{register_namespace,prune_jobs,prune_leases,prune_runs,retry_dead_jobs,sample,set_max_payload_bytes}'::name[]) $$;
COMMENT ON FUNCTION pglockkit._admin_only(name) IS
    'Private: true for the functions only pglockkit_admin may execute (they change what every worker works with or may store, or delete history).';

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;
