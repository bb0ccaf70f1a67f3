-- pglockkit 0020: complete_jobs locks its job rows in id order.
-- * A complete_jobs whose tokens went stale while it ran still locked each row it reached (the
--   newest version, to the end of its transaction: PostgreSQL locks a concurrently updated row
--   before it rechecks the WHERE clause) in the order of its arrays. The claimer that had
--   reclaimed those jobs, completing them in another order, and the stale caller each held a row
--   the other waited for: a deadlock (40P01), seen once in CI in the racing claimers' test. The
--   rows are now locked first, in id order, then the key rows in key order as before.

SET LOCAL search_path = pg_catalog, pg_temp;

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

SELECT pglockkit._grant_privileges();
