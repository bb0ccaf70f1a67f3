-- Runs: one run per job and slot (cron pods)
--
-- The current definition of each object, once. A change edits this file and adds a delta
-- migration (see CONTRIBUTING.md); a test checks that both build the same schema.

CREATE TABLE pglockkit.runs (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job         text        NOT NULL CHECK (job OPERATOR(pg_catalog.<>) ''),
    slot        text        NOT NULL CHECK (slot OPERATOR(pg_catalog.<>) ''),
    holder      text        NOT NULL,
    status      text        NOT NULL CHECK (status IN ('running', 'succeeded', 'failed')),
    attempt     integer     NOT NULL DEFAULT 1,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz,
    detail      text,
    holder_pid  integer,
    CONSTRAINT runs_job_slot_key UNIQUE (job, slot),
    CONSTRAINT runs_job_length CHECK (pg_catalog.octet_length(job) OPERATOR(pg_catalog.<=) 1024),
    CONSTRAINT runs_slot_length CHECK (pg_catalog.octet_length(slot) OPERATOR(pg_catalog.<=) 1024)
);
COMMENT ON TABLE pglockkit.runs IS
    'One row per (job, slot) that started. Write it through start_run / finish_run; read pglockkit.run_history.';

CREATE FUNCTION pglockkit._run_key(job text, slot text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT pglockkit._key(pglockkit._ns_id_from_name('pglockkit'),
        'run:' OPERATOR(pg_catalog.||) pg_catalog.length(job)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
               OPERATOR(pg_catalog.||) job OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) slot)
$$;
COMMENT ON FUNCTION pglockkit._run_key(text, text) IS
    'Private: the advisory key (namespace pglockkit, resource run:<len(job)>:<job>:<slot>) that a run''s starter holds while it runs. Inlined, its text parsed in the caller''s context (run_history''s reader''s): every name in it, types included, is qualified.';

CREATE FUNCTION pglockkit.start_run(job text, slot text, holder text) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_key bigint;
    v_id  bigint;
BEGIN
    IF start_run.job IS NULL OR start_run.slot IS NULL OR start_run.holder IS NULL THEN
        RAISE EXCEPTION 'job, slot and holder must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF start_run.job = '' OR start_run.slot = '' OR start_run.holder = '' THEN
        RAISE EXCEPTION 'job, slot and holder must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_key := pglockkit._run_key(start_run.job, start_run.slot);
    IF pglockkit._advisory_held(v_key, true) THEN
        -- Advisory locks are re-entrant: this session already holds the slot's key. If it runs the
        -- slot now, once is enough. If not, its earlier start_run was rolled back with its
        -- transaction (the key outlives it): start the run on the key already held.
        IF EXISTS (SELECT FROM pglockkit.runs r
                    WHERE r.job = start_run.job AND r.slot = start_run.slot
                      AND r.status = 'running'
                      AND r.holder_pid = pg_catalog.pg_backend_pid()) THEN
            RETURN NULL;
        END IF;
    -- Herd guard: while a live session starts or runs this slot, everyone else returns at once.
    ELSIF NOT pg_catalog.pg_try_advisory_lock(v_key) THEN
        RETURN NULL;
    END IF;
    -- Backstop: one row per (job, slot). We hold the key, so a row still 'running' lost its holder.
    -- A failed insert (e.g. a job name too long for the index) must not leave the key held.
    BEGIN
    INSERT INTO pglockkit.runs AS r (job, slot, holder, status, started_at, holder_pid)
    VALUES (start_run.job, start_run.slot, start_run.holder, 'running', pg_catalog.clock_timestamp(), pg_catalog.pg_backend_pid())
    ON CONFLICT ON CONSTRAINT runs_job_slot_key DO UPDATE
       SET holder = excluded.holder, status = 'running', attempt = r.attempt + 1,
           started_at = excluded.started_at, finished_at = NULL, detail = NULL, holder_pid = excluded.holder_pid
     WHERE r.status = 'running'
    RETURNING r.id INTO v_id;
    EXCEPTION WHEN OTHERS OR query_canceled THEN  -- OTHERS leaves out a statement_timeout (0015)
        PERFORM pg_catalog.pg_advisory_unlock(v_key);
        RAISE;
    END;
    IF v_id IS NULL THEN
        PERFORM pg_catalog.pg_advisory_unlock(v_key);  -- the slot already ran
    END IF;
    RETURN v_id;
END
$$;
COMMENT ON FUNCTION pglockkit.start_run(text, text, text) IS
    'Starts the run of job for slot (e.g. a date) and returns its id, or NULL if that slot already ran or another live session is running it. The calling session keeps a lock on the slot until finish_run or its end: call it on a direct connection, not through a transaction-mode pooler. A run whose session ended before finish_run is re-run by the next start_run (attempt + 1).';

CREATE FUNCTION pglockkit.finish_run(run_id bigint, ok boolean, detail text DEFAULT NULL) RETURNS boolean
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
    -- Fenced (0012): only the session running it finishes a run, the one whose backend started it
    -- and holds its slot's key. A runner whose session ended lost the run (the next start_run takes
    -- it over, under the same id): finishing it from a new session would record its outcome over
    -- the attempt that took over, and could not release the key the starter's session holds.
    UPDATE pglockkit.runs r
       SET status = CASE WHEN ok THEN 'succeeded' ELSE 'failed' END,
           finished_at = pg_catalog.clock_timestamp(), detail = finish_run.detail
     WHERE r.id = run_id AND r.status = 'running'
       AND r.holder_pid = pg_catalog.pg_backend_pid()
       AND pglockkit._advisory_held(pglockkit._run_key(r.job, r.slot), true)
    RETURNING r.job, r.slot INTO v_job, v_slot;
    IF NOT FOUND THEN
        IF NOT EXISTS (SELECT FROM pglockkit.runs r WHERE r.id = run_id) THEN
            RAISE EXCEPTION 'no run with id %', run_id
                USING ERRCODE = 'undefined_object', SCHEMA = 'pglockkit', TABLE = 'runs';
        END IF;
        RETURN false;  -- already finished, or not this session's run
    END IF;
    -- The slot's key is let go of when this transaction commits (trigger runs_release_slot), not
    -- here: a session lock outlives a rollback, and a finish that rolled back would leave the live
    -- runner's slot free for the next start_run, which would run it again (0015).
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.finish_run(bigint, boolean, text) IS
    'Records the outcome of a run (ok => succeeded, else failed, with detail) and releases its slot lock when the transaction commits (rolled back, the run is still this session''s to finish). Only the session that started the run and holds its slot lock may: true then; false, and nothing changed, if the run had already finished or is not this session''s (its session ended, and it may have been taken over); 42704 for an unknown id (its TABLE field says runs).';

-- Lets go of a finished run's slot key at commit, in the runner's session: deferred, so that a
-- finish_run whose transaction rolls back leaves the slot held by its live runner (0015).
CREATE FUNCTION pglockkit._release_finished_run() RETURNS trigger
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NEW.holder_pid = pg_backend_pid() THEN  -- finish_run checked that this session holds the key
        PERFORM pg_advisory_unlock(pglockkit._run_key(NEW.job, NEW.slot));
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pglockkit._release_finished_run() IS
    'Private: trigger runs_release_slot, at the commit of a finish_run: the runner''s session lets go of the slot''s key.';

CREATE CONSTRAINT TRIGGER runs_release_slot
    AFTER UPDATE OF status ON pglockkit.runs
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (OLD.status = 'running' AND NEW.status <> 'running')
    EXECUTE FUNCTION pglockkit._release_finished_run();

CREATE FUNCTION pglockkit.prune_runs(older_than interval) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_before timestamptz;
    v_n      bigint;
BEGIN
    IF older_than IS NULL THEN
        RAISE EXCEPTION 'older_than must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF older_than < interval '0' THEN
        RAISE EXCEPTION 'older_than must not be negative, got %', older_than USING ERRCODE = 'invalid_parameter_value';
    END IF;
    BEGIN
        v_before := pg_catalog.clock_timestamp() - older_than;
    EXCEPTION WHEN datetime_field_overflow THEN
        RETURN 0;  -- before the calendar starts: nothing is that old
    END;
    DELETE FROM pglockkit.runs r
     WHERE r.status IN ('succeeded', 'failed') AND r.finished_at < v_before;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit.prune_runs(interval) IS
    'Deletes runs that finished (succeeded or failed) more than older_than ago; returns how many. Running and abandoned runs stay. A pruned slot''s row was its backstop: start_run can run that slot again, so prune only slots no pod can still start (for daily slots, e.g. prune_runs(''30 days'')).';

CREATE VIEW pglockkit.run_history AS
SELECT r.id, r.job, r.slot, r.holder,
       CASE WHEN r.status OPERATOR(pg_catalog.=) 'running'
                 AND NOT pglockkit._advisory_held(pglockkit._run_key(r.job, r.slot), false)
            THEN 'abandoned' ELSE r.status END AS status,
       r.attempt, r.started_at, r.finished_at,
       coalesce(r.finished_at, pg_catalog.clock_timestamp()) OPERATOR(pg_catalog.-) r.started_at AS duration,
       r.detail, r.holder_pid
  FROM pglockkit.runs r;
COMMENT ON VIEW pglockkit.run_history IS
    'Every singleton run with its outcome and duration. status ''abandoned'': still marked running but its holder''s session is gone; the next start_run of that slot re-runs it.';
