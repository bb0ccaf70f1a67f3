-- pglockkit 0012: what an adversarial review of leases and runs found.
-- - acquire_lease(..., bind_session => true) by a lease's live holder renewed it without binding
--   it: a lease held unbound stayed unbound (it outlived its backend for the whole ttl), and a
--   pod back on a new connection kept the binding of its dead backend, so a rival took the lease
--   at once while the pod held it (its check_fence still failed). It now binds the lease to the
--   caller's backend, same token.
-- - release_lease by a holder past its ttl returned true (renew_lease said false): a holder past
--   its ttl is fenced like any stale holder, as documented.
-- - A ttl positive as an interval (a month is 30 days there) but moving the clock backwards
--   ('-2 mon 61 days', calendar months) gave a lease expired before it was acquired: 22023.
-- - check_fence('', token) said PK001 (no such lease), not 22023 like the other lease functions.
-- - finish_run finished any session's run: a runner whose session ended recorded its outcome over
--   the attempt that took its slot over (same run id), and a finish from another session left
--   the starter's slot lock held. Only the session that started a run and holds its slot lock
--   finishes it now; any other gets false, and nothing changes.

SET LOCAL search_path = pg_catalog, pg_temp;

CREATE OR REPLACE FUNCTION pglockkit._check_lease_args(name text, holder text, ttl interval) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF name IS NULL OR holder IS NULL OR ttl IS NULL THEN
        RAISE EXCEPTION 'lease name, holder and ttl must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF name = '' THEN
        RAISE EXCEPTION 'lease name must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF holder = '' THEN
        RAISE EXCEPTION 'lease holder must not be empty' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Name the holder so that lease_status says who has it, e.g. host:pid.';
    END IF;
    -- Positive as an interval (a month is 30 days there) and in effect: now + ttl is later than
    -- now, with calendar months ('-2 mon 61 days' is "positive" and 0 to 3 days backwards).
    IF ttl OPERATOR(pg_catalog.<=) interval '0'
       OR pg_catalog.statement_timestamp() OPERATOR(pg_catalog.+) ttl OPERATOR(pg_catalog.<=) pg_catalog.statement_timestamp() THEN
        RAISE EXCEPTION 'lease ttl must be positive, got %', ttl USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF ttl OPERATOR(pg_catalog.>) interval '1 year' THEN
        RAISE EXCEPTION 'lease ttl % is out of range', ttl USING ERRCODE = 'numeric_value_out_of_range',
            HINT = 'A lease is renewed while held; keep its ttl short (seconds to minutes).';
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._check_lease_args(text, text, interval) IS
    'Private: rejects NULL (22004), empty names or holders and non-positive ttls (22023), ttls over a year (22003).';

CREATE OR REPLACE FUNCTION pglockkit.acquire_lease(name text, holder text, ttl interval, bind_session boolean DEFAULT false)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now   timestamptz := pg_catalog.clock_timestamp();
    v_pid   integer := pg_catalog.pg_backend_pid();
    v_token bigint;
    v_got   timestamptz;  -- the clock once the common case's row is ours
BEGIN
    IF acquire_lease.name IS NULL OR acquire_lease.holder IS NULL OR acquire_lease.ttl IS NULL
       OR bind_session IS NULL OR acquire_lease.name = '' OR acquire_lease.holder = ''
       OR acquire_lease.ttl <= interval '0' OR acquire_lease.ttl > interval '1 year'
       OR v_now + acquire_lease.ttl <= v_now THEN
        PERFORM pglockkit._check_lease_args(acquire_lease.name, acquire_lease.holder, acquire_lease.ttl);
        IF bind_session IS NULL THEN
            RAISE EXCEPTION 'bind_session must not be null' USING ERRCODE = 'null_value_not_allowed';
        END IF;
        RAISE EXCEPTION 'lease ttl must be positive, got %', acquire_lease.ttl USING ERRCODE = 'invalid_parameter_value';
    END IF;

    IF NOT bind_session THEN
        UPDATE pglockkit.leases l
           SET holder = acquire_lease.holder,
               token = CASE WHEN l.released_at IS NULL AND l.expires_at > v_now
                            THEN l.token ELSE pg_catalog.nextval('pglockkit.lease_tokens') END,
               acquired_at = CASE WHEN l.released_at IS NULL AND l.expires_at > v_now
                                  THEN l.acquired_at ELSE v_now END,
               renewed_at = v_now, expires_at = v_now + acquire_lease.ttl, released_at = NULL,
               holder_pid = CASE WHEN l.released_at IS NULL AND l.expires_at > v_now
                                 THEN l.holder_pid ELSE v_pid END,
               session_key = NULL
         WHERE l.name = acquire_lease.name AND NOT l.session_bound
           AND (l.released_at IS NOT NULL OR l.expires_at <= v_now OR l.holder = acquire_lease.holder)
        RETURNING l.token, pg_catalog.clock_timestamp() INTO v_token, v_got;
        IF v_got - v_now <= interval '1 millisecond' THEN  -- NULL (false) if no row was updated
            RETURN v_token;
        END IF;
        IF FOUND THEN
            -- It waited for the row: the lease starts (or is renewed) when it got it.
            UPDATE pglockkit.leases l
               SET acquired_at = CASE WHEN l.acquired_at = v_now THEN v_got ELSE l.acquired_at END,
                   renewed_at = v_got, expires_at = v_got + acquire_lease.ttl
             WHERE l.name = acquire_lease.name;
            RETURN v_token;
        END IF;
        IF EXISTS (SELECT FROM pglockkit.leases h
                    WHERE h.name = acquire_lease.name AND h.released_at IS NULL
                      AND h.holder <> acquire_lease.holder AND NOT h.session_bound
                      AND h.expires_at > pg_catalog.clock_timestamp()) THEN
            RETURN NULL;  -- live, another holder's, unbound: seen without locking its row
        END IF;
    END IF;

    DECLARE
        v_key   bigint := pglockkit._lease_session_key(acquire_lease.name, v_pid);
        v_row   pglockkit.leases;
        v_bind  bigint;  -- the key this acquisition binds to, NULL if unbound
        v_xact  boolean := false;  -- this transaction holds v_key at transaction level (pg_locks
                                   -- shows it like a session lock, so _advisory_held cannot tell them apart)
        v_tries integer := 0;
        v_since timestamptz;       -- acquired_at of a live lease its holder binds (0012)
    BEGIN
        IF bind_session THEN
            v_bind := v_key;
        END IF;

        -- Lock the name's row: a concurrent acquirer waits here, then sees this transaction's
        -- outcome. A new name (or one whose row prune_leases deleted) first gets a row that is
        -- free; this transaction takes it below, like any free lease, with a token drawn once the
        -- row is ours.
        LOOP
            SELECT * INTO v_row FROM pglockkit.leases l WHERE l.name = acquire_lease.name FOR UPDATE;
            EXIT WHEN FOUND;
            v_tries := v_tries OPERATOR(pg_catalog.+) 1;
            IF v_tries > 3 THEN
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
        IF v_row.released_at IS NULL AND v_row.expires_at > v_now THEN
            IF v_row.holder = acquire_lease.holder THEN
                IF NOT bind_session THEN
                    -- The live holder acquiring again: a renewal, same token (a bound lease stays
                    -- bound to its backend).
                    UPDATE pglockkit.leases l
                       SET renewed_at = v_now, expires_at = v_now OPERATOR(pg_catalog.+) acquire_lease.ttl
                     WHERE l.name = acquire_lease.name;
                    RETURN v_row.token;
                END IF;
                -- The live holder binding its lease to this backend (it held the lease unbound,
                -- bound to a backend of its that ended, a pod back on a new connection, or bound
                -- here already): a renewal, same token, bound below like a lease taken, which
                -- takes this backend's key unless it holds it (0012). A key of this backend's pid
                -- that it does not hold (a reused pid) is taken too.
                v_token := v_row.token;
                v_since := v_row.acquired_at;
            ELSE
                -- Held by another. A session-bound lease is free early only if its holder's backend
                -- is gone: nobody holds its key (this session holding it is the holder, alive).
                IF NOT v_row.session_bound OR v_row.session_key IS NULL THEN
                    RETURN NULL;
                END IF;
                IF v_row.holder_pid = v_pid AND pglockkit._advisory_held(v_row.session_key, true) THEN
                    RETURN NULL;
                END IF;
                IF NOT pg_catalog.pg_try_advisory_xact_lock(v_row.session_key) THEN
                    RETURN NULL;
                END IF;
                v_xact := v_row.session_key = v_key;  -- its key is ours (this backend's pid, reused
                                                      -- or its session locks dropped by hand)
            END IF;
        END IF;

        -- Free: released, expired, or its session-bound holder's backend is gone. Whoever held it
        -- may still hold its own key: that blocks nobody, since this acquirer binds to a key of its
        -- own. The token is drawn while this transaction holds the row, so it is larger than every
        -- token of this name handed out before, even one whose row was pruned since.
        IF v_token IS NULL THEN
            v_token := pg_catalog.nextval('pglockkit.lease_tokens');
            v_since := v_now;
        END IF;
        UPDATE pglockkit.leases l
           SET holder = acquire_lease.holder, token = v_token, acquired_at = v_since, renewed_at = v_now,
               expires_at = v_now OPERATOR(pg_catalog.+) acquire_lease.ttl, released_at = NULL,
               session_bound = bind_session, holder_pid = v_pid,
               session_key = v_bind
         WHERE l.name = acquire_lease.name;

        IF v_row.session_bound AND v_row.holder_pid = v_pid
           AND v_row.session_key IS DISTINCT FROM v_bind
           AND pglockkit._advisory_held(v_row.session_key, true) THEN
            -- This session bound the lease before and takes it again unbound (or held an older
            -- kind of key): its old binding is stale.
            PERFORM pg_catalog.pg_advisory_unlock(v_row.session_key);
        END IF;
        -- Bind to the session key, once: a session that bound an earlier acquisition of this name
        -- (and still holds its key, advisory locks being re-entrant) must not take it a second
        -- time, or one release_lease would leave it held.
        IF bind_session AND (v_xact OR NOT pglockkit._advisory_held(v_key, true))
           AND NOT pg_catalog.pg_try_advisory_lock(v_key) THEN
            -- The key is this backend's own: only someone who took it by hand can hold it.
            RAISE EXCEPTION 'lease "%": its session key % is held by another session', acquire_lease.name, v_key
                USING ERRCODE = 'lock_not_available';
        END IF;
        RETURN v_token;
    END;
END
$$;
COMMENT ON FUNCTION pglockkit.acquire_lease(text, text, interval, boolean) IS
    'Acquires the lease on name for ttl (server clock) and returns its fencing token, strictly increasing per name across every acquisition (drawn from the sequence lease_tokens); NULL while another holder''s lease is live. The live holder acquiring again renews it and gets the same token (with bind_session => true, binding it to this backend). An expired or released lease is anyone''s, bound or not. bind_session => true also ties the lease to this backend: when the backend ends, the lease is free at once instead of after the ttl (needs a direct, unpooled connection).';

CREATE OR REPLACE FUNCTION pglockkit.renew_lease(name text, holder text, token bigint, ttl interval) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := pg_catalog.clock_timestamp();
BEGIN
    IF renew_lease.name IS NULL OR renew_lease.holder IS NULL OR renew_lease.ttl IS NULL
       OR renew_lease.name = '' OR renew_lease.holder = ''
       OR renew_lease.ttl <= interval '0' OR renew_lease.ttl > interval '1 year'
       OR v_now + renew_lease.ttl <= v_now THEN
        PERFORM pglockkit._check_lease_args(renew_lease.name, renew_lease.holder, renew_lease.ttl);
        RAISE EXCEPTION 'lease ttl must be positive, got %', renew_lease.ttl USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF renew_lease.token IS NULL THEN
        RAISE EXCEPTION 'lease token must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    UPDATE pglockkit.leases l
       SET renewed_at = v_now, expires_at = v_now OPERATOR(pg_catalog.+) renew_lease.ttl
     WHERE l.name = renew_lease.name
       AND l.holder = renew_lease.holder
       AND l.token = renew_lease.token
       AND l.released_at IS NULL
       AND l.expires_at > v_now;
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
    UPDATE pglockkit.leases l
       SET released_at = pg_catalog.clock_timestamp()
     WHERE l.name = release_lease.name
       AND l.holder = release_lease.holder
       AND l.token = release_lease.token
       AND l.released_at IS NULL
       AND l.expires_at > pg_catalog.clock_timestamp()
       AND NOT l.session_bound
       AND release_lease.holder <> '';
    IF FOUND THEN
        RETURN true;
    END IF;
    IF release_lease.name IS NULL OR release_lease.holder IS NULL OR release_lease.token IS NULL
       OR release_lease.name = '' OR release_lease.holder = '' THEN
        -- (release takes no ttl: a placeholder satisfies the shared check)
        PERFORM pglockkit._check_lease_args(release_lease.name, release_lease.holder, interval '1 second');
        RAISE EXCEPTION 'lease token must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- A session-bound lease, or not ours (any more: taken over, released, or past its ttl).
    UPDATE pglockkit.leases l
       SET released_at = pg_catalog.clock_timestamp()
     WHERE l.name = release_lease.name
       AND l.holder = release_lease.holder
       AND l.token = release_lease.token
       AND l.released_at IS NULL
       AND l.expires_at > pg_catalog.clock_timestamp()
    RETURNING l.session_bound, l.session_key INTO v_bound, v_key;
    IF NOT v_bound THEN  -- unbound: only if the row changed since the first look
        RETURN true;
    END IF;
    IF v_bound IS NULL THEN
        -- Not ours (any more): a stale bound holder lets go of its key.
        PERFORM pglockkit._lease_drop_stale_key(release_lease.name);
        RETURN false;
    END IF;
    IF v_key IS NOT NULL AND pglockkit._advisory_held(v_key, true) THEN
        PERFORM pg_catalog.pg_advisory_unlock(v_key);
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.release_lease(text, text, bigint) IS
    'Releases the lease so that the next acquire_lease gets it at once (with the next token). True for the current holder with the current token before expiry; false (nothing changed) otherwise: a holder past its ttl is fenced like any stale holder. Unlocks this session''s key for the name unless the session still holds the lease bound.';

CREATE OR REPLACE FUNCTION pglockkit.check_fence(name text, token bigint) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_row pglockkit.leases;
BEGIN
    IF check_fence.name IS NULL OR check_fence.token IS NULL THEN
        RAISE EXCEPTION 'lease name and token must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF check_fence.name = '' THEN
        RAISE EXCEPTION 'lease name must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- FOR SHARE: until this transaction ends, nobody can renew, release or take over the lease,
    -- so the write it guards commits under the token it checked.
    SELECT * INTO v_row FROM pglockkit.leases l WHERE l.name = check_fence.name FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'fence check failed: no lease named "%"', check_fence.name
            USING ERRCODE = 'PK001', HINT = 'Acquire the lease first: SELECT pglockkit.acquire_lease(name, holder, ttl).';
    END IF;
    IF v_row.token <> check_fence.token THEN
        RAISE EXCEPTION 'fence check failed: token % of lease "%" is stale (current token %, held by %)',
                check_fence.token, check_fence.name, v_row.token, v_row.holder
            USING ERRCODE = 'PK001', HINT = 'The lease changed hands: this writer must stop and not retry with the old token.';
    END IF;
    IF v_row.released_at IS NOT NULL THEN
        RAISE EXCEPTION 'fence check failed: lease "%" (token %) was released', check_fence.name, check_fence.token
            USING ERRCODE = 'PK001';
    END IF;
    IF v_row.expires_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp() THEN
        RAISE EXCEPTION 'fence check failed: lease "%" (token %) expired at %', check_fence.name, check_fence.token, v_row.expires_at
            USING ERRCODE = 'PK001', HINT = 'Renew the lease more often than its ttl.';
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit.check_fence(text, bigint) IS
    'Call inside the writer''s transaction before it writes: raises PK001 unless token is the live lease''s token, and holds the lease row (FOR SHARE) so that the lease cannot change hands before this transaction ends.';

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
    -- Fenced (0012): only the session running it finishes a run, the one whose backend started it
    -- and holds its slot's key. A runner whose session ended lost the run (the next start_run takes
    -- it over, under the same id): finishing it from a new session would record its outcome over
    -- the attempt that took over, and could not release the key the starter's session holds.
    UPDATE pglockkit.runs r
       SET status = CASE WHEN ok THEN 'succeeded' ELSE 'failed' END,
           finished_at = pg_catalog.clock_timestamp(), detail = finish_run.detail
     WHERE r.id = run_id AND r.status = 'running'
       AND r.holder_pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid()
       AND pglockkit._advisory_held(pglockkit._run_key(r.job, r.slot), true)
    RETURNING r.job, r.slot INTO v_job, v_slot;
    IF NOT FOUND THEN
        IF NOT EXISTS (SELECT FROM pglockkit.runs r WHERE r.id = run_id) THEN
            RAISE EXCEPTION 'no run with id %', run_id
                USING ERRCODE = 'undefined_object', SCHEMA = 'pglockkit', TABLE = 'runs';
        END IF;
        RETURN false;  -- already finished, or not this session's run
    END IF;
    PERFORM pg_catalog.pg_advisory_unlock(pglockkit._run_key(v_job, v_slot));
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.finish_run(bigint, boolean, text) IS
    'Records the outcome of a run (ok => succeeded, else failed, with detail) and releases its slot lock. Only the session that started the run and holds its slot lock may: true then; false, and nothing changed, if the run had already finished or is not this session''s (its session ended, and it may have been taken over); 42704 for an unknown id (its TABLE field says runs).';

SELECT pglockkit._grant_privileges();
