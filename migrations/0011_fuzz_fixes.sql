-- pglockkit 0011: fixes for what the SQL fuzz test (tests/test_fuzz_sql.py) found.
--
-- * start_run called twice in one session ran the slot twice and left its key held twice; a
--   start_run whose insert failed, or whose transaction rolled back, left the slot's key held, so
--   no other pod could start the slot while that session lived. Now a second call in the session
--   returns NULL while the slot runs, a failed insert releases the key, and a session whose start
--   was rolled back can start again (the key it still holds is reused).
-- * acquire_lease(..., bind_session => true) by a session that already held the lease's key took
--   it a second time, and release_lease then left it held.
-- * Names longer than an index entry can hold (queue, dedup and concurrency keys, lease names, run
--   jobs and slots) failed with a bare 54000 "index row size exceeds btree maximum": they are now
--   refused by named CHECK constraints (23514) at 1024 bytes.
-- * A namespace lock_timeout over 24 days was accepted, and xact_lock failed later when it applied
--   it (lock_timeout holds at most 2^31 - 1 ms): refused at registration now (23514).

CREATE OR REPLACE FUNCTION pglockkit.start_run(job text, slot text, holder text) RETURNS bigint
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
    IF start_run.job OPERATOR(pg_catalog.=) '' OR start_run.slot OPERATOR(pg_catalog.=) '' OR start_run.holder OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'job, slot and holder must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_key := pglockkit._run_key(start_run.job, start_run.slot);
    IF pglockkit._advisory_held(v_key, true) THEN
        -- Advisory locks are re-entrant: this session already holds the slot's key. If it runs the
        -- slot now, once is enough. If not, its earlier start_run was rolled back with its
        -- transaction (the key outlives it): start the run on the key already held.
        IF EXISTS (SELECT FROM pglockkit.runs r
                    WHERE r.job OPERATOR(pg_catalog.=) start_run.job AND r.slot OPERATOR(pg_catalog.=) start_run.slot
                      AND r.status OPERATOR(pg_catalog.=) 'running'
                      AND r.holder_pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid()) THEN
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
       SET holder = excluded.holder, status = 'running', attempt = r.attempt OPERATOR(pg_catalog.+) 1,
           started_at = excluded.started_at, finished_at = NULL, detail = NULL, holder_pid = excluded.holder_pid
     WHERE r.status OPERATOR(pg_catalog.=) 'running'
    RETURNING r.id INTO v_id;
    EXCEPTION WHEN OTHERS THEN
        PERFORM pg_catalog.pg_advisory_unlock(v_key);
        RAISE;
    END;
    IF v_id IS NULL THEN
        PERFORM pg_catalog.pg_advisory_unlock(v_key);  -- the slot already ran
    END IF;
    RETURN v_id;
END
$$;

CREATE OR REPLACE FUNCTION pglockkit.acquire_lease(name text, holder text, ttl interval, bind_session boolean DEFAULT false)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now   timestamptz := pg_catalog.clock_timestamp();
    v_key   bigint := pglockkit._lease_session_key(acquire_lease.name);
    v_row   pglockkit.leases;
    v_token bigint;
BEGIN
    PERFORM pglockkit._check_lease_args(acquire_lease.name, acquire_lease.holder, acquire_lease.ttl);
    IF bind_session IS NULL THEN
        RAISE EXCEPTION 'bind_session must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;

    -- First acquisition of this name: the row does not exist yet.
    INSERT INTO pglockkit.leases AS l (name, holder, token, acquired_at, renewed_at, expires_at, session_bound, holder_pid)
    VALUES (acquire_lease.name, acquire_lease.holder, 1, v_now, v_now, v_now OPERATOR(pg_catalog.+) acquire_lease.ttl,
            bind_session, pg_catalog.pg_backend_pid())
    ON CONFLICT ON CONSTRAINT leases_pkey DO NOTHING;
    IF FOUND THEN
        v_token := 1;
    ELSE
        -- Lock the row: a concurrent acquirer waits here, then sees this transaction's outcome.
        SELECT * INTO v_row FROM pglockkit.leases l WHERE l.name OPERATOR(pg_catalog.=) acquire_lease.name FOR UPDATE;
        IF NOT FOUND THEN
            -- Only under REPEATABLE READ or SERIALIZABLE: the row was created after our snapshot.
            RAISE EXCEPTION 'lease "%" was created concurrently', acquire_lease.name
                USING ERRCODE = 'serialization_failure', HINT = 'Retry the transaction.';
        END IF;
        v_now := pg_catalog.clock_timestamp();  -- after any wait for the row
        IF v_row.released_at IS NULL AND v_row.expires_at OPERATOR(pg_catalog.>) v_now THEN
            IF v_row.holder OPERATOR(pg_catalog.=) acquire_lease.holder THEN
                -- The live holder acquiring again: a renewal, same token.
                UPDATE pglockkit.leases l
                   SET renewed_at = v_now, expires_at = v_now OPERATOR(pg_catalog.+) acquire_lease.ttl
                 WHERE l.name OPERATOR(pg_catalog.=) acquire_lease.name;
                RETURN v_row.token;
            END IF;
            IF NOT (v_row.session_bound AND pg_catalog.pg_try_advisory_xact_lock(v_key)) THEN
                -- Held by another (for a session-bound lease: its backend still holds the key).
                RETURN NULL;
            END IF;
        END IF;
        -- Free: released, expired, or its session-bound holder's backend is gone.
        v_token := v_row.token OPERATOR(pg_catalog.+) 1;
        UPDATE pglockkit.leases l
           SET holder = acquire_lease.holder, token = v_token, acquired_at = v_now, renewed_at = v_now,
               expires_at = v_now OPERATOR(pg_catalog.+) acquire_lease.ttl, released_at = NULL,
               session_bound = bind_session, holder_pid = pg_catalog.pg_backend_pid()
         WHERE l.name OPERATOR(pg_catalog.=) acquire_lease.name;
    END IF;

    -- Bind to the session key, once: a session that bound an earlier acquisition of this name (and
    -- still holds its key, advisory locks being re-entrant) must not take it a second time, or one
    -- release_lease would leave it held.
    IF bind_session AND NOT pglockkit._advisory_held(v_key, true) AND NOT pg_catalog.pg_try_advisory_lock(v_key) THEN
        -- Cannot happen unless someone took the key by hand; refuse rather than bind to nothing.
        RAISE EXCEPTION 'lease "%": its session key % is held by another session', acquire_lease.name, v_key
            USING ERRCODE = 'lock_not_available';
    END IF;
    RETURN v_token;
END
$$;

ALTER TABLE pglockkit.jobs
    ADD CONSTRAINT jobs_queue_length CHECK (pg_catalog.octet_length(queue) OPERATOR(pg_catalog.<=) 1024) NOT VALID,
    ADD CONSTRAINT jobs_dedup_key_length CHECK (pg_catalog.octet_length(dedup_key) OPERATOR(pg_catalog.<=) 1024) NOT VALID,
    ADD CONSTRAINT jobs_concurrency_key_length CHECK (pg_catalog.octet_length(concurrency_key) OPERATOR(pg_catalog.<=) 1024) NOT VALID;
ALTER TABLE pglockkit.job_keys
    ADD CONSTRAINT job_keys_queue_length CHECK (pg_catalog.octet_length(queue) OPERATOR(pg_catalog.<=) 1024) NOT VALID,
    ADD CONSTRAINT job_keys_key_length CHECK (pg_catalog.octet_length(key) OPERATOR(pg_catalog.<=) 1024) NOT VALID;
ALTER TABLE pglockkit.leases
    ADD CONSTRAINT leases_name_length CHECK (pg_catalog.octet_length(name) OPERATOR(pg_catalog.<=) 1024) NOT VALID;
ALTER TABLE pglockkit.runs
    ADD CONSTRAINT runs_job_length CHECK (pg_catalog.octet_length(job) OPERATOR(pg_catalog.<=) 1024) NOT VALID,
    ADD CONSTRAINT runs_slot_length CHECK (pg_catalog.octet_length(slot) OPERATOR(pg_catalog.<=) 1024) NOT VALID;
ALTER TABLE pglockkit.namespaces
    ADD CONSTRAINT namespaces_lock_timeout_max CHECK (lock_timeout OPERATOR(pg_catalog.<=) interval '24 days') NOT VALID;

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;
