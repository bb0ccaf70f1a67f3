-- pglockkit 0001: schema, privileges, namespace registry, lock keys and advisory-lock helpers.
--
-- Tables are not the API: functions and views are. Every function pins its search_path and
-- qualifies every reference, so a caller's search_path cannot change what it does.

CREATE SCHEMA pglockkit;
COMMENT ON SCHEMA pglockkit IS
    'pglockkit: coordination primitives (namespaced advisory locks, job queue, leases, singleton runs, monitoring). Call the functions; the tables are private.';

-- The role that callers are granted. Created here when the installer may create roles; otherwise
-- a DBA creates it (CREATE ROLE pglockkit_user NOLOGIN) and reruns `pglockkit install`, which
-- re-applies the grants. Roles are cluster-wide, so uninstall never drops it.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'pglockkit_user') THEN
        BEGIN
            CREATE ROLE pglockkit_user NOLOGIN;
        EXCEPTION
            WHEN insufficient_privilege THEN
                RAISE NOTICE 'pglockkit: cannot create role pglockkit_user (no CREATEROLE); grants to it are skipped until it exists';
            WHEN duplicate_object OR unique_violation THEN
                NULL;  -- another database's installer created it at the same moment
        END;
    END IF;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Namespace registry
-- ---------------------------------------------------------------------------------------------

CREATE TABLE pglockkit.namespaces (
    id           smallint    PRIMARY KEY CHECK (id BETWEEN 1 AND 32767),
    name         text        NOT NULL UNIQUE CHECK (name ~ '^[a-z][a-z0-9_.:-]{0,62}$'),
    description  text,
    owner        name        NOT NULL DEFAULT session_user,
    lock_timeout interval    CHECK (lock_timeout > interval '0'),
    created_at   timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    updated_at   timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp()
);
COMMENT ON TABLE pglockkit.namespaces IS
    'Registry of lock namespaces: the high 16 bits of every pglockkit lock key. Write it through pglockkit.register_namespace().';
COMMENT ON COLUMN pglockkit.namespaces.lock_timeout IS
    'Default wait of xact_lock/xact_lock_all in this namespace when the call passes no timeout (NULL: the server''s lock_timeout).';

-- ---------------------------------------------------------------------------------------------
-- Keys. The formula is the contract with every client (see README, "Lock keys"):
--   text resource:    (ns_id << 48) | (1 << 47) | h47(resource)
--   integer resource: (ns_id << 48) | id,  0 <= id < 2^47
--   h47 = first 6 bytes of sha256(UTF-8 bytes), big-endian, shifted right by 1
-- ---------------------------------------------------------------------------------------------

-- _h47 and _key(smallint, text) have no SET clause so that the planner inlines them into their
-- callers (a SET clause forbids inlining, and they are on every lock call's path). Every name in
-- them is schema-qualified, operators included, so the caller's search_path cannot change them.
CREATE FUNCTION pglockkit._h47(resource text) RETURNS bigint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
    SELECT (('x' OPERATOR(pg_catalog.||) pg_catalog.encode(
                pg_catalog.substr(pg_catalog.sha256(pg_catalog.convert_to(resource, 'UTF8')), 1, 6),
                'hex'))::pg_catalog.bit(48)::pg_catalog.int8) OPERATOR(pg_catalog.>>) 1
$$;
COMMENT ON FUNCTION pglockkit._h47(text) IS
    'Private: the 47-bit hash of a text resource (first 6 bytes of sha256 of its UTF-8 bytes, big-endian, >> 1).';

CREATE FUNCTION pglockkit._ns_id_from_name(name text) RETURNS smallint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT ((('x' OPERATOR(pg_catalog.||) pg_catalog.encode(
                pg_catalog.substr(pg_catalog.sha256(pg_catalog.convert_to(name, 'UTF8')), 1, 2),
                'hex'))::pg_catalog.bit(16)::pg_catalog.int4 OPERATOR(pg_catalog.%) 32767)
            OPERATOR(pg_catalog.+) 1)::pg_catalog.int2
$$;
COMMENT ON FUNCTION pglockkit._ns_id_from_name(text) IS
    'Private: the namespace id derived from a name (first 2 bytes of sha256, big-endian, mod 32767, plus 1), the same in every database.';

CREATE FUNCTION pglockkit._ns_id(ns text) RETURNS smallint
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id smallint;
BEGIN
    IF ns IS NULL THEN
        RAISE EXCEPTION 'lock namespace must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    SELECT n.id INTO v_id FROM pglockkit.namespaces n WHERE n.name OPERATOR(pg_catalog.=) ns;
    IF v_id IS NULL THEN
        RAISE EXCEPTION 'unknown lock namespace "%"', ns
            USING ERRCODE = 'undefined_object',
                  HINT = pg_catalog.format('Register it first: SELECT pglockkit.register_namespace(%L);', ns);
    END IF;
    RETURN v_id;
END
$$;
COMMENT ON FUNCTION pglockkit._ns_id(text) IS
    'Private: the id of a registered namespace; 22004 for NULL, 42704 for an unknown name.';

CREATE FUNCTION pglockkit._key(ns_id smallint, resource text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ((ns_id::pg_catalog.int8 OPERATOR(pg_catalog.<<) 48)
            OPERATOR(pg_catalog.|) (1::pg_catalog.int8 OPERATOR(pg_catalog.<<) 47))
           OPERATOR(pg_catalog.|) pglockkit._h47(resource)
$$;
COMMENT ON FUNCTION pglockkit._key(smallint, text) IS
    'Private: the lock key of a text resource in namespace id ns_id (NULL for a NULL resource: callers check).';

CREATE FUNCTION pglockkit._key(ns_id smallint, resource bigint) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF resource IS NULL THEN
        RAISE EXCEPTION 'lock resource must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF resource OPERATOR(pg_catalog.<) 0 OR resource OPERATOR(pg_catalog.>=) (1::int8 OPERATOR(pg_catalog.<<) 47) THEN
        RAISE EXCEPTION 'integer lock resource % is out of range', resource
            USING ERRCODE = 'numeric_value_out_of_range',
                  HINT = 'Integer resources must satisfy 0 <= id < 2^47 (140737488355328); hash larger values as text.';
    END IF;
    RETURN (ns_id::int8 OPERATOR(pg_catalog.<<) 48) OPERATOR(pg_catalog.|) resource;
END
$$;
COMMENT ON FUNCTION pglockkit._key(smallint, bigint) IS
    'Private: the lock key of an integer resource (0 <= id < 2^47) in namespace id ns_id.';

CREATE FUNCTION pglockkit.lock_key(ns text, resource text) RETURNS bigint
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id smallint;
BEGIN
    IF resource IS NULL THEN
        RAISE EXCEPTION 'lock resource must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- The lookup is inline (not a call to _ns_id) because this is every lock call's path.
    SELECT n.id INTO v_id FROM pglockkit.namespaces n WHERE n.name OPERATOR(pg_catalog.=) ns;
    IF v_id IS NULL THEN
        v_id := pglockkit._ns_id(ns);  -- raises the error that fits (22004 or 42704)
    END IF;
    RETURN pglockkit._key(v_id, resource);
END
$$;
COMMENT ON FUNCTION pglockkit.lock_key(text, text) IS
    'The advisory-lock key of a text resource: (ns_id << 48) | (1 << 47) | h47(resource), h47 = first 6 bytes of sha256(UTF-8), big-endian, >> 1. Example: lock_key(''billing'', ''invoice:42'').';

CREATE FUNCTION pglockkit.lock_key(ns text, resource bigint) RETURNS bigint
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN RETURN pglockkit._key(pglockkit._ns_id(ns), resource); END $$;
COMMENT ON FUNCTION pglockkit.lock_key(text, bigint) IS
    'The advisory-lock key of an integer resource: (ns_id << 48) | id, with 0 <= id < 2^47 (22003 otherwise).';

CREATE FUNCTION pglockkit.decode_key(
    key bigint,
    OUT namespace_id integer, OUT namespace text, OUT form text, OUT resource_bits bigint)
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN key OPERATOR(pg_catalog.>) 0 THEN (key OPERATOR(pg_catalog.>>) 48)::int4 END,
           (SELECT n.name FROM pglockkit.namespaces n
             WHERE key OPERATOR(pg_catalog.>) 0 AND n.id OPERATOR(pg_catalog.=) (key OPERATOR(pg_catalog.>>) 48)::int4),
           CASE WHEN key OPERATOR(pg_catalog.<=) 0 THEN 'foreign'
                WHEN (key OPERATOR(pg_catalog.&) (1::int8 OPERATOR(pg_catalog.<<) 47)) OPERATOR(pg_catalog.<>) 0 THEN 'text'
                ELSE 'integer' END,
           key OPERATOR(pg_catalog.&) ((1::int8 OPERATOR(pg_catalog.<<) 47) OPERATOR(pg_catalog.-) 1)
$$;
COMMENT ON FUNCTION pglockkit.decode_key(bigint) IS
    'Splits a lock key into namespace id, registered namespace name (NULL if unregistered), form (''text'' hash, ''integer'' id, or ''foreign'' for keys <= 0, which pglockkit never makes) and the low 47 bits.';

CREATE FUNCTION pglockkit.decode_key(
    classid oid, objid oid,
    OUT namespace_id integer, OUT namespace text, OUT form text, OUT resource_bits bigint)
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT d.namespace_id, d.namespace, d.form, d.resource_bits
      FROM pglockkit.decode_key((classid::int8 OPERATOR(pg_catalog.<<) 32) OPERATOR(pg_catalog.|) objid::int8) d
$$;
COMMENT ON FUNCTION pglockkit.decode_key(oid, oid) IS
    'decode_key for a pg_locks row of a bigint advisory lock (objsubid = 1): SELECT l.pid, d.* FROM pg_locks l, pglockkit.decode_key(l.classid, l.objid) d WHERE l.locktype = ''advisory'' AND l.objsubid = 1.';

CREATE FUNCTION pglockkit.register_namespace(
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

    v_id := coalesce(register_namespace.id::int2, pglockkit._ns_id_from_name(register_namespace.name));

    -- Insert, or find what is in the way. ON CONFLICT waits for a concurrent registration of the
    -- same name or id to commit, so every pod registering at start-up gets the same answer.
    INSERT INTO pglockkit.namespaces AS n (id, name, description, lock_timeout)
    VALUES (v_id, register_namespace.name, register_namespace.description, register_namespace.lock_timeout)
    ON CONFLICT DO NOTHING;
    IF FOUND THEN
        RETURN v_id;
    END IF;

    SELECT n.id INTO v_id FROM pglockkit.namespaces n WHERE n.name OPERATOR(pg_catalog.=) register_namespace.name;
    IF v_id IS NOT NULL THEN
        IF register_namespace.id IS NOT NULL AND v_id OPERATOR(pg_catalog.<>) register_namespace.id THEN
            RAISE EXCEPTION 'namespace "%" is already registered with id %, not %', register_namespace.name, v_id, register_namespace.id
                USING ERRCODE = 'unique_violation',
                      HINT = 'Namespace ids are permanent: keys computed with the old id are in use. Register without an id, or with the existing one.';
        END IF;
        -- Idempotent re-registration; a non-NULL description or lock_timeout updates the entry.
        UPDATE pglockkit.namespaces n
           SET description  = coalesce(register_namespace.description, n.description),
               lock_timeout = coalesce(register_namespace.lock_timeout, n.lock_timeout),
               updated_at   = pg_catalog.clock_timestamp()
         WHERE n.id OPERATOR(pg_catalog.=) v_id
           AND (register_namespace.description IS NOT NULL OR register_namespace.lock_timeout IS NOT NULL);
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

-- ---------------------------------------------------------------------------------------------
-- Advisory-lock helpers
-- ---------------------------------------------------------------------------------------------

CREATE FUNCTION pglockkit._check_timeout(timeout interval) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF timeout IS NOT NULL AND timeout OPERATOR(pg_catalog.<=) interval '0' THEN
        RAISE EXCEPTION 'lock timeout must be positive, got %', timeout
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'To skip instead of waiting, use try_xact_lock; for the default wait, pass NULL.';
    END IF;
    IF timeout IS NOT NULL AND timeout OPERATOR(pg_catalog.>) interval '24 days' THEN
        RAISE EXCEPTION 'lock timeout % is out of range', timeout
            USING ERRCODE = 'numeric_value_out_of_range',
                  HINT = 'The longest lock wait PostgreSQL can time is 24 days; pass NULL to wait without a limit of pglockkit''s.';
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._check_timeout(interval) IS
    'Private: rejects a timeout that is not positive (22023) or longer than 24 days (22003).';

CREATE FUNCTION pglockkit._lock_holders(key bigint) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce(pg_catalog.string_agg(l.pid::text, ', ' ORDER BY l.pid), 'unknown')
      FROM pg_catalog.pg_locks l
     WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory' AND l.granted
       AND l.database OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
       AND l.objsubid OPERATOR(pg_catalog.=) 1
       AND l.classid OPERATOR(pg_catalog.=) (key OPERATOR(pg_catalog.>>) 32)::oid
       AND l.objid OPERATOR(pg_catalog.=) (key OPERATOR(pg_catalog.&) 4294967295)::oid
$$;
COMMENT ON FUNCTION pglockkit._lock_holders(bigint) IS
    'Private: the pids holding a bigint advisory lock key in this database, for error messages.';

CREATE FUNCTION pglockkit._set_lock_timeout(timeout interval) RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    -- Whole milliseconds, at least 1: lock_timeout = 0 would mean "wait forever".
    SELECT pg_catalog.set_config('lock_timeout',
        (SELECT CASE WHEN ms OPERATOR(pg_catalog.<) 1 THEN 1 ELSE ms END
           FROM (SELECT pg_catalog.ceil(pg_catalog.date_part('epoch', timeout) OPERATOR(pg_catalog.*) 1000)::int8 AS ms) m
        )::text OPERATOR(pg_catalog.||) 'ms',
        true)
$$;
COMMENT ON FUNCTION pglockkit._set_lock_timeout(interval) IS
    'Private: SET LOCAL lock_timeout to the interval, rounded up to whole milliseconds (at least 1).';

-- The waiting path, shared by xact_lock and xact_lock_all. lock_timeout is set inside a
-- subtransaction so that an error rolls the setting back with it; on success it is restored.
CREATE FUNCTION pglockkit._xact_lock_wait(ns text, label text, key bigint, timeout interval) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_prev text := pg_catalog.current_setting('lock_timeout');
BEGIN
    BEGIN
        IF timeout IS NOT NULL THEN
            PERFORM pglockkit._set_lock_timeout(timeout);
        END IF;
        PERFORM pg_catalog.pg_advisory_xact_lock(key);
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION 'could not lock %/% (key %) within %', ns, label, key,
                coalesce(timeout::text, 'lock_timeout ' OPERATOR(pg_catalog.||) v_prev)
            USING ERRCODE = 'lock_not_available',
                  DETAIL = 'Held by pid ' OPERATOR(pg_catalog.||) pglockkit._lock_holders(key) OPERATOR(pg_catalog.||) '.',
                  HINT = 'Retry with jittered backoff, or use try_xact_lock to skip instead of waiting; pg_locks (locktype advisory, classid >> 16 = namespace id) shows the holders.';
    END;
    IF timeout IS NOT NULL THEN
        PERFORM pg_catalog.set_config('lock_timeout', v_prev, true);
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._xact_lock_wait(text, text, bigint, interval) IS
    'Private: waits for a transaction advisory lock for at most timeout (NULL: the server''s lock_timeout), raising 55P03 with the holder''s pid.';

CREATE FUNCTION pglockkit._xact_lock(ns text, label text, key bigint, timeout interval) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF timeout IS NOT NULL THEN
        PERFORM pglockkit._check_timeout(timeout);
    END IF;
    -- Uncontended fast path: no subtransaction, no setting changed.
    IF pg_catalog.pg_try_advisory_xact_lock(key) THEN
        RETURN key;
    END IF;
    PERFORM pglockkit._xact_lock_wait(ns, label, key, coalesce(timeout,
        (SELECT n.lock_timeout FROM pglockkit.namespaces n WHERE n.name OPERATOR(pg_catalog.=) ns)));
    RETURN key;
END
$$;
COMMENT ON FUNCTION pglockkit._xact_lock(text, text, bigint, interval) IS
    'Private: try the key, else wait with the call''s timeout, else the namespace''s, else the server''s.';

CREATE FUNCTION pglockkit._xact_lock_all(ns text, labels text[], keys bigint[], timeout interval) RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_timeout  interval;
    v_deadline timestamptz;
    v_left     interval;
    v_key      bigint;
    v_label    text;
    v_done     bigint[] := '{}';
BEGIN
    PERFORM pglockkit._check_timeout(timeout);
    v_timeout := coalesce(timeout, (SELECT n.lock_timeout FROM pglockkit.namespaces n WHERE n.name OPERATOR(pg_catalog.=) ns));
    v_deadline := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) v_timeout;
    -- Ascending key order is what makes two callers unable to deadlock on the same set.
    FOR v_key, v_label IN
        SELECT DISTINCT ON (k.key) k.key, k.label
          FROM ROWS FROM (pg_catalog.unnest(keys), pg_catalog.unnest(labels)) AS k(key, label)
         ORDER BY k.key
    LOOP
        IF NOT pg_catalog.pg_try_advisory_xact_lock(v_key) THEN
            IF v_deadline IS NOT NULL THEN
                v_left := v_deadline OPERATOR(pg_catalog.-) pg_catalog.clock_timestamp();
                IF v_left OPERATOR(pg_catalog.<=) interval '0' THEN
                    RAISE EXCEPTION 'could not lock %/% (key %) within % (the whole call''s budget)', ns, v_label, v_key, v_timeout
                        USING ERRCODE = 'lock_not_available',
                              DETAIL = 'Held by pid ' OPERATOR(pg_catalog.||) pglockkit._lock_holders(v_key) OPERATOR(pg_catalog.||) '.',
                              HINT = 'Retry with jittered backoff; pg_locks (locktype advisory, classid >> 16 = namespace id) shows the holders.';
                END IF;
            END IF;
            PERFORM pglockkit._xact_lock_wait(ns, v_label, v_key, v_left);
        END IF;
        v_done := v_done OPERATOR(pg_catalog.||) v_key;
    END LOOP;
    RETURN v_done;
END
$$;
COMMENT ON FUNCTION pglockkit._xact_lock_all(text, text[], bigint[], interval) IS
    'Private: takes transaction advisory locks on keys in ascending order within one timeout budget.';

CREATE FUNCTION pglockkit.try_lock(ns text, resource text) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN RETURN pg_catalog.pg_try_advisory_lock(pglockkit.lock_key(ns, resource)); END $$;
COMMENT ON FUNCTION pglockkit.try_lock(text, text) IS
    'Session-level try-lock: true if taken, false at once if another session holds it. Held until pglockkit.unlock or the end of the session. Use on a dedicated, unpooled connection (never through a transaction-mode pooler).';

CREATE FUNCTION pglockkit.try_lock(ns text, resource bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN RETURN pg_catalog.pg_try_advisory_lock(pglockkit.lock_key(ns, resource)); END $$;
COMMENT ON FUNCTION pglockkit.try_lock(text, bigint) IS
    'Session-level try-lock on an integer resource (0 <= id < 2^47). See try_lock(text, text).';

CREATE FUNCTION pglockkit._unlock(ns text, label text, key bigint) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT pg_catalog.pg_advisory_unlock(key) THEN
        RAISE EXCEPTION 'session lock %/% (key %) is not held by this session', ns, label, key
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Session locks belong to the server session that took them. Through a transaction-mode pooler (PgBouncer) the unlock can reach another session, and the lock stays held: take session locks on a dedicated, unpooled connection.';
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._unlock(text, text, bigint) IS
    'Private: releases one hold of a session advisory lock, or raises 55000 if this session does not hold it.';

CREATE FUNCTION pglockkit.unlock(ns text, resource text) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN PERFORM pglockkit._unlock(ns, resource, pglockkit.lock_key(ns, resource)); END $$;
COMMENT ON FUNCTION pglockkit.unlock(text, text) IS
    'Releases one hold of a session lock taken with try_lock. Releasing a lock this session does not hold is error 55000, not a silent false.';

CREATE FUNCTION pglockkit.unlock(ns text, resource bigint) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN PERFORM pglockkit._unlock(ns, resource::text, pglockkit.lock_key(ns, resource)); END $$;
COMMENT ON FUNCTION pglockkit.unlock(text, bigint) IS
    'Releases one hold of a session lock on an integer resource; 55000 if not held.';

CREATE FUNCTION pglockkit.try_xact_lock(ns text, resource text) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN RETURN pg_catalog.pg_try_advisory_xact_lock(pglockkit.lock_key(ns, resource)); END $$;
COMMENT ON FUNCTION pglockkit.try_xact_lock(text, text) IS
    'Transaction-level try-lock: true if taken (released at commit or rollback), false at once otherwise. Safe through transaction-mode poolers.';

CREATE FUNCTION pglockkit.try_xact_lock(ns text, resource bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN RETURN pg_catalog.pg_try_advisory_xact_lock(pglockkit.lock_key(ns, resource)); END $$;
COMMENT ON FUNCTION pglockkit.try_xact_lock(text, bigint) IS
    'Transaction-level try-lock on an integer resource. See try_xact_lock(text, text).';

CREATE FUNCTION pglockkit.xact_lock(ns text, resource text, timeout interval DEFAULT NULL) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN RETURN pglockkit._xact_lock(ns, resource, pglockkit.lock_key(ns, resource), timeout); END $$;
COMMENT ON FUNCTION pglockkit.xact_lock(text, text, interval) IS
    'Transaction-level lock that waits at most timeout (else the namespace''s lock_timeout, else the server''s), then raises 55P03 naming the holder. Returns the key. Released at commit or rollback.';

CREATE FUNCTION pglockkit.xact_lock(ns text, resource bigint, timeout interval DEFAULT NULL) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN RETURN pglockkit._xact_lock(ns, resource::text, pglockkit.lock_key(ns, resource), timeout); END $$;
COMMENT ON FUNCTION pglockkit.xact_lock(text, bigint, interval) IS
    'xact_lock on an integer resource (0 <= id < 2^47). See xact_lock(text, text, interval).';

CREATE FUNCTION pglockkit.xact_lock_all(ns text, resources text[], timeout interval DEFAULT NULL) RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id smallint := pglockkit._ns_id(ns);
BEGIN
    IF resources IS NULL OR pg_catalog.array_position(resources, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'resources must be an array without nulls' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    RETURN pglockkit._xact_lock_all(ns, resources,
        ARRAY(SELECT pglockkit._key(v_id, r) FROM pg_catalog.unnest(resources) AS r), timeout);
END
$$;
COMMENT ON FUNCTION pglockkit.xact_lock_all(text, text[], interval) IS
    'Transaction-level locks on many resources, taken in ascending key order so that two callers can never deadlock on them; the timeout bounds the whole call (55P03). Returns the keys in the order taken.';

CREATE FUNCTION pglockkit.xact_lock_all(ns text, resources bigint[], timeout interval DEFAULT NULL) RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id smallint := pglockkit._ns_id(ns);
BEGIN
    IF resources IS NULL OR pg_catalog.array_position(resources, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'resources must be an array without nulls' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    RETURN pglockkit._xact_lock_all(ns,
        ARRAY(SELECT r::text FROM pg_catalog.unnest(resources) AS r),
        ARRAY(SELECT pglockkit._key(v_id, r) FROM pg_catalog.unnest(resources) AS r), timeout);
END
$$;
COMMENT ON FUNCTION pglockkit.xact_lock_all(text, bigint[], interval) IS
    'xact_lock_all on integer resources. See xact_lock_all(text, text[], interval).';

CREATE FUNCTION pglockkit.lock_rows(tbl regclass, ids bigint[], timeout interval DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_deadline timestamptz;
    v_left     interval;
    v_prev     text := pg_catalog.current_setting('lock_timeout');
    v_sql      text;
    v_id       bigint;
    v_found    integer := 0;
    v_rows     integer;
BEGIN
    IF tbl IS NULL THEN
        RAISE EXCEPTION 'table must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF ids IS NULL OR pg_catalog.array_position(ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'ids must be an array without nulls' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    PERFORM pglockkit._check_timeout(timeout);
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
                    WHERE a.attrelid OPERATOR(pg_catalog.=) tbl AND a.attname OPERATOR(pg_catalog.=) 'id'
                      AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped) THEN
        RAISE EXCEPTION 'table % has no column "id"', tbl USING ERRCODE = 'undefined_column';
    END IF;
    -- regclass output is schema-qualified where needed and quoted: safe to splice in.
    v_sql := pg_catalog.format('SELECT 1 FROM %s WHERE id = $1 FOR UPDATE', tbl);
    v_deadline := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) timeout;
    -- One row at a time in ascending id order: the order is what prevents deadlocks, and the
    -- deadline makes the timeout bound the whole call.
    FOR v_id IN SELECT DISTINCT i FROM pg_catalog.unnest(ids) AS i ORDER BY i LOOP
        BEGIN
            IF v_deadline IS NOT NULL THEN
                v_left := v_deadline OPERATOR(pg_catalog.-) pg_catalog.clock_timestamp();
                PERFORM pglockkit._set_lock_timeout(v_left);
            END IF;
            EXECUTE v_sql USING v_id;
            GET DIAGNOSTICS v_rows = ROW_COUNT;
        EXCEPTION WHEN lock_not_available THEN
            RAISE EXCEPTION 'could not lock row % of % within %', v_id, tbl, coalesce(timeout::text, 'lock_timeout ' OPERATOR(pg_catalog.||) v_prev)
                USING ERRCODE = 'lock_not_available',
                      HINT = 'Retry with jittered backoff; pg_blocking_pids() of a waiting session names who blocks it.';
        END;
        v_found := v_found OPERATOR(pg_catalog.+) v_rows;
    END LOOP;
    IF v_deadline IS NOT NULL THEN
        PERFORM pg_catalog.set_config('lock_timeout', v_prev, true);
    END IF;
    RETURN v_found;
END
$$;
COMMENT ON FUNCTION pglockkit.lock_rows(regclass, bigint[], interval) IS
    'Locks rows of a table FOR UPDATE by their "id" column, in ascending id order, so that callers locking several rows cannot deadlock each other. The timeout bounds the whole call (55P03). Returns how many of the ids exist (and are now locked). Runs with the caller''s privileges.';

-- ---------------------------------------------------------------------------------------------
-- Privileges: EXECUTE is revoked from PUBLIC and granted to pglockkit_user; read-only tables and
-- views to pglockkit_user and pg_monitor. Every migration ends by calling this, and so does
-- `pglockkit install`, so a role created after installation gets its grants on the next install.
-- ---------------------------------------------------------------------------------------------

CREATE FUNCTION pglockkit._grant_privileges() RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_user boolean := EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) 'pglockkit_user');
    r      record;
BEGIN
    FOR r IN SELECT p.oid::regprocedure AS sig, p.proname
               FROM pg_catalog.pg_proc p
              WHERE p.pronamespace OPERATOR(pg_catalog.=) 'pglockkit'::regnamespace
    LOOP
        EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', r.sig);
        IF v_user AND r.proname OPERATOR(pg_catalog.<>) '_grant_privileges' THEN
            EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO pglockkit_user', r.sig);
        END IF;
    END LOOP;
    GRANT USAGE ON SCHEMA pglockkit TO pg_monitor;
    GRANT SELECT ON pglockkit.namespaces TO pg_monitor;
    FOR r IN SELECT c.oid::regclass AS rel FROM pg_catalog.pg_class c
              WHERE c.relnamespace OPERATOR(pg_catalog.=) 'pglockkit'::regnamespace AND c.relkind = 'v'
    LOOP
        EXECUTE pg_catalog.format('GRANT SELECT ON %s TO pg_monitor', r.rel);
    END LOOP;
    IF v_user THEN
        GRANT USAGE ON SCHEMA pglockkit TO pglockkit_user;
        GRANT SELECT ON pglockkit.namespaces TO pglockkit_user;
        FOR r IN SELECT c.oid::regclass AS rel FROM pg_catalog.pg_class c
                  WHERE c.relnamespace OPERATOR(pg_catalog.=) 'pglockkit'::regnamespace AND c.relkind = 'v'
        LOOP
            EXECUTE pg_catalog.format('GRANT SELECT ON %s TO pglockkit_user', r.rel);
        END LOOP;
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._grant_privileges() IS
    'Private: (re)applies pglockkit''s grants: EXECUTE to pglockkit_user (if it exists) and not PUBLIC; SELECT on views and the namespace registry to pg_monitor and pglockkit_user.';

-- The kit's own namespace (installer mutex and other internal locks).
INSERT INTO pglockkit.namespaces (id, name, description)
VALUES (pglockkit._ns_id_from_name('pglockkit'), 'pglockkit', 'pglockkit''s own locks (the installer''s mutex, ...)');

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;
