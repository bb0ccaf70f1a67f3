-- Leases: named, expiring, fenced mutual exclusion
--
-- The current definition of each object, once. A change edits this file and adds a delta
-- migration (see CONTRIBUTING.md); a test checks that both build the same schema.

-- A lease name and a token are checked by their domains, not by CHECK constraints on the table:
-- the executor prepares a table's CHECK constraints again for every statement that writes it
-- (12 to 18 us of an acquire + release cycle that costs a bare upsert 110 us, measured on PG 18,
-- CHANGELOG.md, 0005_lease_fast_path), while a domain's checks are prepared once per session and run only when
-- the column is assigned (release_lease, which assigns neither, runs none). The same 23514 and
-- constraint names for a direct write, e.g. a name over 1024 bytes.
CREATE DOMAIN pglockkit.lease_name AS text
    CONSTRAINT leases_name_check CHECK (VALUE OPERATOR(pg_catalog.<>) '')
    CONSTRAINT leases_name_length CHECK (pg_catalog.octet_length(VALUE) OPERATOR(pg_catalog.<=) 1024);
COMMENT ON DOMAIN pglockkit.lease_name IS
    'A lease name: not empty, at most 1024 bytes (23514, constraint leases_name_length).';
CREATE DOMAIN pglockkit.lease_token AS bigint
    CONSTRAINT leases_token_check CHECK (VALUE OPERATOR(pg_catalog.>) 0);
COMMENT ON DOMAIN pglockkit.lease_token IS
    'A lease fencing token: positive.';

CREATE TABLE pglockkit.leases (
    name          pglockkit.lease_name PRIMARY KEY,
    holder        text        NOT NULL,
    token         pglockkit.lease_token NOT NULL,
    acquired_at   timestamptz NOT NULL,
    renewed_at    timestamptz NOT NULL,
    expires_at    timestamptz NOT NULL,
    released_at   timestamptz,
    session_bound boolean     NOT NULL DEFAULT false,
    holder_pid    integer,
    session_key   bigint
);
COMMENT ON TABLE pglockkit.leases IS
    'Leases, one row per name. Write it through acquire_lease / renew_lease / release_lease; prune_leases deletes rows free for a while (tokens come from the sequence lease_tokens, so they never repeat).';
COMMENT ON COLUMN pglockkit.leases.session_key IS
    'For a session-bound lease: the advisory key its holder''s backend keeps locked while it holds the lease (free: the backend is gone).';

CREATE SEQUENCE pglockkit.lease_tokens AS bigint MAXVALUE 140737488355327 NO CYCLE;
COMMENT ON SEQUENCE pglockkit.lease_tokens IS
    'The low 47 bits of leases'' fencing tokens (_next_token puts the epoch above them): drawn by each acquisition once the row version it replaces was written (again if the row changed while it waited, so values are skipped), never reused; each name''s tokens strictly increase.';

-- The longest lease ttl, named once (leases are renewed while held: seconds to minutes).
CREATE FUNCTION pglockkit._longest_lease_ttl() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN interval '1 year';
COMMENT ON FUNCTION pglockkit._longest_lease_ttl() IS 'Private: the longest lease ttl pglockkit accepts, 1 year.';

CREATE FUNCTION pglockkit._advisory_held(key bigint, by_this_session boolean) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (
        SELECT FROM pg_catalog.pg_locks k
         WHERE k.locktype = 'advisory' AND k.granted
           AND k.database = (SELECT d.oid FROM pg_catalog.pg_database d
                                                   WHERE d.datname = pg_catalog.current_database())
           AND (NOT by_this_session OR k.pid = pg_catalog.pg_backend_pid())
           AND k.objsubid = 1
           AND k.classid = (key >> 32)::oid
           AND k.objid = (key & 4294967295)::oid)
$$;
COMMENT ON FUNCTION pglockkit._advisory_held(bigint, boolean) IS
    'Private: whether the bigint advisory key is held in this database (by this session only, if by_this_session). Reads pg_locks: not for hot paths.';

CREATE FUNCTION pglockkit._advisory_free(key bigint) RETURNS boolean
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT CASE WHEN pg_catalog.pg_try_advisory_lock(key) THEN pg_catalog.pg_advisory_unlock(key) ELSE false END;
END;
COMMENT ON FUNCTION pglockkit._advisory_free(bigint) IS
    'Private: whether no other session holds the bigint advisory key, by trying it at session level and letting it go at once (a lock kept to the end of a transaction would hold an entry of the server''s shared lock table). Inlined.';

CREATE FUNCTION pglockkit._check_lease_args(name text, holder text, ttl interval) RETURNS void
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
    -- now, with calendar months ('-2 mon 61 days' is "positive" and 0 to 3 days backwards). The
    -- sum only within range: '300000 years' would overflow the timestamp (22008) (0015).
    IF ttl <= interval '0'
       OR (ttl <= pglockkit._longest_lease_ttl()
           AND pg_catalog.statement_timestamp() + ttl <= pg_catalog.statement_timestamp()) THEN
        RAISE EXCEPTION 'lease ttl must be positive, got %', ttl USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF ttl > pglockkit._longest_lease_ttl() THEN
        RAISE EXCEPTION 'lease ttl % is out of range', ttl USING ERRCODE = 'numeric_value_out_of_range',
            HINT = 'A lease is renewed while held; keep its ttl short (seconds to minutes).';
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._check_lease_args(text, text, interval) IS
    'Private: rejects NULL (22004), empty names or holders and non-positive ttls (22023), ttls over a year (22003).';

-- acquire_lease's common cases take one statement, like a hand-rolled lease's upsert: an UPDATE of
-- the name's row that renews a live lease of the same holder or takes a free one, if the row is not
-- session-bound (a bound row's key may need checking or letting go). An UPDATE decides on its
-- snapshot and locks the row only if the row qualifies: a lease another holder has live is never
-- locked, so a contender that loses writes nothing, waits for no disk flush, and holds up neither
-- the holder nor the other contenders (the second look below, on a new snapshot, answers NULL). If
-- the row changed meanwhile, the UPDATE waits for it, then decides again on its newest version
-- (EvalPlanQual), computing the new values again, and keeps the row locked whatever it decides.
-- So a free row qualifies only for the one taker that locks it first, by a sub-select FOR NO KEY
-- UPDATE SKIP LOCKED of the same row: rivals that saw the row free at the same moment skip it and
-- answer NULL instead of waiting for the taker's commit and then locking the row they lost, each in
-- turn behind the other's disk flush, with the new holder's release queued behind them all (one
-- name polled by 8 pgbench clients: 274 acquisitions a second before 0018, 694 after, PG 18).
-- 0018 did this with an advisory try-lock, a take guard, which held an entry of the server's
-- shared lock table per lease taken until the transaction ended and was shared by names whose
-- hashes collide; a row lock is kept in the row. What neither covers is a rival whose statement
-- began before the taker committed and reaches the row after: it locks the newest version, finds
-- it taken, and commits a row lock.
-- Two consequences, both bounded. The clock is read once, before the statement (v_now), so that
-- the decision and the times agree; the statement returns a second reading, taken after the row
-- is ours, and if the two are more than a millisecond apart (it waited for the row) the lease is
-- stamped again with that second reading: a lease that waited for its row starts when it got it.
-- A decision on the earlier reading errs only toward live: a free row stays free, and a renewal
-- of a lease that expired while its holder's own call waited keeps the token nobody else got.
-- And the token is drawn when the new values are computed, before the row lock, and again after a
-- change: an acquirer whose row changed under it (it raced for a freed lease and lost, or the row
-- was released while it waited) draws a token that nobody gets. Tokens still never repeat
-- and each name's still strictly increase (the row version that the update lands on was committed
-- before the draw, or the values are computed again); they skip more values. The previous form
-- (0005: INSERT ... ON CONFLICT DO UPDATE, which locks the row first, behind a NOT EXISTS check
-- that kept losers from locking it) drew no token in vain and cost 20-25 us more a cycle (PG 18).
-- Everything else goes the general way below: a new name (the general path inserts a free row and
-- takes it like any free lease), a live lease of another holder (NULL, or free early if
-- session-bound and its backend is gone), a session-bound row, and bind_session. The argument
-- checks are inline comparisons, calling _check_lease_args only to raise. The common statement
-- touches unbound rows only (0008): session_bound stays false and session_key NULL, two CASEs
-- fewer than when it also renewed bound rows, each about 1 us a call (PG 18). Figures:
-- CHANGELOG.md, 0005_lease_fast_path, 0007_lease_update_first and 0008_lease_unbound_fast_path.
CREATE FUNCTION pglockkit.acquire_lease(name text, holder text, ttl interval, bind_session boolean DEFAULT false)
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
       OR acquire_lease.ttl <= interval '0' OR acquire_lease.ttl > pglockkit._longest_lease_ttl()
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
                            THEN l.token ELSE pglockkit._next_token('pglockkit.lease_tokens', l.token) END,
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
            VALUES (acquire_lease.name, acquire_lease.holder, 1, v_now, v_now, v_now + acquire_lease.ttl, v_now)
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
                       SET renewed_at = v_now, expires_at = v_now + acquire_lease.ttl
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
            v_token := pglockkit._next_token('pglockkit.lease_tokens', v_row.token);
            v_since := v_now;
        END IF;
        UPDATE pglockkit.leases l
           SET holder = acquire_lease.holder, token = v_token, acquired_at = v_since, renewed_at = v_now,
               expires_at = v_now + acquire_lease.ttl, released_at = NULL,
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

CREATE FUNCTION pglockkit.renew_lease(name text, holder text, token bigint, ttl interval) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := pg_catalog.clock_timestamp();
BEGIN
    IF renew_lease.name IS NULL OR renew_lease.holder IS NULL OR renew_lease.ttl IS NULL
       OR renew_lease.name = '' OR renew_lease.holder = ''
       OR renew_lease.ttl <= interval '0' OR renew_lease.ttl > pglockkit._longest_lease_ttl()
       OR v_now + renew_lease.ttl <= v_now THEN
        PERFORM pglockkit._check_lease_args(renew_lease.name, renew_lease.holder, renew_lease.ttl);
        RAISE EXCEPTION 'lease ttl must be positive, got %', renew_lease.ttl USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF renew_lease.token IS NULL THEN
        RAISE EXCEPTION 'lease token must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    UPDATE pglockkit.leases l
       SET renewed_at = v_now, expires_at = v_now + renew_lease.ttl
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

-- release_lease's common case, an unbound lease released by its holder, is one UPDATE that returns
-- nothing. Bad arguments match no row (NULLs compare to nothing, and no lease has an empty name
-- or holder), so their checks, a session-bound lease (whose key this session may have to let go)
-- and a release that is not the holder's come after it.
CREATE FUNCTION pglockkit.release_lease(name text, holder text, token bigint) RETURNS boolean
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
    IF release_lease.name IS NULL OR release_lease.holder IS NULL OR release_lease.token IS NULL THEN
        -- Its own message: the shared check's names a ttl, which release takes none of (0017).
        RAISE EXCEPTION 'lease name, holder and token must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF release_lease.name = '' OR release_lease.holder = '' THEN
        PERFORM pglockkit._check_lease_args(release_lease.name, release_lease.holder, interval '1 second');
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

CREATE FUNCTION pglockkit.check_fence(name text, token bigint) RETURNS void
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
    IF v_row.expires_at <= pg_catalog.clock_timestamp() THEN
        RAISE EXCEPTION 'fence check failed: lease "%" (token %) expired at %', check_fence.name, check_fence.token, v_row.expires_at
            USING ERRCODE = 'PK001', HINT = 'Renew the lease more often than its ttl.';
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit.check_fence(text, bigint) IS
    'Call inside the writer''s transaction before it writes: raises PK001 unless token is the live lease''s token, and holds the lease row (FOR SHARE) so that the lease cannot change hands before this transaction ends.';

CREATE FUNCTION pglockkit._lease_session_key(name text, pid integer) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT pglockkit._key(pglockkit._ns_id_from_name('pglockkit'),
        'lease-session:' OPERATOR(pg_catalog.||) pid::pg_catalog.text OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) name)
$$;
COMMENT ON FUNCTION pglockkit._lease_session_key(text, integer) IS
    'Private: the advisory key (namespace pglockkit, resource lease-session:<pid>:<name>) that backend pid keeps locked while it holds the session-bound lease on name. Inlined; fully qualified.';

CREATE FUNCTION pglockkit._lease_take_key(name text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT pglockkit._key(pglockkit._ns_id_from_name('pglockkit'), pg_catalog.hashtextextended(name, 0) & 140737488355327);
END;
COMMENT ON FUNCTION pglockkit._lease_take_key(text) IS
    'Private: the take guard of a new lease name, an advisory key (namespace pglockkit, an integer resource: 47 bits of hashtextextended(name, 0), which costs less than the sha256 of a text resource and needs to agree only within one server) that acquire_lease try-locks at transaction level before it creates the lease''s row: one creator at a time, the others answer NULL at once. Inlined.';

CREATE FUNCTION pglockkit._lease_drop_stale_key(name text) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_key bigint := pglockkit._lease_session_key(_lease_drop_stale_key.name, pg_catalog.pg_backend_pid());
BEGIN
    IF NOT pglockkit._advisory_held(v_key, true)
       OR EXISTS (SELECT FROM pglockkit.leases l
                   WHERE l.name = _lease_drop_stale_key.name
                     AND l.session_bound AND l.session_key = v_key
                     AND l.released_at IS NULL AND l.expires_at > pg_catalog.clock_timestamp())
    THEN
        RETURN false;
    END IF;
    RETURN pg_catalog.pg_advisory_unlock(v_key);
END
$$;
COMMENT ON FUNCTION pglockkit._lease_drop_stale_key(text) IS
    'Private: unlocks this session''s key for the lease on name unless this session still holds that lease bound and live (after it lost, expired or gave up the lease, or bound it in a transaction that rolled back). True if it unlocked. Reads pg_locks: for failure paths.';

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
    IF older_than < interval '0' THEN
        RAISE EXCEPTION 'older_than must not be negative, got %', older_than USING ERRCODE = 'invalid_parameter_value';
    END IF;
    BEGIN
        v_before := pg_catalog.clock_timestamp() - older_than;
    EXCEPTION WHEN datetime_field_overflow THEN
        RETURN 0;  -- before the calendar starts: nothing is that old
    END;
    -- A row locked by an acquirer is waited for, then checked again: a lease taken meanwhile stays.
    DELETE FROM pglockkit.leases l
     WHERE coalesce(l.released_at, l.expires_at) < v_before;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit.prune_leases(interval) IS
    'Deletes leases released, or expired, more than older_than ago; returns how many. Tokens never repeat: a pruned name''s next token is larger than all it had. A stale holder''s check_fence then fails with PK001 (no lease of that name). Run it from cron, e.g. prune_leases(''7 days'').';

CREATE VIEW pglockkit.lease_status AS
SELECT l.name::text AS name, l.holder, l.token::bigint AS token, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
       CASE WHEN l.released_at IS NULL THEN l.expires_at OPERATOR(pg_catalog.-) pg_catalog.clock_timestamp() END AS expires_in,
       (l.released_at IS NULL AND l.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()) AS live,
       l.session_bound, l.holder_pid
  FROM pglockkit.leases l;
COMMENT ON VIEW pglockkit.lease_status IS
    'Every lease: holder, token, expiry; expires_in (negative once expired), live. A session-bound lease whose holder backend is gone is still shown live until its ttl; acquire_lease treats it as free.';
