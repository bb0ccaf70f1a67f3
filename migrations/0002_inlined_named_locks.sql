-- pglockkit 0002: named locks at the cost of a bare advisory lock, for SQL clients (issue 16).
--
-- The key functions and the lock helpers become SQL functions with BEGIN ATOMIC bodies, inlined
-- into the caller's statement; the namespace registry is compiled into a function
-- (_ns_registry) by a trigger, so a namespace name costs no query. New: pglockkit.key(ns_id,
-- resource), the key without a lookup, for hot loops. Same names, signatures, results, errors and
-- key formula. The why and the figures: sql/schema/01_registry.sql ("Keys") and CHANGELOG.md.

SET LOCAL search_path = pg_catalog, pg_temp;

DO $do$
BEGIN
    IF pg_catalog.current_setting('server_version_num')::pg_catalog.int4 >= 180000 THEN
        EXECUTE $f$
            CREATE OR REPLACE FUNCTION pglockkit._h47(resource text) RETURNS bigint
            LANGUAGE sql STABLE STRICT PARALLEL SAFE
            BEGIN ATOMIC
                SELECT pg_catalog.substr(pg_catalog.sha256(pg_catalog.convert_to(resource, 'UTF8')), 1, 6)::pg_catalog.int8 >> 1;
            END$f$;
    ELSE
        EXECUTE $f$
            CREATE OR REPLACE FUNCTION pglockkit._h47(resource text) RETURNS bigint
            LANGUAGE sql STABLE STRICT PARALLEL SAFE
            BEGIN ATOMIC
                SELECT (('x' || pg_catalog.encode(
                            pg_catalog.substr(pg_catalog.sha256(pg_catalog.convert_to(resource, 'UTF8')), 1, 6),
                            'hex'))::pg_catalog.bit(48)::pg_catalog.int8) >> 1;
            END$f$;
    END IF;
END
$do$;
COMMENT ON FUNCTION pglockkit._h47(text) IS
    'Private: the 47-bit hash of a text resource (first 6 bytes of sha256 of its UTF-8 bytes, big-endian, >> 1).';

CREATE FUNCTION pglockkit._invalid_ns_id(ns_id integer) RETURNS smallint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF ns_id IS NULL THEN
        RAISE EXCEPTION 'namespace id must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF ns_id NOT BETWEEN 1 AND 32767 THEN
        RAISE EXCEPTION 'namespace id % is out of range', ns_id
            USING ERRCODE = 'numeric_value_out_of_range', HINT = 'Namespace ids are 1 to 32767.';
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pglockkit._invalid_ns_id(integer) IS
    'Private: raises 22004 for a NULL namespace id, 22003 for one outside 1..32767; NULL otherwise.';

CREATE FUNCTION pglockkit._invalid_resource(resource text) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF resource IS NULL THEN
        RAISE EXCEPTION 'lock resource must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pglockkit._invalid_resource(text) IS
    'Private: raises 22004 for a NULL text resource; NULL otherwise.';

CREATE FUNCTION pglockkit._invalid_resource(resource bigint) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF resource IS NULL THEN
        RAISE EXCEPTION 'lock resource must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF resource < 0 OR resource >= (1::int8 << 47) THEN
        RAISE EXCEPTION 'integer lock resource % is out of range', resource
            USING ERRCODE = 'numeric_value_out_of_range',
                  HINT = 'Integer resources must satisfy 0 <= id < 2^47 (140737488355328); hash larger values as text.';
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pglockkit._invalid_resource(bigint) IS
    'Private: raises 22004 for a NULL integer resource, 22003 for one outside 0 <= id < 2^47; NULL otherwise.';

CREATE OR REPLACE FUNCTION pglockkit._key(ns_id smallint, resource text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT ((ns_id::pg_catalog.int8 << 48) | 140737488355328) | pglockkit._h47(resource);
END;
COMMENT ON FUNCTION pglockkit._key(smallint, text) IS
    'Private: the lock key of a text resource in namespace id ns_id, (ns_id << 48) | (1 << 47) | h47 (NULL for a NULL resource: callers check).';

-- _key(smallint, bigint) was PL/pgSQL and raised; it is SQL now and NULL for bad input.
CREATE OR REPLACE FUNCTION pglockkit._key(ns_id smallint, resource bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT CASE WHEN resource >= 0 AND resource < 140737488355328
                THEN (ns_id::pg_catalog.int8 << 48) | resource END;
END;
COMMENT ON FUNCTION pglockkit._key(smallint, bigint) IS
    'Private: the lock key of an integer resource in namespace id ns_id, (ns_id << 48) | id; NULL for a NULL id or one outside 0 <= id < 2^47 (callers check).';

CREATE FUNCTION pglockkit._ns_id_checked(ns_id integer) RETURNS smallint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT CASE WHEN ns_id BETWEEN 1 AND 32767 THEN ns_id::pg_catalog.int2
                ELSE pglockkit._invalid_ns_id(ns_id) END;
END;
COMMENT ON FUNCTION pglockkit._ns_id_checked(integer) IS
    'Private: ns_id as a smallint; 22004 for NULL, 22003 outside 1..32767.';

CREATE FUNCTION pglockkit.key(ns_id integer, resource text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT coalesce(pglockkit._key(pglockkit._ns_id_checked(ns_id), resource),
                    pglockkit._invalid_resource(resource));
END;
COMMENT ON FUNCTION pglockkit.key(integer, text) IS
    'The lock key of a text resource in the namespace with id ns_id, without looking the namespace up: for hot loops, e.g. SELECT pg_advisory_xact_lock(pglockkit.key(16218, ''invoice:'' || id)) FROM ... Same formula as lock_key. Unlike lock_key it does not check that the id is registered (any id in 1..32767 is accepted), and a lock taken with it waits per the server''s lock_timeout, not the namespace''s, and fails without naming the holder. 22004 for NULL, 22003 for an id outside 1..32767.';

CREATE FUNCTION pglockkit.key(ns_id integer, resource bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT coalesce(pglockkit._key(pglockkit._ns_id_checked(ns_id), resource),
                    pglockkit._invalid_resource(resource));
END;
COMMENT ON FUNCTION pglockkit.key(integer, bigint) IS
    'The lock key of an integer resource (0 <= id < 2^47) in the namespace with id ns_id, without looking the namespace up. See key(integer, text). 22004 for NULL, 22003 out of range.';

CREATE FUNCTION pglockkit._ns_registry(ns text) RETURNS smallint
LANGUAGE sql STABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT NULL::pg_catalog.int2;  -- compiled by _compile_ns_registry
END;
COMMENT ON FUNCTION pglockkit._ns_registry(text) IS
    'Private, generated: the id of a registered namespace name, compiled from pglockkit.namespaces by _compile_ns_registry; NULL for a name it does not hold.';

CREATE FUNCTION pglockkit._compile_ns_registry() RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_ids   text;
    v_names text;
BEGIN
    -- One compiler at a time (two replacing the function at once fail with "tuple concurrently
    -- updated"); after the wait, this READ COMMITTED statement sees what the other committed.
    PERFORM pg_catalog.pg_advisory_xact_lock(
        pglockkit._key(pglockkit._ns_id_from_name('pglockkit'), 'namespace registry'));
    SELECT coalesce(pg_catalog.array_agg(n.id ORDER BY n.id), '{}')::text,
           coalesce(pg_catalog.array_agg(n.name ORDER BY n.id), '{}')::text
      INTO v_ids, v_names
      FROM (SELECT r.id, r.name FROM pglockkit.namespaces r FOR KEY SHARE) n;
    EXECUTE pg_catalog.format(
        'CREATE OR REPLACE FUNCTION pglockkit._ns_registry(ns text) RETURNS smallint '
        'LANGUAGE sql STABLE PARALLEL SAFE '
        'BEGIN ATOMIC SELECT (%L::pg_catalog.int2[])[pg_catalog.array_position(%L::pg_catalog.text[], ns)]; END',
        v_ids, v_names);
END
$$;
COMMENT ON FUNCTION pglockkit._compile_ns_registry() IS
    'Private: rewrites the body of _ns_registry from pglockkit.namespaces (run by a trigger on every change to it; the function''s owner only).';

CREATE FUNCTION pglockkit._namespaces_changed() RETURNS trigger
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pglockkit._compile_ns_registry();
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pglockkit._namespaces_changed() IS
    'Private: trigger on pglockkit.namespaces that recompiles _ns_registry.';

CREATE TRIGGER namespaces_compile
    AFTER INSERT OR DELETE OR UPDATE OF id, name OR TRUNCATE ON pglockkit.namespaces
    FOR EACH STATEMENT EXECUTE FUNCTION pglockkit._namespaces_changed();

CREATE FUNCTION pglockkit._ns_lookup(ns text) RETURNS smallint
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id smallint;
BEGIN
    IF ns IS NULL THEN
        RAISE EXCEPTION 'lock namespace must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    SELECT n.id INTO v_id FROM pglockkit.namespaces n WHERE n.name = ns;
    IF v_id IS NULL THEN
        RAISE EXCEPTION 'unknown lock namespace "%"', ns
            USING ERRCODE = 'undefined_object', SCHEMA = 'pglockkit', TABLE = 'namespaces',
                  HINT = pg_catalog.format('Register it first: SELECT pglockkit.register_namespace(%L);', ns);
    END IF;
    RETURN v_id;
END
$$;
COMMENT ON FUNCTION pglockkit._ns_lookup(text) IS
    'Private: the id of a registered namespace, read from the table; 22004 for NULL, 42704 for an unknown name (its TABLE field says namespaces).';

CREATE OR REPLACE FUNCTION pglockkit._ns_id(ns text) RETURNS smallint
LANGUAGE sql STABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT coalesce(pglockkit._ns_registry(ns), pglockkit._ns_lookup(ns));
END;
COMMENT ON FUNCTION pglockkit._ns_id(text) IS
    'Private: the id of a registered namespace (compiled registry, else the table); 22004 for NULL, 42704 for an unknown name.';

CREATE OR REPLACE FUNCTION pglockkit.lock_key(ns text, resource text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT coalesce(pglockkit._key(pglockkit._ns_id(ns), resource), pglockkit._invalid_resource(resource));
END;
COMMENT ON FUNCTION pglockkit.lock_key(text, text) IS
    'The advisory-lock key of a text resource: (ns_id << 48) | (1 << 47) | h47(resource), h47 = first 6 bytes of sha256(UTF-8), big-endian, >> 1. Example: lock_key(''billing'', ''invoice:42''). 42704 for an unknown namespace, 22004 for NULL.';

CREATE OR REPLACE FUNCTION pglockkit.lock_key(ns text, resource bigint) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT coalesce(pglockkit._key(pglockkit._ns_id(ns), resource), pglockkit._invalid_resource(resource));
END;
COMMENT ON FUNCTION pglockkit.lock_key(text, bigint) IS
    'The advisory-lock key of an integer resource: (ns_id << 48) | id, with 0 <= id < 2^47 (22003 otherwise). 42704 for an unknown namespace, 22004 for NULL.';

SELECT pglockkit._compile_ns_registry();

CREATE FUNCTION pglockkit._xact_lock(ns text, resource text, timeout interval) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN RETURN pglockkit._xact_lock(ns, resource, pglockkit.lock_key(ns, resource), timeout); END $$;
COMMENT ON FUNCTION pglockkit._xact_lock(text, text, interval) IS
    'Private: xact_lock(ns, text) past its fast path: the key''s errors, then the timeout''s, then the wait.';

CREATE FUNCTION pglockkit._xact_lock(ns text, resource bigint, timeout interval) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN RETURN pglockkit._xact_lock(ns, resource::text, pglockkit.lock_key(ns, resource), timeout); END $$;
COMMENT ON FUNCTION pglockkit._xact_lock(text, bigint, interval) IS
    'Private: xact_lock(ns, bigint) past its fast path: the key''s errors, then the timeout''s, then the wait.';

CREATE OR REPLACE FUNCTION pglockkit.try_lock(ns text, resource text) RETURNS boolean
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT pg_catalog.pg_try_advisory_lock(pglockkit.lock_key(ns, resource));
END;
COMMENT ON FUNCTION pglockkit.try_lock(text, text) IS
    'Session-level try-lock: true if taken, false at once if another session holds it. Held until pglockkit.unlock or the end of the session. Use on a dedicated, unpooled connection (never through a transaction-mode pooler).';

CREATE OR REPLACE FUNCTION pglockkit.try_lock(ns text, resource bigint) RETURNS boolean
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT pg_catalog.pg_try_advisory_lock(pglockkit.lock_key(ns, resource));
END;
COMMENT ON FUNCTION pglockkit.try_lock(text, bigint) IS
    'Session-level try-lock on an integer resource (0 <= id < 2^47). See try_lock(text, text).';

CREATE OR REPLACE FUNCTION pglockkit.unlock(ns text, resource text) RETURNS void
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT pglockkit._unlock(ns, resource, pglockkit.lock_key(ns, resource));
END;
COMMENT ON FUNCTION pglockkit.unlock(text, text) IS
    'Releases one hold of a session lock taken with try_lock. Releasing a lock this session does not hold is error 55000, not a silent false.';

CREATE OR REPLACE FUNCTION pglockkit.unlock(ns text, resource bigint) RETURNS void
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT pglockkit._unlock(ns, resource::text, pglockkit.lock_key(ns, resource));
END;
COMMENT ON FUNCTION pglockkit.unlock(text, bigint) IS
    'Releases one hold of a session lock on an integer resource; 55000 if not held.';

CREATE OR REPLACE FUNCTION pglockkit.try_xact_lock(ns text, resource text) RETURNS boolean
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT pg_catalog.pg_try_advisory_xact_lock(pglockkit.lock_key(ns, resource));
END;
COMMENT ON FUNCTION pglockkit.try_xact_lock(text, text) IS
    'Transaction-level try-lock: true if taken (released at commit or rollback), false at once otherwise. Safe through transaction-mode poolers.';

CREATE OR REPLACE FUNCTION pglockkit.try_xact_lock(ns text, resource bigint) RETURNS boolean
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT pg_catalog.pg_try_advisory_xact_lock(pglockkit.lock_key(ns, resource));
END;
COMMENT ON FUNCTION pglockkit.try_xact_lock(text, bigint) IS
    'Transaction-level try-lock on an integer resource. See try_xact_lock(text, text).';

CREATE OR REPLACE FUNCTION pglockkit.xact_lock(ns text, resource text, timeout interval DEFAULT NULL) RETURNS bigint
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT CASE WHEN (timeout IS NULL OR (timeout > interval '0' AND timeout <= interval '24 days'))
                     AND pg_catalog.pg_try_advisory_xact_lock(pglockkit._key(pglockkit._ns_id(ns), resource))
                THEN pglockkit._key(pglockkit._ns_id(ns), resource)
                ELSE pglockkit._xact_lock(ns, resource, timeout) END;
END;
COMMENT ON FUNCTION pglockkit.xact_lock(text, text, interval) IS
    'Transaction-level lock that waits at most timeout (else the namespace''s lock_timeout, else the server''s), then raises 55P03 naming the holder. Returns the key. Released at commit or rollback.';

CREATE OR REPLACE FUNCTION pglockkit.xact_lock(ns text, resource bigint, timeout interval DEFAULT NULL) RETURNS bigint
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT CASE WHEN (timeout IS NULL OR (timeout > interval '0' AND timeout <= interval '24 days'))
                     AND pg_catalog.pg_try_advisory_xact_lock(pglockkit._key(pglockkit._ns_id(ns), resource))
                THEN pglockkit._key(pglockkit._ns_id(ns), resource)
                ELSE pglockkit._xact_lock(ns, resource, timeout) END;
END;
COMMENT ON FUNCTION pglockkit.xact_lock(text, bigint, interval) IS
    'xact_lock on an integer resource (0 <= id < 2^47). See xact_lock(text, text, interval).';

CREATE OR REPLACE FUNCTION pglockkit.xact_lock_all(ns text, resources bigint[], timeout interval DEFAULT NULL) RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id smallint := pglockkit._ns_id(ns);
BEGIN
    IF resources IS NULL OR pg_catalog.array_position(resources, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'resources must be an array without nulls' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF pg_catalog.cardinality(resources) OPERATOR(pg_catalog.>) 1000 THEN
        RAISE EXCEPTION 'xact_lock_all takes at most 1000 resources, got %', pg_catalog.cardinality(resources)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Each lock takes an entry of the server''s shared lock table, which all sessions share: lock a coarser resource (their parent) instead.';
    END IF;
    RETURN pglockkit._xact_lock_all(ns,
        ARRAY(SELECT r::text FROM pg_catalog.unnest(resources) AS r),
        ARRAY(SELECT coalesce(pglockkit._key(v_id, r), pglockkit._invalid_resource(r))
                FROM pg_catalog.unnest(resources) AS r), timeout);
END
$$;
COMMENT ON FUNCTION pglockkit.xact_lock_all(text, bigint[], interval) IS
    'xact_lock_all on integer resources. See xact_lock_all(text, text[], interval).';

-- They call _key, now STABLE (convert_to is): an IMMUTABLE caller would not be inlined.
ALTER FUNCTION pglockkit._lease_session_key(text, integer) STABLE;
ALTER FUNCTION pglockkit._run_key(text, text) STABLE;

SELECT pglockkit._grant_privileges();
