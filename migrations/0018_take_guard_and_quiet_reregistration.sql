-- pglockkit 0018: a contender for a free lease never waits (issue 16); re-registering is quiet.
-- * acquire_lease took a free lease (released, expired, or a new name) by locking its row, and a
--   rival that saw it free at the same moment waited for the taker's transaction to end, then
--   locked the row it had lost (a transaction id, and a disk flush at its commit). Pollers of a
--   freed lease queued so, one behind another's commit, and the new holder's release behind
--   them all; a taker inside a long transaction held every rival for its whole length. Takers of
--   a free lease now try the lease's take guard first (_lease_take_key, a transaction-level
--   advisory key in the pglockkit namespace): one at a time takes it, the others answer NULL at
--   once and write nothing. The live holder renewing never tries the guard.
-- * register_namespace of a name registered already (every pod at start-up) compiled the registry
--   again: its INSERT ... ON CONFLICT DO NOTHING fired the statement trigger, and replacing
--   _ns_registry invalidated, in every session, each cached plan that inlined it. It now answers
--   from the table, and compiles only if the compiled registry lacks the name.

SET LOCAL search_path = pg_catalog, pg_temp;

CREATE OR REPLACE FUNCTION pglockkit.register_namespace(
    name text, id integer DEFAULT NULL, description text DEFAULT NULL, lock_timeout interval DEFAULT NULL)
RETURNS smallint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id   smallint;
    v_name text;
BEGIN
    IF register_namespace.name IS NULL THEN
        RAISE EXCEPTION 'namespace name must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF register_namespace.name OPERATOR(pg_catalog.!~) '^[a-z][a-z0-9_.:-]{0,62}$' THEN
        RAISE EXCEPTION 'invalid namespace name "%"', register_namespace.name
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'A namespace name is 1 to 63 characters: a lowercase letter, then lowercase letters, digits, or _ . : -';
    END IF;
    IF register_namespace.id IS NOT NULL AND register_namespace.id NOT BETWEEN 1 AND 32767 THEN
        RAISE EXCEPTION 'namespace id % is out of range', register_namespace.id
            USING ERRCODE = 'numeric_value_out_of_range', HINT = 'Namespace ids are 1 to 32767.';
    END IF;
    IF register_namespace.lock_timeout IS NOT NULL AND register_namespace.lock_timeout OPERATOR(pg_catalog.<=) interval '0' THEN
        RAISE EXCEPTION 'namespace lock_timeout must be positive, got %', register_namespace.lock_timeout
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass NULL to use the server''s lock_timeout.';
    END IF;

    -- A name registered already (every pod at start-up, again and again) is answered from the
    -- table. The INSERT below fires the statement trigger that compiles the registry whether or not
    -- it inserts, and replacing _ns_registry invalidates, in every session, each cached plan that
    -- inlined it (0018).
    SELECT n.id INTO v_id FROM pglockkit.namespaces n WHERE n.name = register_namespace.name;
    IF NOT FOUND THEN
        v_id := coalesce(register_namespace.id::int2, pglockkit._ns_id_from_name(register_namespace.name));
        -- Insert, or find what is in the way. ON CONFLICT waits for a concurrent registration of the
        -- same name or id to commit, so every pod registering at start-up gets the same answer.
        INSERT INTO pglockkit.namespaces AS n (id, name, description, lock_timeout)
        VALUES (v_id, register_namespace.name, register_namespace.description, register_namespace.lock_timeout)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN v_id;
        END IF;
        SELECT n.id INTO v_id FROM pglockkit.namespaces n WHERE n.name = register_namespace.name;
    END IF;
    IF v_id IS NOT NULL THEN
        IF register_namespace.id IS NOT NULL AND v_id <> register_namespace.id THEN
            RAISE EXCEPTION 'namespace "%" is already registered with id %, not %', register_namespace.name, v_id, register_namespace.id
                USING ERRCODE = 'unique_violation',
                      HINT = 'Namespace ids are permanent: keys computed with the old id are in use. Register without an id, or with the existing one.';
        END IF;
        -- Idempotent re-registration; a non-NULL description or lock_timeout updates the entry.
        UPDATE pglockkit.namespaces n
           SET description  = coalesce(register_namespace.description, n.description),
               lock_timeout = coalesce(register_namespace.lock_timeout, n.lock_timeout),
               updated_at   = pg_catalog.clock_timestamp()
         WHERE n.id = v_id
           AND (register_namespace.description IS NOT NULL OR register_namespace.lock_timeout IS NOT NULL);
        -- The compiled registry may lack the name (a REPEATABLE READ registration that could not
        -- see it compiled without it): registering it again compiles it in.
        IF pglockkit._ns_registry(register_namespace.name) IS DISTINCT FROM v_id THEN
            PERFORM pglockkit._compile_ns_registry();
        END IF;
        RETURN v_id;
    END IF;

    SELECT n.name INTO v_name FROM pglockkit.namespaces n
     WHERE n.id OPERATOR(pg_catalog.=) coalesce(register_namespace.id::int2, pglockkit._ns_id_from_name(register_namespace.name));
    RAISE EXCEPTION 'namespace id % is already held by namespace "%"',
            coalesce(register_namespace.id::int2, pglockkit._ns_id_from_name(register_namespace.name)), v_name
        USING ERRCODE = 'unique_violation',
              HINT = pg_catalog.format('Choose a free id explicitly: SELECT pglockkit.register_namespace(%L, <id>);', register_namespace.name);
END
$$;
COMMENT ON FUNCTION pglockkit.register_namespace(text, integer, text, interval) IS
    'Registers a lock namespace and returns its id (1..32767). Without an id, the id is derived from the name, the same in every database. Idempotent: registering an existing name again returns its id (a non-NULL description or lock_timeout updates it). A name already registered under another id, or an id held by another name, is error 23505 naming the holder.';

CREATE OR REPLACE FUNCTION pglockkit._lease_take_key(name text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT pglockkit._key(pglockkit._ns_id_from_name('pglockkit'), pg_catalog.hashtextextended(name, 0) & 140737488355327);
END;
COMMENT ON FUNCTION pglockkit._lease_take_key(text) IS
    'Private: the take guard of the lease on name, an advisory key (namespace pglockkit, an integer resource: 47 bits of hashtextextended(name, 0), which costs less than the sha256 of a text resource and needs to agree only within one server) that acquire_lease try-locks at transaction level before it takes a free lease: one taker at a time, the others answer NULL at once. Inlined.';

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
                          -- another's), 'free'; NULL: no row
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
                    -- Free: one taker at a time (the take guard, held to the end of the transaction).
                    ELSE pg_catalog.pg_try_advisory_xact_lock(pglockkit._lease_take_key(acquire_lease.name)) END
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
    -- one if its holder's backend lives, holding its key; a free key is kept by this transaction, as
    -- below): locking the row would wait for the holder's writer, whose check_fence holds it FOR
    -- SHARE until it commits (0015). A free lease or a new name: one taker at a time, by the take
    -- guard; while another transaction holds it (it is taking the lease, or took it, and has not
    -- ended), NULL (0018). Only the live holder renewing goes on to lock the row regardless.
    SELECT CASE WHEN h.released_at IS NULL AND h.expires_at > pg_catalog.clock_timestamp() THEN
                     CASE WHEN h.holder = acquire_lease.holder THEN 'mine'
                          WHEN h.session_bound AND h.session_key IS NOT NULL THEN 'bound'
                          ELSE 'taken' END
                ELSE 'free' END,
           h.session_key, h.holder_pid
      INTO v_state, v_seen, v_seen_pid
      FROM pglockkit.leases h WHERE h.name = acquire_lease.name;
    IF v_state = 'taken' THEN
        RETURN NULL;
    END IF;
    IF v_state = 'bound' AND v_seen_pid <> v_pid AND NOT pg_catalog.pg_try_advisory_xact_lock(v_seen) THEN
        RETURN NULL;
    END IF;
    IF v_state IS DISTINCT FROM 'mine'
       AND NOT pg_catalog.pg_try_advisory_xact_lock(pglockkit._lease_take_key(acquire_lease.name)) THEN
        RETURN NULL;
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

SELECT pglockkit._grant_privileges();
