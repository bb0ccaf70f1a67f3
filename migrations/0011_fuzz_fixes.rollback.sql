ALTER TABLE pglockkit.namespaces DROP CONSTRAINT namespaces_lock_timeout_max;
ALTER TABLE pglockkit.runs DROP CONSTRAINT runs_job_length, DROP CONSTRAINT runs_slot_length;
ALTER TABLE pglockkit.job_keys DROP CONSTRAINT job_keys_queue_length, DROP CONSTRAINT job_keys_key_length;
ALTER TABLE pglockkit.leases DROP CONSTRAINT leases_name_length;
ALTER TABLE pglockkit.jobs
    DROP CONSTRAINT jobs_queue_length, DROP CONSTRAINT jobs_dedup_key_length, DROP CONSTRAINT jobs_concurrency_key_length;

-- Back to 0002's acquire_lease and 0003's start_run.
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
    -- Herd guard: while a live session starts or runs this slot, everyone else returns at once.
    IF NOT pg_catalog.pg_try_advisory_lock(v_key) THEN
        RETURN NULL;
    END IF;
    -- Backstop: one row per (job, slot). We hold the key, so a row still 'running' lost its holder.
    INSERT INTO pglockkit.runs AS r (job, slot, holder, status, started_at, holder_pid)
    VALUES (start_run.job, start_run.slot, start_run.holder, 'running', pg_catalog.clock_timestamp(), pg_catalog.pg_backend_pid())
    ON CONFLICT ON CONSTRAINT runs_job_slot_key DO UPDATE
       SET holder = excluded.holder, status = 'running', attempt = r.attempt OPERATOR(pg_catalog.+) 1,
           started_at = excluded.started_at, finished_at = NULL, detail = NULL, holder_pid = excluded.holder_pid
     WHERE r.status OPERATOR(pg_catalog.=) 'running'
    RETURNING r.id INTO v_id;
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

    IF bind_session AND NOT pg_catalog.pg_try_advisory_lock(v_key) THEN
        -- Cannot happen unless someone took the key by hand; refuse rather than bind to nothing.
        RAISE EXCEPTION 'lease "%": its session key % is held by another session', acquire_lease.name, v_key
            USING ERRCODE = 'lock_not_available';
    END IF;
    RETURN v_token;
END
$$;
