-- pglockkit 0008: the leases' common statements touch unbound rows only (issue 16).
-- acquire_lease's one-UPDATE fast path no longer renews session-bound rows (the general path does,
-- as it did for rows bound to the caller's own backend), so it leaves session_bound (false) alone
-- and sets session_key without a CASE; release_lease's common case is one UPDATE of an unbound
-- row that returns nothing, with its argument checks and the session-bound case after it. Same names, signatures, results,
-- errors. The why and the figures: sql/schema/03_leases.sql and CHANGELOG.md.

SET LOCAL search_path = pg_catalog, pg_temp;

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
       OR acquire_lease.ttl <= interval '0' OR acquire_lease.ttl > interval '1 year' THEN
        PERFORM pglockkit._check_lease_args(acquire_lease.name, acquire_lease.holder, acquire_lease.ttl);
        RAISE EXCEPTION 'bind_session must not be null' USING ERRCODE = 'null_value_not_allowed';
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
                -- The live holder acquiring again: a renewal, same token.
                UPDATE pglockkit.leases l
                   SET renewed_at = v_now, expires_at = v_now OPERATOR(pg_catalog.+) acquire_lease.ttl
                 WHERE l.name = acquire_lease.name;
                RETURN v_row.token;
            END IF;
            -- Held by another. A session-bound lease is free early only if its holder's backend is
            -- gone: nobody holds its key (this session holding it is the holder, alive).
            IF NOT v_row.session_bound OR v_row.session_key IS NULL THEN
                RETURN NULL;
            END IF;
            IF v_row.holder_pid = v_pid AND pglockkit._advisory_held(v_row.session_key, true) THEN
                RETURN NULL;
            END IF;
            IF NOT pg_catalog.pg_try_advisory_xact_lock(v_row.session_key) THEN
                RETURN NULL;
            END IF;
            v_xact := v_row.session_key = v_key;  -- its key is ours (this backend's pid, reused or
                                                  -- its session locks dropped by hand)
        END IF;

        -- Free: released, expired, or its session-bound holder's backend is gone. Whoever held it
        -- may still hold its own key: that blocks nobody, since this acquirer binds to a key of its
        -- own. The token is drawn while this transaction holds the row, so it is larger than every
        -- token of this name handed out before, even one whose row was pruned since.
        v_token := pg_catalog.nextval('pglockkit.lease_tokens');
        UPDATE pglockkit.leases l
           SET holder = acquire_lease.holder, token = v_token, acquired_at = v_now, renewed_at = v_now,
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
    -- A session-bound lease, or not ours.
    UPDATE pglockkit.leases l
       SET released_at = pg_catalog.clock_timestamp()
     WHERE l.name = release_lease.name
       AND l.holder = release_lease.holder
       AND l.token = release_lease.token
       AND l.released_at IS NULL
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

SELECT pglockkit._grant_privileges();
