-- Back to one session key per lease name (0002's renew_lease and release_lease, 0011's
-- acquire_lease), tokens counted per row, no pruning of leases or runs. A name pruned before the
-- rollback starts again at token 1: roll back only where no writer still holds an old token.

DROP FUNCTION pglockkit.prune_runs(interval);
DROP FUNCTION pglockkit.prune_leases(interval);

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

COMMENT ON FUNCTION pglockkit.acquire_lease(text, text, interval, boolean) IS
    'Acquires the lease on name for ttl (server clock) and returns its fencing token, strictly increasing per name across every acquisition; NULL while another holder''s lease is live. The live holder acquiring again renews it and gets the same token. bind_session => true also ties the lease to this backend: when the backend ends, the lease is free at once instead of after the ttl (needs a direct, unpooled connection).';

CREATE OR REPLACE FUNCTION pglockkit.renew_lease(name text, holder text, token bigint, ttl interval) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := pg_catalog.clock_timestamp();
BEGIN
    PERFORM pglockkit._check_lease_args(renew_lease.name, renew_lease.holder, renew_lease.ttl);
    IF renew_lease.token IS NULL THEN
        RAISE EXCEPTION 'lease token must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    UPDATE pglockkit.leases l
       SET renewed_at = v_now, expires_at = v_now OPERATOR(pg_catalog.+) renew_lease.ttl
     WHERE l.name OPERATOR(pg_catalog.=) renew_lease.name
       AND l.holder OPERATOR(pg_catalog.=) renew_lease.holder
       AND l.token OPERATOR(pg_catalog.=) renew_lease.token
       AND l.released_at IS NULL
       AND l.expires_at OPERATOR(pg_catalog.>) v_now;
    RETURN FOUND;
END
$$;

COMMENT ON FUNCTION pglockkit.renew_lease(text, text, bigint, interval) IS
    'Extends a live lease to now + ttl. True only for the current holder with the current token before expiry; false (nothing changed) otherwise: the lease is lost, stop writing.';

CREATE OR REPLACE FUNCTION pglockkit.release_lease(name text, holder text, token bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_bound boolean;
BEGIN
    -- (release takes no ttl: a placeholder satisfies the shared check)
    PERFORM pglockkit._check_lease_args(release_lease.name, release_lease.holder, interval '1 second');
    IF release_lease.token IS NULL THEN
        RAISE EXCEPTION 'lease token must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    UPDATE pglockkit.leases l
       SET released_at = pg_catalog.clock_timestamp()
     WHERE l.name OPERATOR(pg_catalog.=) release_lease.name
       AND l.holder OPERATOR(pg_catalog.=) release_lease.holder
       AND l.token OPERATOR(pg_catalog.=) release_lease.token
       AND l.released_at IS NULL
    RETURNING l.session_bound INTO v_bound;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF v_bound AND pglockkit._advisory_held(pglockkit._lease_session_key(release_lease.name), true)
    THEN
        PERFORM pg_catalog.pg_advisory_unlock(pglockkit._lease_session_key(release_lease.name));
    END IF;
    RETURN true;
END
$$;

COMMENT ON FUNCTION pglockkit.release_lease(text, text, bigint) IS
    'Releases the lease so that the next acquire_lease gets it at once (with the next token). True for the current holder with the current token; false (nothing changed) otherwise.';

CREATE OR REPLACE FUNCTION pglockkit._admin_only(proname name) RETURNS boolean
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT proname OPERATOR(pg_catalog.=) ANY ('{register_namespace,prune_jobs,retry_dead_jobs,sample}'::name[]) $$;

DROP FUNCTION pglockkit._lease_drop_stale_key(text);
DROP FUNCTION pglockkit._lease_session_key(text, integer);
ALTER TABLE pglockkit.leases DROP COLUMN session_key;
COMMENT ON TABLE pglockkit.leases IS
    'Leases, one row per name, kept forever so that fencing tokens never repeat. Write it through acquire_lease / renew_lease / release_lease.';

DROP SEQUENCE pglockkit.lease_tokens;

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;
