-- pglockkit 0021: job rows are locked before key rows, by a worker's group too.
-- * A complete_jobs whose tokens went stale while it ran (0020) holds the job rows it reached,
--   going on to the key rows of its current jobs. A worker's group that recorded a failure held a
--   key row after its first statement, and its fail_job waited for a job row the stale call held:
--   a deadlock (40P01).
-- * _lock_jobs(ids, tokens) locks the running jobs of (id, token) pairs in id order, waiting.
--   complete_jobs calls it first, and a worker's group that records its outcomes in more than one
--   statement (a failure among them) begins with it, so that no group holds a key row while it
--   waits for a job row.

SET LOCAL search_path = pg_catalog, pg_temp;

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
    'Private: locks the running jobs of these (id, token) pairs in id order, waiting for each (complete_jobs, and a worker''s group before its outcomes), so that job rows are always locked in one order and before key rows.';

CREATE OR REPLACE FUNCTION pglockkit.complete_jobs(ids bigint[], tokens bigint[]) RETURNS integer
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
    IF pg_catalog.cardinality(ids) OPERATOR(pg_catalog.<>) pg_catalog.cardinality(tokens) THEN
        RAISE EXCEPTION 'ids and tokens differ in length (% and %)', pg_catalog.cardinality(ids), pg_catalog.cardinality(tokens)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pglockkit._lock_jobs(ids, tokens);  -- the job rows in id order, then the keys'
    WITH done AS (
        UPDATE pglockkit.jobs j
           SET status = 'done', finished_at = pg_catalog.clock_timestamp(), lease_expires_at = NULL
          FROM ROWS FROM (pg_catalog.unnest(ids), pg_catalog.unnest(tokens)) AS c(id, token)
         WHERE j.id = c.id AND j.token = c.token
           AND j.status = 'running'
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

SELECT pglockkit._grant_privileges();
