-- pglockkit 0019: a free lease is taken by locking its row, skipping a row locked (issue 16).
-- * 0018 had a taker of a free lease try its take guard, a transaction-level advisory lock held
--   until the transaction ended: a transaction taking thousands of leases filled the server's
--   shared lock table (other sessions' locks failed with 53200), and two names whose 47-bit hashes
--   collide shared a guard, so one answered NULL while the other was being taken. A free row is
--   now taken by whoever locks it first (FOR NO KEY UPDATE SKIP LOCKED, the lock kept in the row);
--   a row another transaction has locked answers NULL at once, also a fenced writer's, which a
--   taker used to wait for. Only a new name's creation still takes the guard (an INSERT would wait
--   for a concurrent one), for a transaction's first max_locks_per_transaction / 2 new names; a
--   creator whose INSERT found another's row answers NULL without locking it.
-- * A takeover of a lease bound to a backend that is gone tries the dead key and lets it go at
--   once (a transaction-level try-lock held an entry of the lock table per lease taken over), and
--   the general path no longer locks a row another holder took since its look.

SET LOCAL search_path = pg_catalog, pg_temp;

CREATE FUNCTION pglockkit._advisory_free(key bigint) RETURNS boolean
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT CASE WHEN pg_catalog.pg_try_advisory_lock(key) THEN pg_catalog.pg_advisory_unlock(key) ELSE false END;
END;
COMMENT ON FUNCTION pglockkit._advisory_free(bigint) IS
    'Private: whether no other session holds the bigint advisory key, by trying it at session level and letting it go at once (a lock kept to the end of a transaction would hold an entry of the server''s shared lock table). Inlined.';

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
    v_state text;         -- the row on a new look: 'mine' (live), 'taken', 'bound' (live,
                          -- another's), 'tried' (free, and the common statement tried it),
                          -- 'free'; NULL: no row
    v_seen  bigint;       -- the session key of a live lease bound to another holder
    v_seen_pid integer;   -- and its holder's backend
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
         WHERE l.name = acquire_lease.name
           AND CASE WHEN l.session_bound THEN false
                    WHEN l.released_at IS NULL AND l.expires_at > v_now THEN l.holder = acquire_lease.holder
                    -- Free: one taker at a time, the one that locks it; a row another
                    -- transaction has locked is skipped, not waited for (0019).
                    ELSE EXISTS (SELECT FROM pglockkit.leases f
                                  WHERE f.name = acquire_lease.name AND NOT f.session_bound
                                    AND (f.released_at IS NOT NULL OR f.expires_at <= v_now)
                                    FOR NO KEY UPDATE SKIP LOCKED) END
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
    END IF;

    -- A look at the row on a new snapshot, locking nothing: whoever is not the live holder answers
    -- NULL here rather than wait for the row. A lease another holder has live: NULL (a session-bound
    -- one if its holder's backend lives, holding its key): locking the row would wait for the
    -- holder's writer, whose check_fence holds it FOR SHARE until it commits (0015). Only the live
    -- holder renewing goes on to wait for the row. A dead holder's key is tried and let go at
    -- once, here and below: a try-lock kept to the end of the transaction held an entry of the
    -- server's shared lock table per lease a pod took over (0019); the row lock orders the takers.
    SELECT CASE WHEN h.released_at IS NULL AND h.expires_at > pg_catalog.clock_timestamp() THEN
                     CASE WHEN h.holder = acquire_lease.holder THEN 'mine'
                          WHEN h.session_bound AND h.session_key IS NOT NULL THEN 'bound'
                          ELSE 'taken' END
                -- Free and unbound, for an unbound call: the common statement just tried to lock
                -- it and found it locked by another transaction (or not free on its snapshot).
                WHEN NOT bind_session AND NOT h.session_bound THEN 'tried'
                ELSE 'free' END,
           h.session_key, h.holder_pid
      INTO v_state, v_seen, v_seen_pid
      FROM pglockkit.leases h WHERE h.name = acquire_lease.name;
    IF v_state IN ('taken', 'tried') THEN
        RETURN NULL;
    END IF;
    IF v_state = 'bound' AND v_seen_pid <> v_pid
       AND NOT pglockkit._advisory_free(v_seen) THEN
        RETURN NULL;
    END IF;

    DECLARE
        v_key   bigint := pglockkit._lease_session_key(acquire_lease.name, v_pid);
        v_row   pglockkit.leases;
        v_bind  bigint;       -- the key this acquisition binds to, NULL if unbound
        v_new   integer;      -- new names this transaction created under a take guard
        v_n     integer;      -- rows the INSERT of a new name inserted
        v_since timestamptz;  -- acquired_at of a live lease its holder binds (0012)
    BEGIN
        IF bind_session THEN
            v_bind := v_key;
        END IF;

        -- Lock the name's row. The live holder renewing waits for it (for its own fenced writer,
        -- say). Anyone else takes a lease only if it gets the row at once: a row another
        -- transaction has locked (it is taking, releasing or pruning the lease, or its holder's
        -- fenced writer holds it) answers NULL, and the next call sees the outcome (0019). A new
        -- name (or one whose row prune_leases deleted) first gets a row that is free, taken below
        -- like any free lease, with a token drawn once the row is ours.
        LOOP
            IF v_state = 'mine' THEN
                SELECT * INTO v_row FROM pglockkit.leases l WHERE l.name = acquire_lease.name FOR UPDATE;
            ELSE
                -- Not a lease another holder has live (taken since the look): locking it would
                -- hold up its holder's fence and renewals until this transaction ends. (A version
                -- committed between this statement's snapshot and the lock is locked before it is
                -- checked, and stays locked: one statement's window.)
                SELECT * INTO v_row FROM pglockkit.leases l
                 WHERE l.name = acquire_lease.name
                   AND (l.released_at IS NOT NULL OR l.expires_at <= pg_catalog.clock_timestamp()
                        OR l.holder = acquire_lease.holder OR (l.session_bound AND l.session_key IS NOT NULL))
                   FOR UPDATE SKIP LOCKED;
            END IF;
            EXIT WHEN FOUND;
            IF v_state IS NOT NULL THEN
                RETURN NULL;  -- locked by another transaction (or deleted since the look)
            END IF;
            -- No row: a new name. An INSERT of it would wait for another transaction inserting
            -- the same name, so one creator at a time takes it: the one that gets its take guard
            -- (a transaction-level try-lock, 0018); the others answer NULL at once. Each guard
            -- holds an entry of the server's shared lock table until the transaction ends, so a
            -- transaction takes guards for its first max_locks_per_transaction / 2 new names
            -- only (32 by default; counted in the transaction's setting pglockkit.new_leases),
            -- and creates any more as an INSERT does, waiting for a concurrent creator (0019).
            v_new := CASE WHEN pg_catalog.current_setting('pglockkit.new_leases', true) ~ '^[0-9]{1,9}$'
                          THEN pg_catalog.current_setting('pglockkit.new_leases', true)::integer ELSE 0 END;
            IF v_new < pg_catalog.current_setting('max_locks_per_transaction')::integer / 2 THEN
                IF NOT pg_catalog.pg_try_advisory_xact_lock(pglockkit._lease_take_key(acquire_lease.name)) THEN
                    RETURN NULL;
                END IF;
                PERFORM pg_catalog.set_config('pglockkit.new_leases', (v_new + 1)::text, true);
            END IF;
            v_now := pg_catalog.clock_timestamp();
            INSERT INTO pglockkit.leases AS l (name, holder, token, acquired_at, renewed_at, expires_at, released_at)
            VALUES (acquire_lease.name, acquire_lease.holder, 1, v_now, v_now, v_now OPERATOR(pg_catalog.+) acquire_lease.ttl, v_now)
            ON CONFLICT ON CONSTRAINT leases_pkey DO NOTHING;
            GET DIAGNOSTICS v_n = ROW_COUNT;
            IF v_n = 0 THEN
                -- Another creator's, committed meanwhile (waited for past the guarded names; under
                -- REPEATABLE READ or SERIALIZABLE, one committed after this snapshot fails the
                -- INSERT with 40001): NULL, its row left alone; the next call sees it (0019).
                RETURN NULL;
            END IF;
            v_state := 'free';
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
                IF NOT pglockkit._advisory_free(v_row.session_key) THEN
                    RETURN NULL;
                END IF;
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
        IF bind_session AND NOT pglockkit._advisory_held(v_key, true)
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

COMMENT ON FUNCTION pglockkit._lease_take_key(text) IS
    'Private: the take guard of a new lease name, an advisory key (namespace pglockkit, an integer resource: 47 bits of hashtextextended(name, 0), which costs less than the sha256 of a text resource and needs to agree only within one server) that acquire_lease try-locks at transaction level before it creates the lease''s row: one creator at a time, the others answer NULL at once. Inlined.';

SELECT pglockkit._grant_privileges();
