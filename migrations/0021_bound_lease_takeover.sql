-- pglockkit 0021: an expired session-bound lease is free for anyone; lease and run rows can be pruned.
--
-- * A session-bound lease's holder kept one advisory key per lease name. A holder that stayed
--   connected past its ttl (a GC pause, the case leases exist for) kept that key, so a bound
--   acquirer of the expired lease failed with 55P03 for as long as the stale holder's session
--   lived, and a bound acquire rolled back with its transaction left the key held the same way (a
--   session lock outlives its transaction). The key's purpose stays: a bound lease is free at once
--   when its holder's backend ends. But the key is now the holder's own, derived from the name and
--   the holder's backend pid, and the lease row records it (session_key), so a stale or rolled-back
--   holder's key blocks nobody: whoever takes the lease binds it to a key of its own. A session
--   that no longer holds the lease lets go of its key when renew_lease or release_lease tells it
--   so (false), or when it takes the lease again unbound. Rows bound before this migration keep
--   the old key (_lease_session_key(name)) in session_key, so their holders stay bound.
-- * Fencing tokens come from one sequence, pglockkit.lease_tokens, drawn while the acquirer holds
--   the name's row. Each name's tokens still strictly increase with every acquisition (they may
--   skip values that other names took), and now they do even across a row deleted by
--   prune_leases: a deleted name's next token is drawn later than all its earlier ones.
-- * prune_leases(older_than) deletes leases released or expired more than older_than ago;
--   prune_runs(older_than) deletes runs that finished more than older_than ago. A pruned slot can
--   be started again (its row was the backstop): prune runs only for slots no pod can still start.
--   Both are pglockkit_admin's, like prune_jobs. An older_than past the calendar prunes nothing.

-- No acquisition commits while the token sequence starts above the tokens already handed out.
LOCK TABLE pglockkit.leases IN SHARE ROW EXCLUSIVE MODE;

CREATE SEQUENCE pglockkit.lease_tokens AS bigint NO CYCLE;
COMMENT ON SEQUENCE pglockkit.lease_tokens IS
    'Fencing tokens of leases: one per acquisition, drawn while the acquirer holds the name''s row, never reused; each name''s tokens strictly increase.';
DO $$
BEGIN
    PERFORM pg_catalog.setval('pglockkit.lease_tokens', m.token)
       FROM (SELECT pg_catalog.max(l.token) AS token FROM pglockkit.leases l) m
      WHERE m.token IS NOT NULL;
END
$$;

ALTER TABLE pglockkit.leases ADD COLUMN session_key bigint;
COMMENT ON COLUMN pglockkit.leases.session_key IS
    'For a session-bound lease: the advisory key its holder''s backend keeps locked while it holds the lease (free: the backend is gone).';
UPDATE pglockkit.leases l SET session_key = pglockkit._lease_session_key(l.name) WHERE l.session_bound;
COMMENT ON TABLE pglockkit.leases IS
    'Leases, one row per name. Write it through acquire_lease / renew_lease / release_lease; prune_leases deletes rows free for a while (tokens come from the sequence lease_tokens, so they never repeat).';

CREATE FUNCTION pglockkit._lease_session_key(name text, pid integer) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT pglockkit._key(pglockkit._ns_id_from_name('pglockkit'),
        'lease-session:' OPERATOR(pg_catalog.||) pid::text OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) name)
$$;
COMMENT ON FUNCTION pglockkit._lease_session_key(text, integer) IS
    'Private: the advisory key (namespace pglockkit, resource lease-session:<pid>:<name>) that backend pid keeps locked while it holds the session-bound lease on name. Inlined; fully qualified.';

CREATE FUNCTION pglockkit._lease_drop_stale_key(name text) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_key bigint := pglockkit._lease_session_key(_lease_drop_stale_key.name, pg_catalog.pg_backend_pid());
BEGIN
    IF NOT pglockkit._advisory_held(v_key, true)
       OR EXISTS (SELECT FROM pglockkit.leases l
                   WHERE l.name OPERATOR(pg_catalog.=) _lease_drop_stale_key.name
                     AND l.session_bound AND l.session_key OPERATOR(pg_catalog.=) v_key
                     AND l.released_at IS NULL AND l.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp())
    THEN
        RETURN false;
    END IF;
    RETURN pg_catalog.pg_advisory_unlock(v_key);
END
$$;
COMMENT ON FUNCTION pglockkit._lease_drop_stale_key(text) IS
    'Private: unlocks this session''s key for the lease on name unless this session still holds that lease bound and live (after it lost, expired or gave up the lease, or bound it in a transaction that rolled back). True if it unlocked. Reads pg_locks: for failure paths.';

CREATE OR REPLACE FUNCTION pglockkit.acquire_lease(name text, holder text, ttl interval, bind_session boolean DEFAULT false)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now   timestamptz;
    v_pid   integer := pg_catalog.pg_backend_pid();
    v_key   bigint := pglockkit._lease_session_key(acquire_lease.name, v_pid);
    v_row   pglockkit.leases;
    v_bind  bigint;  -- the key this acquisition binds to, NULL if unbound
    v_token bigint;
    v_tries integer := 0;
BEGIN
    PERFORM pglockkit._check_lease_args(acquire_lease.name, acquire_lease.holder, acquire_lease.ttl);
    IF bind_session IS NULL THEN
        RAISE EXCEPTION 'bind_session must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF bind_session THEN
        v_bind := v_key;
    END IF;

    -- Lock the name's row: a concurrent acquirer waits here, then sees this transaction's outcome.
    -- A new name (or one whose row prune_leases deleted) first gets a row that is free; this
    -- transaction takes it below, like any free lease, with a token drawn once the row is ours.
    LOOP
        SELECT * INTO v_row FROM pglockkit.leases l WHERE l.name OPERATOR(pg_catalog.=) acquire_lease.name FOR UPDATE;
        EXIT WHEN FOUND;
        v_tries := v_tries OPERATOR(pg_catalog.+) 1;
        IF v_tries OPERATOR(pg_catalog.>) 3 THEN
            -- Under REPEATABLE READ or SERIALIZABLE: the row was created after our snapshot.
            RAISE EXCEPTION 'lease "%" was created or deleted concurrently', acquire_lease.name
                USING ERRCODE = 'serialization_failure', HINT = 'Retry the transaction.';
        END IF;
        v_now := pg_catalog.clock_timestamp();
        INSERT INTO pglockkit.leases AS l (name, holder, token, acquired_at, renewed_at, expires_at, released_at)
        VALUES (acquire_lease.name, acquire_lease.holder, 1, v_now, v_now, v_now OPERATOR(pg_catalog.+) acquire_lease.ttl, v_now)
        ON CONFLICT ON CONSTRAINT leases_pkey DO NOTHING;
    END LOOP;

    v_now := pg_catalog.clock_timestamp();  -- after any wait for the row
    IF v_row.released_at IS NULL AND v_row.expires_at OPERATOR(pg_catalog.>) v_now THEN
        IF v_row.holder OPERATOR(pg_catalog.=) acquire_lease.holder THEN
            -- The live holder acquiring again: a renewal, same token.
            UPDATE pglockkit.leases l
               SET renewed_at = v_now, expires_at = v_now OPERATOR(pg_catalog.+) acquire_lease.ttl
             WHERE l.name OPERATOR(pg_catalog.=) acquire_lease.name;
            RETURN v_row.token;
        END IF;
        -- Held by another. A session-bound lease is free early only if its holder's backend is gone:
        -- nobody holds its key (this session holding it is the holder, alive).
        IF NOT v_row.session_bound OR v_row.session_key IS NULL THEN
            RETURN NULL;
        END IF;
        IF v_row.holder_pid OPERATOR(pg_catalog.=) v_pid AND pglockkit._advisory_held(v_row.session_key, true) THEN
            RETURN NULL;
        END IF;
        IF NOT pg_catalog.pg_try_advisory_xact_lock(v_row.session_key) THEN
            RETURN NULL;
        END IF;
    END IF;

    -- Free: released, expired, or its session-bound holder's backend is gone. Whoever held it may
    -- still hold its own key: that blocks nobody, since this acquirer binds to a key of its own.
    -- The token is drawn while this transaction holds the row, so it is larger than every token
    -- of this name handed out before, even one whose row was pruned since.
    v_token := pg_catalog.nextval('pglockkit.lease_tokens');
    UPDATE pglockkit.leases l
       SET holder = acquire_lease.holder, token = v_token, acquired_at = v_now, renewed_at = v_now,
           expires_at = v_now OPERATOR(pg_catalog.+) acquire_lease.ttl, released_at = NULL,
           session_bound = bind_session, holder_pid = v_pid,
           session_key = v_bind
     WHERE l.name OPERATOR(pg_catalog.=) acquire_lease.name;

    IF v_row.session_bound AND v_row.holder_pid OPERATOR(pg_catalog.=) v_pid
       AND v_row.session_key IS DISTINCT FROM v_bind
       AND pglockkit._advisory_held(v_row.session_key, true) THEN
        -- This session bound the lease before and takes it again unbound (or held an older kind
        -- of key): its old binding is stale.
        PERFORM pg_catalog.pg_advisory_unlock(v_row.session_key);
    END IF;
    -- Bind to the session key, once: a session that bound an earlier acquisition of this name (and
    -- still holds its key, advisory locks being re-entrant) must not take it a second time, or one
    -- release_lease would leave it held.
    IF bind_session AND NOT pglockkit._advisory_held(v_key, true) AND NOT pg_catalog.pg_try_advisory_lock(v_key) THEN
        -- The key is this backend's own: only someone who took it by hand can hold it.
        RAISE EXCEPTION 'lease "%": its session key % is held by another session', acquire_lease.name, v_key
            USING ERRCODE = 'lock_not_available';
    END IF;
    RETURN v_token;
END
$$;
COMMENT ON FUNCTION pglockkit.acquire_lease(text, text, interval, boolean) IS
    'Acquires the lease on name for ttl (server clock) and returns its fencing token, strictly increasing per name across every acquisition (drawn from the sequence lease_tokens); NULL while another holder''s lease is live. The live holder acquiring again renews it and gets the same token. An expired or released lease is anyone''s, bound or not. bind_session => true also ties the lease to this backend: when the backend ends, the lease is free at once instead of after the ttl (needs a direct, unpooled connection).';

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
    IF NOT FOUND THEN
        -- Lost: a bound holder lets go of its key (it would block nobody, but it is no longer ours).
        PERFORM pglockkit._lease_drop_stale_key(renew_lease.name);
        RETURN false;
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.renew_lease(text, text, bigint, interval) IS
    'Extends a live lease to now + ttl. True only for the current holder with the current token before expiry; false (nothing changed) otherwise: the lease is lost, stop writing. A false also unlocks this session''s key for the name unless the session still holds the lease bound.';

CREATE OR REPLACE FUNCTION pglockkit.release_lease(name text, holder text, token bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_bound boolean;
    v_key   bigint;
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
    RETURNING l.session_bound, l.session_key INTO v_bound, v_key;
    IF NOT FOUND THEN
        -- Not ours (any more): a stale bound holder lets go of its key.
        PERFORM pglockkit._lease_drop_stale_key(release_lease.name);
        RETURN false;
    END IF;
    IF v_bound AND v_key IS NOT NULL AND pglockkit._advisory_held(v_key, true) THEN
        PERFORM pg_catalog.pg_advisory_unlock(v_key);
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.release_lease(text, text, bigint) IS
    'Releases the lease so that the next acquire_lease gets it at once (with the next token). True for the current holder with the current token; false (nothing changed) otherwise. Unlocks this session''s key for the name unless the session still holds the lease bound.';

CREATE FUNCTION pglockkit.prune_leases(older_than interval) RETURNS bigint
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
    IF older_than OPERATOR(pg_catalog.<) interval '0' THEN
        RAISE EXCEPTION 'older_than must not be negative, got %', older_than USING ERRCODE = 'invalid_parameter_value';
    END IF;
    BEGIN
        v_before := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) older_than;
    EXCEPTION WHEN datetime_field_overflow THEN
        RETURN 0;  -- before the calendar starts: nothing is that old
    END;
    -- A row locked by an acquirer is waited for, then checked again: a lease taken meanwhile stays.
    DELETE FROM pglockkit.leases l
     WHERE coalesce(l.released_at, l.expires_at) OPERATOR(pg_catalog.<) v_before;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit.prune_leases(interval) IS
    'Deletes leases released, or expired, more than older_than ago; returns how many. Tokens never repeat: a pruned name''s next token is larger than all it had. A stale holder''s check_fence then fails with PK001 (no lease of that name). Run it from cron, e.g. prune_leases(''7 days'').';

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
    IF older_than OPERATOR(pg_catalog.<) interval '0' THEN
        RAISE EXCEPTION 'older_than must not be negative, got %', older_than USING ERRCODE = 'invalid_parameter_value';
    END IF;
    BEGIN
        v_before := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) older_than;
    EXCEPTION WHEN datetime_field_overflow THEN
        RETURN 0;  -- before the calendar starts: nothing is that old
    END;
    DELETE FROM pglockkit.runs r
     WHERE r.status IN ('succeeded', 'failed') AND r.finished_at OPERATOR(pg_catalog.<) v_before;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit.prune_runs(interval) IS
    'Deletes runs that finished (succeeded or failed) more than older_than ago; returns how many. Running and abandoned runs stay. A pruned slot''s row was its backstop: start_run can run that slot again, so prune only slots no pod can still start (for daily slots, e.g. prune_runs(''30 days'')).';

CREATE OR REPLACE FUNCTION pglockkit._admin_only(proname name) RETURNS boolean
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT proname OPERATOR(pg_catalog.=) ANY ('{register_namespace,prune_jobs,prune_leases,prune_runs,retry_dead_jobs,sample}'::name[]) $$;

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;
