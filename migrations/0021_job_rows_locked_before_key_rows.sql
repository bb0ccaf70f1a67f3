-- pglockkit 0021: job rows are locked before key rows, by a worker's group too.
-- * A complete_jobs whose tokens went stale while it ran (0020) holds the job rows it reached,
--   going on to the key rows of its current jobs. A worker's group that recorded a failure held a
--   key row after its first statement, and its fail_job waited for a job row the stale call held:
--   a deadlock (40P01).
-- * _lock_jobs(ids, tokens) locks the running jobs of (id, token) pairs in id order, waiting.
--   A worker's group that records its outcomes in more than one statement (a failure among them)
--   begins with it, so that no group holds a key row while it waits for a job row, as
--   complete_jobs does in its one statement (0020). complete_jobs is unchanged: a second
--   statement would cost its batches a nested call.

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
    'Private: locks the running jobs of these (id, token) pairs in id order, waiting for each: what complete_jobs does in its one statement, for a worker''s group that records its outcomes in several, so that job rows are always locked in one order and before key rows.';

SELECT pglockkit._grant_privileges();
