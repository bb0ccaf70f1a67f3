-- pglockkit 0009: finish_run's unknown run id is a tagged 42704 (its SCHEMA and TABLE fields say
-- pglockkit.runs, as a missing job's say pglockkit.jobs), so a client tells it from an unknown
-- namespace without reading the message (Python: pglockkit.UnknownRun). Same result otherwise.

SET LOCAL search_path = pg_catalog, pg_temp;

CREATE OR REPLACE FUNCTION pglockkit.finish_run(run_id bigint, ok boolean, detail text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job  text;
    v_slot text;
BEGIN
    IF run_id IS NULL OR ok IS NULL THEN
        RAISE EXCEPTION 'run_id and ok must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    UPDATE pglockkit.runs r
       SET status = CASE WHEN ok THEN 'succeeded' ELSE 'failed' END,
           finished_at = pg_catalog.clock_timestamp(), detail = finish_run.detail
     WHERE r.id = run_id AND r.status = 'running'
    RETURNING r.job, r.slot INTO v_job, v_slot;
    IF NOT FOUND THEN
        IF NOT EXISTS (SELECT FROM pglockkit.runs r WHERE r.id = run_id) THEN
            RAISE EXCEPTION 'no run with id %', run_id
                USING ERRCODE = 'undefined_object', SCHEMA = 'pglockkit', TABLE = 'runs';
        END IF;
        RETURN false;  -- already finished
    END IF;
    IF pglockkit._advisory_held(pglockkit._run_key(v_job, v_slot), true) THEN
        PERFORM pg_catalog.pg_advisory_unlock(pglockkit._run_key(v_job, v_slot));
    END IF;
    RETURN true;
END
$$;

COMMENT ON FUNCTION pglockkit.finish_run(bigint, boolean, text) IS
    'Records the outcome of a run (ok => succeeded, else failed, with detail) and releases its slot lock. True if the run was running; false if it had already finished; 42704 for an unknown id (its TABLE field says runs).';

SELECT pglockkit._grant_privileges();
