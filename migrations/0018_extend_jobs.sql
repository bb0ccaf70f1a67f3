-- pglockkit 0018: one heartbeat statement for every job a worker process has in flight.
--
-- A worker running many jobs at once (pglockkit work --concurrency N) extends all their leases
-- with one statement per tick instead of one per job. Each (id, token) pair is fenced like
-- extend_job: a stale token extends nothing. A job row locked by another transaction is passed
-- over (SKIP LOCKED), never waited for: such a row is being completed, failed or claimed by the
-- transaction that holds it (a worker's open group commit, typically its own), and a heartbeat
-- that waited on it would stop extending every other job of the process for as long as that
-- transaction stays open.

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
    IF pg_catalog.cardinality(ids) OPERATOR(pg_catalog.<>) pg_catalog.cardinality(tokens) THEN
        RAISE EXCEPTION 'ids and tokens differ in length (% and %)', pg_catalog.cardinality(ids), pg_catalog.cardinality(tokens)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pglockkit._check_lease(extend_jobs.lease);
    WITH mine AS (
        SELECT j.id
          FROM pglockkit.jobs j
          JOIN ROWS FROM (pg_catalog.unnest(ids), pg_catalog.unnest(tokens)) AS c(id, token)
            ON j.id OPERATOR(pg_catalog.=) c.id AND j.token OPERATOR(pg_catalog.=) c.token
         WHERE j.status OPERATOR(pg_catalog.=) 'running'
           FOR NO KEY UPDATE OF j SKIP LOCKED
    )
    UPDATE pglockkit.jobs j
       SET lease_expires_at = pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) extend_jobs.lease
      FROM mine
     WHERE j.id OPERATOR(pg_catalog.=) mine.id;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit.extend_jobs(bigint[], bigint[], interval) IS
    'Heartbeat for many jobs in one statement: each job whose (id, token) is its current claim and that is running now has its lease end lease from now. Returns how many were extended. Stale or unknown pairs are skipped, and so is a job row locked by another transaction (it is being completed, failed or claimed right now): never waits.';

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;
