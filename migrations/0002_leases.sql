-- pglockkit 0002: leases with fencing tokens.
--
-- A lease is a row: who holds a name, until when (by the server's clock), and a fencing token
-- that grows by one at every acquisition. Rows are never deleted, so a name's tokens increase
-- forever, across releases, expiries and server restarts. A writer proves it still holds the
-- lease by calling check_fence(name, token) in the transaction that writes.

CREATE TABLE pglockkit.leases (
    name          text        PRIMARY KEY CHECK (name OPERATOR(pg_catalog.<>) ''),
    holder        text        NOT NULL,
    token         bigint      NOT NULL CHECK (token OPERATOR(pg_catalog.>) 0),
    acquired_at   timestamptz NOT NULL,
    renewed_at    timestamptz NOT NULL,
    expires_at    timestamptz NOT NULL,
    released_at   timestamptz,
    session_bound boolean     NOT NULL DEFAULT false,
    holder_pid    integer
);
COMMENT ON TABLE pglockkit.leases IS
    'Leases, one row per name, kept forever so that fencing tokens never repeat. Write it through acquire_lease / renew_lease / release_lease.';

-- A session-bound lease is also a session advisory lock held by the holder's backend on this key,
-- so anyone can tell in O(1) whether that backend is gone (the try-lock succeeds).
CREATE FUNCTION pglockkit._lease_session_key(name text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pglockkit._key(pglockkit._ns_id_from_name('pglockkit'), 'lease:' OPERATOR(pg_catalog.||) name) $$;
COMMENT ON FUNCTION pglockkit._lease_session_key(text) IS
    'Private: the advisory key (namespace pglockkit, resource lease:<name>) that a session-bound lease''s holder keeps locked. Inlined; fully qualified.';

CREATE FUNCTION pglockkit._advisory_held(key bigint, by_this_session boolean) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (
        SELECT FROM pg_catalog.pg_locks k
         WHERE k.locktype OPERATOR(pg_catalog.=) 'advisory' AND k.granted
           AND k.database OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database d
                                                   WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
           AND (NOT by_this_session OR k.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid())
           AND k.objsubid OPERATOR(pg_catalog.=) 1
           AND k.classid OPERATOR(pg_catalog.=) (key OPERATOR(pg_catalog.>>) 32)::oid
           AND k.objid OPERATOR(pg_catalog.=) (key OPERATOR(pg_catalog.&) 4294967295)::oid)
$$;
COMMENT ON FUNCTION pglockkit._advisory_held(bigint, boolean) IS
    'Private: whether the bigint advisory key is held in this database (by this session only, if by_this_session). Reads pg_locks: not for hot paths.';

CREATE FUNCTION pglockkit._check_lease_args(name text, holder text, ttl interval) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF name IS NULL OR holder IS NULL OR ttl IS NULL THEN
        RAISE EXCEPTION 'lease name, holder and ttl must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF name OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'lease name must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF holder OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'lease holder must not be empty' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Name the holder so that lease_status says who has it, e.g. host:pid.';
    END IF;
    IF ttl OPERATOR(pg_catalog.<=) interval '0' THEN
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

CREATE FUNCTION pglockkit.acquire_lease(name text, holder text, ttl interval, bind_session boolean DEFAULT false)
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
COMMENT ON FUNCTION pglockkit.acquire_lease(text, text, interval, boolean) IS
    'Acquires the lease on name for ttl (server clock) and returns its fencing token, strictly increasing per name across every acquisition; NULL while another holder''s lease is live. The live holder acquiring again renews it and gets the same token. bind_session => true also ties the lease to this backend: when the backend ends, the lease is free at once instead of after the ttl (needs a direct, unpooled connection).';

CREATE FUNCTION pglockkit.renew_lease(name text, holder text, token bigint, ttl interval) RETURNS boolean
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

CREATE FUNCTION pglockkit.release_lease(name text, holder text, token bigint) RETURNS boolean
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
    -- FOR SHARE: until this transaction ends, nobody can renew, release or take over the lease,
    -- so the write it guards commits under the token it checked.
    SELECT * INTO v_row FROM pglockkit.leases l WHERE l.name OPERATOR(pg_catalog.=) check_fence.name FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'fence check failed: no lease named "%"', check_fence.name
            USING ERRCODE = 'PK001', HINT = 'Acquire the lease first: SELECT pglockkit.acquire_lease(name, holder, ttl).';
    END IF;
    IF v_row.token OPERATOR(pg_catalog.<>) check_fence.token THEN
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

CREATE VIEW pglockkit.lease_status AS
SELECT l.name, l.holder, l.token, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
       CASE WHEN l.released_at IS NULL THEN l.expires_at OPERATOR(pg_catalog.-) pg_catalog.clock_timestamp() END AS expires_in,
       (l.released_at IS NULL AND l.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()) AS live,
       l.session_bound, l.holder_pid
  FROM pglockkit.leases l;
COMMENT ON VIEW pglockkit.lease_status IS
    'Every lease: holder, token, expiry; expires_in (negative once expired), live. A session-bound lease whose holder backend is gone is still shown live until its ttl; acquire_lease treats it as free.';

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;
