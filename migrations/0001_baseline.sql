-- pglockkit 0001: the baseline, release 0.1.0: the schema of sql/schema/ when 0.1.0 was cut.
-- History from here on: never edited. Fresh installs do not run it (they run sql/schema/ and record
-- it as applied); it is the start of the upgrade chain, which a test builds and compares with
-- sql/schema/. Every change after 0.1.0 is a delta migration after it (CONTRIBUTING.md).

-- ==== sql/schema/01_registry.sql ====

-- Registry and keys: the schema, the namespace registry and the lock-key formula
--
-- The current definition of each object, once. A change edits this file and adds a delta
-- migration (see CONTRIBUTING.md); a test checks that both build the same schema.

-- Bodies written BEGIN ATOMIC, views and CHECK constraints are bound when they are created: under
-- this search path, whatever the installer's session had (migrations set it too).
SET LOCAL search_path = pg_catalog, pg_temp;

CREATE SCHEMA pglockkit;
COMMENT ON SCHEMA pglockkit IS
    'pglockkit: coordination primitives (namespaced advisory locks, job queue, leases, singleton runs, monitoring). Call the functions; the tables are private.';

-- The longest lock wait, named once: the lock helpers, their inlined fast paths and the
-- namespaces' CHECK use it (so it comes before the table). IMMUTABLE SQL without a SET clause:
-- the planner folds it into a constant, in an inlined caller too.
CREATE FUNCTION pglockkit._longest_lock_wait() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN interval '24 days';
COMMENT ON FUNCTION pglockkit._longest_lock_wait() IS
    'Private: the longest lock timeout pglockkit accepts, 24 days (PostgreSQL times a wait in milliseconds in a 32-bit integer).';

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
    updated_at   timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    CONSTRAINT namespaces_lock_timeout_max CHECK (lock_timeout OPERATOR(pg_catalog.<=) pglockkit._longest_lock_wait())
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
--
-- Every lock call computes a key, so the key functions are SQL functions with BEGIN ATOMIC bodies
-- and no SET clause: the planner inlines them into the caller's statement (a SET clause, a
-- PL/pgSQL body, or a STABLE call inside an IMMUTABLE function would each forbid it), and a
-- BEGIN ATOMIC body is parsed once, at CREATE time under this file's search path, so a caller's
-- search_path cannot change what it calls. Inlined with a constant namespace name, the namespace
-- id folds to a constant when the statement is planned: `xact_lock('billing', $1)` costs the hash
-- and the lock, and no query. (Measured on PG 18: lock_key went from 7 us to 0.7 us a call; see
-- CHANGELOG.md, 0002.) The _invalid_* functions raise for bad input and return NULL otherwise,
-- so the planner may evaluate them early on constants without raising for good input.
-- ---------------------------------------------------------------------------------------------

-- STABLE, not IMMUTABLE: convert_to is STABLE (conversions are catalog entries). PostgreSQL 18
-- casts bytea to bigint (big-endian); before 18 the bytes' hex text is read as bit(48). The same
-- 47 bits either way (the vectors test runs on both), but an executor sets the bit(48) reading up
-- again for every statement (type input and output lookups), which a lock per statement pays.
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

CREATE FUNCTION pglockkit._ns_id_from_name(name text) RETURNS smallint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT ((('x' || pg_catalog.encode(
                pg_catalog.substr(pg_catalog.sha256(pg_catalog.convert_to(name, 'UTF8')), 1, 2),
                'hex'))::pg_catalog.bit(16)::pg_catalog.int4 % 32767)
            + 1)::pg_catalog.int2
$$;
COMMENT ON FUNCTION pglockkit._ns_id_from_name(text) IS
    'Private: the namespace id derived from a name (first 2 bytes of sha256, big-endian, mod 32767, plus 1), the same in every database.';

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

CREATE FUNCTION pglockkit._key(ns_id smallint, resource text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT ((ns_id::pg_catalog.int8 << 48) | 140737488355328) | pglockkit._h47(resource);
END;
COMMENT ON FUNCTION pglockkit._key(smallint, text) IS
    'Private: the lock key of a text resource in namespace id ns_id, (ns_id << 48) | (1 << 47) | h47 (NULL for a NULL resource: callers check).';

CREATE FUNCTION pglockkit._key(ns_id smallint, resource bigint) RETURNS bigint
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

-- ---------------------------------------------------------------------------------------------
-- Namespace lookup. The registry is compiled into the body of _ns_registry (two constant arrays)
-- whenever a statement changes pglockkit.namespaces, by a trigger, in the same transaction: the
-- planner then folds a constant name to its id, and a name that is a parameter costs one
-- array_position, not a query. Replacing the function invalidates every cached plan that inlined
-- it, in every session. A name the compiled body lacks falls back to a query of the table, which
-- also raises the errors; so the compiled body can only be missing names (a REPEATABLE READ
-- registration that did not see another's), never hold a wrong id: compiling locks the rows it
-- reads FOR KEY SHARE, which under REPEATABLE READ fails (40001) for a row deleted or re-keyed
-- after the snapshot.
-- ---------------------------------------------------------------------------------------------
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

CREATE FUNCTION pglockkit._ns_id(ns text) RETURNS smallint
LANGUAGE sql STABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT coalesce(pglockkit._ns_registry(ns), pglockkit._ns_lookup(ns));
END;
COMMENT ON FUNCTION pglockkit._ns_id(text) IS
    'Private: the id of a registered namespace (compiled registry, else the table); 22004 for NULL, 42704 for an unknown name.';

CREATE FUNCTION pglockkit.lock_key(ns text, resource text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT coalesce(pglockkit._key(pglockkit._ns_id(ns), resource), pglockkit._invalid_resource(resource));
END;
COMMENT ON FUNCTION pglockkit.lock_key(text, text) IS
    'The advisory-lock key of a text resource: (ns_id << 48) | (1 << 47) | h47(resource), h47 = first 6 bytes of sha256(UTF-8), big-endian, >> 1. Example: lock_key(''billing'', ''invoice:42''). 42704 for an unknown namespace, 22004 for NULL.';

CREATE FUNCTION pglockkit.lock_key(ns text, resource bigint) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT coalesce(pglockkit._key(pglockkit._ns_id(ns), resource), pglockkit._invalid_resource(resource));
END;
COMMENT ON FUNCTION pglockkit.lock_key(text, bigint) IS
    'The advisory-lock key of an integer resource: (ns_id << 48) | id, with 0 <= id < 2^47 (22003 otherwise). 42704 for an unknown namespace, 22004 for NULL.';

CREATE FUNCTION pglockkit.decode_key(
    key bigint,
    OUT namespace_id integer, OUT namespace text, OUT form text, OUT resource_bits bigint)
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    -- Namespace ids are 1..32767: a key under 2^48 (namespace 0, a plain pg_advisory_lock(42))
    -- or negative is foreign (0017).
    SELECT CASE WHEN (key >> 48) > 0 THEN (key >> 48)::int4 END,
           (SELECT n.name FROM pglockkit.namespaces n
             WHERE (key >> 48) > 0
               AND n.id = (key >> 48)::int4),
           CASE WHEN (key >> 48) <= 0 THEN 'foreign'
                WHEN (key & (1::int8 << 47)) <> 0 THEN 'text'
                WHEN key IS NOT NULL THEN 'integer' END,
           key & ((1::int8 << 47) - 1)
$$;
COMMENT ON FUNCTION pglockkit.decode_key(bigint) IS
    'Splits a lock key into namespace id, registered namespace name (NULL if unregistered), form (''text'' hash, ''integer'' id, or ''foreign'' for keys below 2^48 or negative, in no namespace id 1..32767: pglockkit never makes them, a plain pg_advisory_lock(42) does) and the low 47 bits. All NULL for a NULL key.';

CREATE FUNCTION pglockkit.decode_key(
    classid oid, objid oid,
    OUT namespace_id integer, OUT namespace text, OUT form text, OUT resource_bits bigint)
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT d.namespace_id, d.namespace, d.form, d.resource_bits
      FROM pglockkit.decode_key((classid::int8 << 32) | objid::int8) d
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
    IF register_namespace.name !~ '^[a-z][a-z0-9_.:-]{0,62}$' THEN
        RAISE EXCEPTION 'invalid namespace name "%"', register_namespace.name
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'A namespace name is 1 to 63 characters: a lowercase letter, then lowercase letters, digits, or _ . : -';
    END IF;
    IF register_namespace.id IS NOT NULL AND register_namespace.id NOT BETWEEN 1 AND 32767 THEN
        RAISE EXCEPTION 'namespace id % is out of range', register_namespace.id
            USING ERRCODE = 'numeric_value_out_of_range', HINT = 'Namespace ids are 1 to 32767.';
    END IF;
    IF register_namespace.lock_timeout IS NOT NULL AND register_namespace.lock_timeout <= interval '0' THEN
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
     WHERE n.id = coalesce(register_namespace.id::int2, pglockkit._ns_id_from_name(register_namespace.name));
    RAISE EXCEPTION 'namespace id % is already held by namespace "%"',
            coalesce(register_namespace.id::int2, pglockkit._ns_id_from_name(register_namespace.name)), v_name
        USING ERRCODE = 'unique_violation',
              HINT = pg_catalog.format('Choose a free id explicitly: SELECT pglockkit.register_namespace(%L, <id>);', register_namespace.name);
END
$$;
COMMENT ON FUNCTION pglockkit.register_namespace(text, integer, text, interval) IS
    'Registers a lock namespace and returns its id (1..32767). Without an id, the id is derived from the name, the same in every database. Idempotent: registering an existing name again returns its id (a non-NULL description or lock_timeout updates it). A name already registered under another id, or an id held by another name, is error 23505 naming the holder.';

-- The kit's own namespace (installer mutex and other internal locks).
INSERT INTO pglockkit.namespaces (id, name, description)
VALUES (pglockkit._ns_id_from_name('pglockkit'), 'pglockkit', 'pglockkit''s own locks (the installer''s mutex, ...)');

-- ==== sql/schema/02_locks.sql ====

-- Locks: advisory-lock helpers (session and transaction, try and wait, many at once) and row locks
--
-- The current definition of each object, once. A change edits this file and adds a delta
-- migration (see CONTRIBUTING.md); a test checks that both build the same schema.

-- ---------------------------------------------------------------------------------------------
-- Advisory-lock helpers
-- ---------------------------------------------------------------------------------------------
CREATE FUNCTION pglockkit._check_timeout(timeout interval) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF timeout IS NOT NULL AND timeout <= interval '0' THEN
        RAISE EXCEPTION 'lock timeout must be positive, got %', timeout
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'To skip instead of waiting, use try_xact_lock; for the default wait, pass NULL.';
    END IF;
    IF timeout IS NOT NULL AND timeout > pglockkit._longest_lock_wait() THEN
        RAISE EXCEPTION 'lock timeout % is out of range', timeout
            USING ERRCODE = 'numeric_value_out_of_range',
                  HINT = pg_catalog.format('The longest lock wait PostgreSQL can time is %s; pass NULL to wait without a limit of pglockkit''s.',
                                           pglockkit._longest_lock_wait());
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
     WHERE l.locktype = 'advisory' AND l.granted
       AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database())
       AND l.objsubid = 1
       AND l.classid = (key >> 32)::oid
       AND l.objid = (key & 4294967295)::oid
$$;
COMMENT ON FUNCTION pglockkit._lock_holders(bigint) IS
    'Private: the pids holding a bigint advisory lock key in this database, for error messages.';

-- A timeout is checked by comparing intervals, where a month is 30 days and so a year 360; its
-- epoch counts a year as 365.25 days. '-1 year 361 days' compared as a day and was timed as -4.25
-- days (1 ms); '1 year -340 days' compared as 20 days and was timed as 25.25, over what the server
-- can time (0016). A timeout is timed on the comparisons' scale: its epoch less 5.25 days a year.
CREATE FUNCTION pglockkit._timeout_span(timeout interval) RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    -- (OPERATOR() syntax has one precedence for all operators: the product is in parentheses.)
    SELECT pg_catalog.make_interval(secs => pg_catalog.date_part('epoch', timeout)
                                            - (pg_catalog.date_part('year', timeout) * 453600))
$$;
COMMENT ON FUNCTION pglockkit._timeout_span(interval) IS
    'Private: a timeout as the span its comparisons see (a month 30 days, a year 360): what a wait of that timeout lasts.';

CREATE FUNCTION pglockkit._set_lock_timeout(timeout interval) RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    -- Whole milliseconds, at least 1: lock_timeout = 0 would mean "wait forever".
    SELECT pg_catalog.set_config('lock_timeout',
        (SELECT CASE WHEN ms < 1 THEN 1 ELSE ms END
           FROM (SELECT pg_catalog.ceil(pg_catalog.date_part('epoch', pglockkit._timeout_span(timeout)) * 1000)::int8 AS ms) m
        )::text || 'ms',
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
                coalesce(timeout::text, 'lock_timeout ' || v_prev)
            USING ERRCODE = 'lock_not_available',
                  DETAIL = 'Held by pid ' || pglockkit._lock_holders(key) || '.',
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
        (SELECT n.lock_timeout FROM pglockkit.namespaces n WHERE n.name = ns)));
    RETURN key;
END
$$;
COMMENT ON FUNCTION pglockkit._xact_lock(text, text, bigint, interval) IS
    'Private: try the key, else wait with the call''s timeout, else the namespace''s, else the server''s.';

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
    v_timeout := coalesce(timeout, (SELECT n.lock_timeout FROM pglockkit.namespaces n WHERE n.name = ns));
    v_deadline := pg_catalog.clock_timestamp() + pglockkit._timeout_span(v_timeout);
    -- Ascending key order is what makes two callers unable to deadlock on the same set.
    FOR v_key, v_label IN
        SELECT DISTINCT ON (k.key) k.key, k.label
          FROM ROWS FROM (pg_catalog.unnest(keys), pg_catalog.unnest(labels)) AS k(key, label)
         ORDER BY k.key
    LOOP
        IF NOT pg_catalog.pg_try_advisory_xact_lock(v_key) THEN
            IF v_deadline IS NOT NULL THEN
                v_left := v_deadline - pg_catalog.clock_timestamp();
                IF v_left <= interval '0' THEN
                    RAISE EXCEPTION 'could not lock %/% (key %) within % (the whole call''s budget)', ns, v_label, v_key, v_timeout
                        USING ERRCODE = 'lock_not_available',
                              DETAIL = 'Held by pid ' || pglockkit._lock_holders(v_key) || '.',
                              HINT = 'Retry with jittered backoff; pg_locks (locktype advisory, classid >> 16 = namespace id) shows the holders.';
                END IF;
            END IF;
            PERFORM pglockkit._xact_lock_wait(ns, v_label, v_key, v_left);
        END IF;
        v_done := v_done || v_key;
    END LOOP;
    RETURN v_done;
END
$$;
COMMENT ON FUNCTION pglockkit._xact_lock_all(text, text[], bigint[], interval) IS
    'Private: takes transaction advisory locks on keys in ascending order within one timeout budget.';

CREATE FUNCTION pglockkit.try_lock(ns text, resource text) RETURNS boolean
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT pg_catalog.pg_try_advisory_lock(pglockkit.lock_key(ns, resource));
END;
COMMENT ON FUNCTION pglockkit.try_lock(text, text) IS
    'Session-level try-lock: true if taken, false at once if another session holds it. Held until pglockkit.unlock or the end of the session. Use on a dedicated, unpooled connection (never through a transaction-mode pooler).';

CREATE FUNCTION pglockkit.try_lock(ns text, resource bigint) RETURNS boolean
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT pg_catalog.pg_try_advisory_lock(pglockkit.lock_key(ns, resource));
END;
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
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT pglockkit._unlock(ns, resource, pglockkit.lock_key(ns, resource));
END;
COMMENT ON FUNCTION pglockkit.unlock(text, text) IS
    'Releases one hold of a session lock taken with try_lock. Releasing a lock this session does not hold is error 55000, not a silent false.';

CREATE FUNCTION pglockkit.unlock(ns text, resource bigint) RETURNS void
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT pglockkit._unlock(ns, resource::text, pglockkit.lock_key(ns, resource));
END;
COMMENT ON FUNCTION pglockkit.unlock(text, bigint) IS
    'Releases one hold of a session lock on an integer resource; 55000 if not held.';

CREATE FUNCTION pglockkit.try_xact_lock(ns text, resource text) RETURNS boolean
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT pg_catalog.pg_try_advisory_xact_lock(pglockkit.lock_key(ns, resource));
END;
COMMENT ON FUNCTION pglockkit.try_xact_lock(text, text) IS
    'Transaction-level try-lock: true if taken (released at commit or rollback), false at once otherwise. Safe through transaction-mode poolers.';

CREATE FUNCTION pglockkit.try_xact_lock(ns text, resource bigint) RETURNS boolean
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT pg_catalog.pg_try_advisory_xact_lock(pglockkit.lock_key(ns, resource));
END;
COMMENT ON FUNCTION pglockkit.try_xact_lock(text, bigint) IS
    'Transaction-level try-lock on an integer resource. See try_xact_lock(text, text).';

-- Inlined into the caller's statement (see "Keys" in 01_registry.sql): with a valid (or no)
-- timeout and a free lock, one try-lock and no PL/pgSQL call. The key expression is written
-- twice on that path (the planner has no common subexpressions): the hash runs twice, well under
-- a microsecond on PG 18. It is _key's, which is NULL for bad input rather than raising: a NULL
-- key fails the try, and the slow path (_xact_lock) raises the input's error, checks the timeout
-- and waits. Every function the expression names is set up by the executor for each statement,
-- so the fast path names as few as it can.
CREATE FUNCTION pglockkit.xact_lock(ns text, resource text, timeout interval DEFAULT NULL) RETURNS bigint
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT CASE WHEN (timeout IS NULL OR (timeout > interval '0' AND timeout <= pglockkit._longest_lock_wait()))
                     AND pg_catalog.pg_try_advisory_xact_lock(pglockkit._key(pglockkit._ns_id(ns), resource))
                THEN pglockkit._key(pglockkit._ns_id(ns), resource)
                ELSE pglockkit._xact_lock(ns, resource, timeout) END;
END;
COMMENT ON FUNCTION pglockkit.xact_lock(text, text, interval) IS
    'Transaction-level lock that waits at most timeout (else the namespace''s lock_timeout, else the server''s), then raises 55P03 naming the holder. Returns the key. Released at commit or rollback.';

CREATE FUNCTION pglockkit.xact_lock(ns text, resource bigint, timeout interval DEFAULT NULL) RETURNS bigint
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT CASE WHEN (timeout IS NULL OR (timeout > interval '0' AND timeout <= pglockkit._longest_lock_wait()))
                     AND pg_catalog.pg_try_advisory_xact_lock(pglockkit._key(pglockkit._ns_id(ns), resource))
                THEN pglockkit._key(pglockkit._ns_id(ns), resource)
                ELSE pglockkit._xact_lock(ns, resource, timeout) END;
END;
COMMENT ON FUNCTION pglockkit.xact_lock(text, bigint, interval) IS
    'xact_lock on an integer resource (0 <= id < 2^47). See xact_lock(text, text, interval).';

CREATE FUNCTION pglockkit.xact_lock_all(ns text, resources text[], timeout interval DEFAULT NULL) RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id   smallint := pglockkit._ns_id(ns);
    v_keys bigint[];
    v_key  bigint;
BEGIN
    IF resources IS NULL OR pg_catalog.array_position(resources, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'resources must be an array without nulls' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF pg_catalog.cardinality(resources) > 1000 THEN
        RAISE EXCEPTION 'xact_lock_all takes at most 1000 resources, got %', pg_catalog.cardinality(resources)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Each lock takes an entry of the server''s shared lock table, which all sessions share: lock a coarser resource (their parent) instead.';
    END IF;
    -- Fast path: with a valid (or no) timeout, try the keys in ascending order; all free, done.
    -- At the first held key, the waiting path takes them all in ascending order again (a key
    -- this transaction holds is taken again at once), so the order, and with it the freedom from
    -- deadlocks, is the same. The waiting path checks the timeout, reads the namespace's
    -- lock_timeout and names the holder; a free set of locks pays for none of it.
    IF timeout IS NULL OR (timeout > interval '0'
                           AND timeout <= pglockkit._longest_lock_wait()) THEN
        v_keys := ARRAY(SELECT DISTINCT pglockkit._key(v_id, r) FROM pg_catalog.unnest(resources) AS r ORDER BY 1);
        FOREACH v_key IN ARRAY v_keys LOOP
            IF NOT pg_catalog.pg_try_advisory_xact_lock(v_key) THEN
                v_keys := NULL;
                EXIT;
            END IF;
        END LOOP;
        IF v_keys IS NOT NULL THEN
            RETURN v_keys;
        END IF;
    END IF;
    RETURN pglockkit._xact_lock_all(ns, resources,
        ARRAY(SELECT pglockkit._key(v_id, r) FROM pg_catalog.unnest(resources) AS r), timeout);
END
$$;
COMMENT ON FUNCTION pglockkit.xact_lock_all(text, text[], interval) IS
    'Transaction-level locks on many resources (at most 1000, 22023 otherwise), taken in ascending key order so that two callers can never deadlock on them; the timeout bounds the whole call (55P03). Returns the keys in the order taken.';

CREATE FUNCTION pglockkit.xact_lock_all(ns text, resources bigint[], timeout interval DEFAULT NULL) RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id   smallint := pglockkit._ns_id(ns);
    v_keys bigint[];
    v_key  bigint;
BEGIN
    IF resources IS NULL OR pg_catalog.array_position(resources, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'resources must be an array without nulls' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF pg_catalog.cardinality(resources) > 1000 THEN
        RAISE EXCEPTION 'xact_lock_all takes at most 1000 resources, got %', pg_catalog.cardinality(resources)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Each lock takes an entry of the server''s shared lock table, which all sessions share: lock a coarser resource (their parent) instead.';
    END IF;
    -- Fast path: with a valid (or no) timeout, try the keys in ascending order; all free, done.
    -- At the first held key, the waiting path takes them all in ascending order again (a key
    -- this transaction holds is taken again at once), so the order, and with it the freedom from
    -- deadlocks, is the same. The waiting path checks the timeout, reads the namespace's
    -- lock_timeout and names the holder; a free set of locks pays for none of it.
    IF timeout IS NULL OR (timeout > interval '0'
                           AND timeout <= pglockkit._longest_lock_wait()) THEN
        v_keys := ARRAY(SELECT DISTINCT coalesce(pglockkit._key(v_id, r), pglockkit._invalid_resource(r))
                          FROM pg_catalog.unnest(resources) AS r ORDER BY 1);
        FOREACH v_key IN ARRAY v_keys LOOP
            IF NOT pg_catalog.pg_try_advisory_xact_lock(v_key) THEN
                v_keys := NULL;
                EXIT;
            END IF;
        END LOOP;
        IF v_keys IS NOT NULL THEN
            RETURN v_keys;
        END IF;
    END IF;
    RETURN pglockkit._xact_lock_all(ns,
        ARRAY(SELECT r::text FROM pg_catalog.unnest(resources) AS r),
        ARRAY(SELECT coalesce(pglockkit._key(v_id, r), pglockkit._invalid_resource(r))
                FROM pg_catalog.unnest(resources) AS r), timeout);
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
    v_kind     "char";
    v_type     regtype;
    v_base     regtype;  -- v_type, or the type a domain is over
    v_next     regtype;
    v_what     text;
BEGIN
    IF tbl IS NULL THEN
        RAISE EXCEPTION 'table must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF ids IS NULL OR pg_catalog.array_position(ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'ids must be an array without nulls' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    PERFORM pglockkit._check_timeout(timeout);
    SELECT c.relkind, a.atttypid INTO v_kind, v_type
      FROM pg_catalog.pg_class c
      LEFT JOIN pg_catalog.pg_attribute a
             ON a.attrelid = c.oid AND a.attname = 'id'
            AND a.attnum > 0 AND NOT a.attisdropped
     WHERE c.oid = tbl;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'relation with OID % does not exist', tbl::oid USING ERRCODE = 'undefined_table';
    END IF;
    v_what := CASE v_kind WHEN 'r' THEN 'table' WHEN 'p' THEN 'partitioned table' WHEN 'v' THEN 'view'
                          WHEN 'f' THEN 'foreign table' WHEN 'S' THEN 'sequence' WHEN 'i' THEN 'index'
                          WHEN 'I' THEN 'partitioned index' WHEN 'c' THEN 'composite type'
                          WHEN 'm' THEN 'materialized view' WHEN 't' THEN 'TOAST table'
                          ELSE pg_catalog.format('relation of kind %L', v_kind) END;
    IF v_kind <> ALL ('{r,p,v,f}'::"char"[]) THEN
        RAISE EXCEPTION '% is %, not a table: lock_rows locks rows of a table, partitioned table, view or foreign table', tbl,
                        CASE WHEN v_kind = 'i' THEN 'an ' ELSE 'a ' END || v_what
            USING ERRCODE = 'wrong_object_type';
    END IF;
    IF v_type IS NULL THEN
        RAISE EXCEPTION '% % has no column "id"', v_what, tbl USING ERRCODE = 'undefined_column',
            HINT = 'lock_rows locks rows by their "id" column; for other keys: SELECT ... ORDER BY key FOR UPDATE.';
    END IF;
    -- A floating-point id compares with a bigint as a float: 2^53 + 1 found (and locked) the row of
    -- 2^53 (0016). Refused, as a domain over one is.
    v_base := v_type;
    LOOP
        SELECT t.typbasetype INTO v_next FROM pg_catalog.pg_type t WHERE t.oid = v_base AND t.typtype = 'd';
        EXIT WHEN NOT FOUND;
        v_base := v_next;
    END LOOP;
    IF v_base IN ('real'::regtype, 'double precision'::regtype) THEN
        RAISE EXCEPTION 'column "id" of % % is %, not an integer', v_what, tbl, v_type
            USING ERRCODE = 'datatype_mismatch',
                  DETAIL = 'A floating-point id matches more than one bigint: lock_rows could lock a row whose id was not asked for.',
                  HINT = 'lock_rows locks rows by integer id; for other keys: SELECT ... ORDER BY key FOR UPDATE.';
    END IF;
    -- regclass output is schema-qualified where needed and quoted: safe to splice in.
    v_sql := pg_catalog.format('SELECT 1 FROM %s WHERE id = $1 FOR UPDATE', tbl);
    v_deadline := pg_catalog.clock_timestamp() + pglockkit._timeout_span(timeout);
    -- One row at a time in ascending id order: the order is what prevents deadlocks, and the
    -- deadline makes the timeout bound the whole call.
    FOR v_id IN SELECT DISTINCT i FROM pg_catalog.unnest(ids) AS i ORDER BY i LOOP
        BEGIN
            IF v_deadline IS NOT NULL THEN
                v_left := v_deadline - pg_catalog.clock_timestamp();
                PERFORM pglockkit._set_lock_timeout(v_left);
            END IF;
            EXECUTE v_sql USING v_id;
            GET DIAGNOSTICS v_rows = ROW_COUNT;
        EXCEPTION WHEN lock_not_available THEN
            RAISE EXCEPTION 'could not lock row % of % within %', v_id, tbl, coalesce(timeout::text, 'lock_timeout ' || v_prev)
                USING ERRCODE = 'lock_not_available',
                      HINT = 'Retry with jittered backoff; pg_blocking_pids() of a waiting session names who blocks it.';
        WHEN undefined_function THEN
            -- "id" does not compare with a bigint (a uuid, text, ...): raised by the first id, before
            -- any row is locked. Caught here rather than checked up front, so a good call pays nothing.
            RAISE EXCEPTION 'column "id" of table % is %, not an integer', tbl, v_type
                USING ERRCODE = 'datatype_mismatch', DETAIL = SQLERRM,
                      HINT = 'lock_rows locks rows by integer id; for other keys, lock them with xact_lock_all (text resources) or SELECT ... ORDER BY key FOR UPDATE.';
        WHEN feature_not_supported THEN
            -- A view with an aggregate, DISTINCT, GROUP BY, UNION, a window function, ...: its rows
            -- are not rows of one table. Raised when the statement is planned, by the first id.
            RAISE EXCEPTION 'rows of % % cannot be locked FOR UPDATE', v_what, tbl
                USING ERRCODE = 'wrong_object_type', DETAIL = SQLERRM,
                      HINT = 'Lock the rows of the table under it, or make the view a plain SELECT from one table.';
        WHEN numeric_value_out_of_range THEN
            -- The id does not fit the column's type (an oid column and an id over 2^32 - 1).
            RAISE EXCEPTION 'id % is out of range for column "id" of % % (%)', v_id, v_what, tbl, v_type
                USING ERRCODE = 'numeric_value_out_of_range', DETAIL = SQLERRM;
        END;
        v_found := v_found + v_rows;
    END LOOP;
    IF v_deadline IS NOT NULL THEN
        PERFORM pg_catalog.set_config('lock_timeout', v_prev, true);
    END IF;
    RETURN v_found;
END
$$;
COMMENT ON FUNCTION pglockkit.lock_rows(regclass, bigint[], interval) IS
    'Locks rows of a table (or partitioned table, simple view, foreign table) FOR UPDATE by their "id" column, in ascending id order, so that callers locking several rows cannot deadlock each other. The timeout bounds the whole call (55P03). Returns how many of the ids exist (and are now locked). Another kind of relation, or a view whose rows cannot be locked, is 42809; no "id" column 42703; an "id" that is not a number, or a floating-point one, 42804; an id outside the column''s type 22003. Runs with the caller''s privileges.';

-- ==== sql/schema/03_leases.sql ====

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

CREATE SEQUENCE pglockkit.lease_tokens AS bigint NO CYCLE;
COMMENT ON SEQUENCE pglockkit.lease_tokens IS
    'Fencing tokens of leases: drawn by each acquisition once the row version it replaces was written (again if the row changed while it waited, so values are skipped), never reused; each name''s tokens strictly increase.';

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
            v_token := pg_catalog.nextval('pglockkit.lease_tokens');
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

-- ==== sql/schema/04_runs.sql ====

-- Runs: one run per job and slot (cron pods)
--
-- The current definition of each object, once. A change edits this file and adds a delta
-- migration (see CONTRIBUTING.md); a test checks that both build the same schema.

CREATE TABLE pglockkit.runs (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job         text        NOT NULL CHECK (job OPERATOR(pg_catalog.<>) ''),
    slot        text        NOT NULL CHECK (slot OPERATOR(pg_catalog.<>) ''),
    holder      text        NOT NULL,
    status      text        NOT NULL CHECK (status IN ('running', 'succeeded', 'failed')),
    attempt     integer     NOT NULL DEFAULT 1,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz,
    detail      text,
    holder_pid  integer,
    CONSTRAINT runs_job_slot_key UNIQUE (job, slot),
    CONSTRAINT runs_job_length CHECK (pg_catalog.octet_length(job) OPERATOR(pg_catalog.<=) 1024),
    CONSTRAINT runs_slot_length CHECK (pg_catalog.octet_length(slot) OPERATOR(pg_catalog.<=) 1024)
);
COMMENT ON TABLE pglockkit.runs IS
    'One row per (job, slot) that started. Write it through start_run / finish_run; read pglockkit.run_history.';

CREATE FUNCTION pglockkit._run_key(job text, slot text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT pglockkit._key(pglockkit._ns_id_from_name('pglockkit'),
        'run:' OPERATOR(pg_catalog.||) pg_catalog.length(job)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
               OPERATOR(pg_catalog.||) job OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) slot)
$$;
COMMENT ON FUNCTION pglockkit._run_key(text, text) IS
    'Private: the advisory key (namespace pglockkit, resource run:<len(job)>:<job>:<slot>) that a run''s starter holds while it runs. Inlined, its text parsed in the caller''s context (run_history''s reader''s): every name in it, types included, is qualified.';

CREATE FUNCTION pglockkit.start_run(job text, slot text, holder text) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_key bigint;
    v_id  bigint;
BEGIN
    IF start_run.job IS NULL OR start_run.slot IS NULL OR start_run.holder IS NULL THEN
        RAISE EXCEPTION 'job, slot and holder must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF start_run.job = '' OR start_run.slot = '' OR start_run.holder = '' THEN
        RAISE EXCEPTION 'job, slot and holder must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_key := pglockkit._run_key(start_run.job, start_run.slot);
    IF pglockkit._advisory_held(v_key, true) THEN
        -- Advisory locks are re-entrant: this session already holds the slot's key. If it runs the
        -- slot now, once is enough. If not, its earlier start_run was rolled back with its
        -- transaction (the key outlives it): start the run on the key already held.
        IF EXISTS (SELECT FROM pglockkit.runs r
                    WHERE r.job = start_run.job AND r.slot = start_run.slot
                      AND r.status = 'running'
                      AND r.holder_pid = pg_catalog.pg_backend_pid()) THEN
            RETURN NULL;
        END IF;
    -- Herd guard: while a live session starts or runs this slot, everyone else returns at once.
    ELSIF NOT pg_catalog.pg_try_advisory_lock(v_key) THEN
        RETURN NULL;
    END IF;
    -- Backstop: one row per (job, slot). We hold the key, so a row still 'running' lost its holder.
    -- A failed insert (e.g. a job name too long for the index) must not leave the key held.
    BEGIN
    INSERT INTO pglockkit.runs AS r (job, slot, holder, status, started_at, holder_pid)
    VALUES (start_run.job, start_run.slot, start_run.holder, 'running', pg_catalog.clock_timestamp(), pg_catalog.pg_backend_pid())
    ON CONFLICT ON CONSTRAINT runs_job_slot_key DO UPDATE
       SET holder = excluded.holder, status = 'running', attempt = r.attempt + 1,
           started_at = excluded.started_at, finished_at = NULL, detail = NULL, holder_pid = excluded.holder_pid
     WHERE r.status = 'running'
    RETURNING r.id INTO v_id;
    EXCEPTION WHEN OTHERS OR query_canceled THEN  -- OTHERS leaves out a statement_timeout (0015)
        PERFORM pg_catalog.pg_advisory_unlock(v_key);
        RAISE;
    END;
    IF v_id IS NULL THEN
        PERFORM pg_catalog.pg_advisory_unlock(v_key);  -- the slot already ran
    END IF;
    RETURN v_id;
END
$$;
COMMENT ON FUNCTION pglockkit.start_run(text, text, text) IS
    'Starts the run of job for slot (e.g. a date) and returns its id, or NULL if that slot already ran or another live session is running it. The calling session keeps a lock on the slot until finish_run or its end: call it on a direct connection, not through a transaction-mode pooler. A run whose session ended before finish_run is re-run by the next start_run (attempt + 1).';

CREATE FUNCTION pglockkit.finish_run(run_id bigint, ok boolean, detail text DEFAULT NULL) RETURNS boolean
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
       AND r.holder_pid = pg_catalog.pg_backend_pid()
       AND pglockkit._advisory_held(pglockkit._run_key(r.job, r.slot), true)
    RETURNING r.job, r.slot INTO v_job, v_slot;
    IF NOT FOUND THEN
        IF NOT EXISTS (SELECT FROM pglockkit.runs r WHERE r.id = run_id) THEN
            RAISE EXCEPTION 'no run with id %', run_id
                USING ERRCODE = 'undefined_object', SCHEMA = 'pglockkit', TABLE = 'runs';
        END IF;
        RETURN false;  -- already finished, or not this session's run
    END IF;
    -- The slot's key is let go of when this transaction commits (trigger runs_release_slot), not
    -- here: a session lock outlives a rollback, and a finish that rolled back would leave the live
    -- runner's slot free for the next start_run, which would run it again (0015).
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.finish_run(bigint, boolean, text) IS
    'Records the outcome of a run (ok => succeeded, else failed, with detail) and releases its slot lock when the transaction commits (rolled back, the run is still this session''s to finish). Only the session that started the run and holds its slot lock may: true then; false, and nothing changed, if the run had already finished or is not this session''s (its session ended, and it may have been taken over); 42704 for an unknown id (its TABLE field says runs).';

-- Lets go of a finished run's slot key at commit, in the runner's session: deferred, so that a
-- finish_run whose transaction rolls back leaves the slot held by its live runner (0015).
CREATE FUNCTION pglockkit._release_finished_run() RETURNS trigger
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NEW.holder_pid = pg_backend_pid() THEN  -- finish_run checked that this session holds the key
        PERFORM pg_advisory_unlock(pglockkit._run_key(NEW.job, NEW.slot));
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pglockkit._release_finished_run() IS
    'Private: trigger runs_release_slot, at the commit of a finish_run: the runner''s session lets go of the slot''s key.';

CREATE CONSTRAINT TRIGGER runs_release_slot
    AFTER UPDATE OF status ON pglockkit.runs
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (OLD.status = 'running' AND NEW.status <> 'running')
    EXECUTE FUNCTION pglockkit._release_finished_run();

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
    IF older_than < interval '0' THEN
        RAISE EXCEPTION 'older_than must not be negative, got %', older_than USING ERRCODE = 'invalid_parameter_value';
    END IF;
    BEGIN
        v_before := pg_catalog.clock_timestamp() - older_than;
    EXCEPTION WHEN datetime_field_overflow THEN
        RETURN 0;  -- before the calendar starts: nothing is that old
    END;
    DELETE FROM pglockkit.runs r
     WHERE r.status IN ('succeeded', 'failed') AND r.finished_at < v_before;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit.prune_runs(interval) IS
    'Deletes runs that finished (succeeded or failed) more than older_than ago; returns how many. Running and abandoned runs stay. A pruned slot''s row was its backstop: start_run can run that slot again, so prune only slots no pod can still start (for daily slots, e.g. prune_runs(''30 days'')).';

CREATE VIEW pglockkit.run_history AS
SELECT r.id, r.job, r.slot, r.holder,
       CASE WHEN r.status OPERATOR(pg_catalog.=) 'running'
                 AND NOT pglockkit._advisory_held(pglockkit._run_key(r.job, r.slot), false)
            THEN 'abandoned' ELSE r.status END AS status,
       r.attempt, r.started_at, r.finished_at,
       coalesce(r.finished_at, pg_catalog.clock_timestamp()) OPERATOR(pg_catalog.-) r.started_at AS duration,
       r.detail, r.holder_pid
  FROM pglockkit.runs r;
COMMENT ON VIEW pglockkit.run_history IS
    'Every singleton run with its outcome and duration. status ''abandoned'': still marked running but its holder''s session is gone; the next start_run of that slot re-runs it.';

-- ==== sql/schema/05_jobs.sql ====

-- Jobs: the queue
--
-- The current definition of each object, once. A change edits this file and adds a delta
-- migration (see CONTRIBUTING.md); a test checks that both build the same schema.

CREATE SEQUENCE pglockkit.job_tokens AS bigint NO CYCLE;
COMMENT ON SEQUENCE pglockkit.job_tokens IS 'Fencing tokens of job claims: one per claim, never reused.';

CREATE TABLE pglockkit.jobs (
    id                bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue             text        NOT NULL CHECK (queue OPERATOR(pg_catalog.<>) ''),
    payload           jsonb       NOT NULL DEFAULT '{}',
    priority          integer     NOT NULL DEFAULT 0,
    run_at            timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    status            text        NOT NULL DEFAULT 'queued'
                                  CHECK (status IN ('queued', 'running', 'done', 'dead', 'cancelled')),
    attempt           integer     NOT NULL DEFAULT 0,
    max_attempts      integer     NOT NULL DEFAULT 5 CHECK (max_attempts BETWEEN 1 AND 1000),
    worker            text,
    token             bigint,
    lease_expires_at  timestamptz,
    dedup_key         text,
    concurrency_key   text        CHECK (concurrency_key OPERATOR(pg_catalog.<>) ''),
    concurrency_limit integer     CHECK (concurrency_limit BETWEEN 1 AND 10000),
    last_error        text,
    created_at        timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    started_at        timestamptz,
    finished_at       timestamptz,
    rate_key          text,
    CHECK ((concurrency_key IS NULL) = (concurrency_limit IS NULL)),
    CONSTRAINT jobs_queue_length CHECK (pg_catalog.octet_length(queue) OPERATOR(pg_catalog.<=) 1024),
    CONSTRAINT jobs_dedup_key_length CHECK (pg_catalog.octet_length(dedup_key) OPERATOR(pg_catalog.<=) 1024),
    CONSTRAINT jobs_concurrency_key_length CHECK (pg_catalog.octet_length(concurrency_key) OPERATOR(pg_catalog.<=) 1024)
    -- rate_key (non-empty, at most 1024 bytes) is checked by enqueue_job and enqueue_jobs, its only
    -- writers, not by a constraint: every claim and completion updates the row and would evaluate
    -- it again, while the enqueue checks it once.
);
COMMENT ON TABLE pglockkit.jobs IS
    'The job queue. Write it through enqueue_job / claim_job / complete_job / fail_job / extend_job / release_job / cancel_job; read pglockkit.queue_stats.';

-- The claim path: due jobs in priority order, and expired leases. Both partial, so done, dead
-- and cancelled jobs (however many) are not in them.
CREATE INDEX jobs_ready ON pglockkit.jobs (queue, priority DESC, run_at, id) WHERE status = 'queued';

-- Dedup keys are unique among unfinished jobs of a queue.
CREATE UNIQUE INDEX jobs_dedup ON pglockkit.jobs (queue, dedup_key)
    WHERE dedup_key IS NOT NULL AND status IN ('queued', 'running');

-- Per-key concurrency: how many jobs of each (queue, concurrency key) run now. claim_job raises
-- the count with an upsert whose WHERE re-checks the limit on the newest row version, so two
-- claimers cannot both take the last slot; every way out of 'running' lowers it again.
CREATE TABLE pglockkit.job_keys (
    queue   text    NOT NULL,
    key     text    NOT NULL,
    running integer NOT NULL DEFAULT 0 CHECK (running OPERATOR(pg_catalog.>=) 0),
    lim     integer NOT NULL,
    PRIMARY KEY (queue, key),
    CONSTRAINT job_keys_queue_length CHECK (pg_catalog.octet_length(queue) OPERATOR(pg_catalog.<=) 1024),
    CONSTRAINT job_keys_key_length CHECK (pg_catalog.octet_length(key) OPERATOR(pg_catalog.<=) 1024)
);
COMMENT ON TABLE pglockkit.job_keys IS
    'Running jobs per (queue, concurrency key) and the limit that governed the key''s last claim (the smallest concurrency_limit among its unfinished jobs). Maintained by the queue functions; prune_jobs deletes the rows of keys with no queued or running job.';

-- Per-key rate limits (GCRA, the generic cell rate algorithm): one row per limited (queue, rate
-- key), set by set_rate_limit. tat, the key's theoretical arrival time, is how far ahead of the
-- clock the key's past claims have run: a claim at time t may take n jobs of the key when
-- max(tat, t) + n * step <= t + burst * step, and moves tat to max(tat, t) + n * step. claim_job
-- does this on the row it locked (FOR NO KEY UPDATE SKIP LOCKED) in the statement that claims the
-- jobs, so two claimers cannot both take the last token, and no claimer waits for the row. In any
-- window of length w, a key's claims number at most burst + w / step.
CREATE TABLE pglockkit.job_rates (
    queue text        NOT NULL,
    key   text        NOT NULL,
    rate  integer     NOT NULL CONSTRAINT job_rates_rate_positive CHECK (rate OPERATOR(pg_catalog.>) 0),
    per   interval    NOT NULL,
    burst integer     NOT NULL CONSTRAINT job_rates_burst_range CHECK (burst BETWEEN 1 AND 1000000),
    step  interval    NOT NULL,
    tat   timestamptz NOT NULL,
    PRIMARY KEY (queue, key),
    CONSTRAINT job_rates_queue_length CHECK (pg_catalog.octet_length(queue) OPERATOR(pg_catalog.<=) 1024),
    CONSTRAINT job_rates_key_length CHECK (pg_catalog.octet_length(key) OPERATOR(pg_catalog.<=) 1024)
);
COMMENT ON TABLE pglockkit.job_rates IS
    'Rate limits per (queue, rate key): rate jobs per per, bursts of up to burst; step is per / rate rounded up to a whole microsecond, tat the key''s theoretical arrival time (GCRA). Written by set_rate_limit / remove_rate_limit and claim_job; read pglockkit.rate_limits.';

-- The due jobs of a rate key (rate_limits counts them) and nothing else: jobs without a rate key
-- are not in it.
CREATE INDEX jobs_rate_keys ON pglockkit.jobs (queue, rate_key) WHERE rate_key IS NOT NULL AND status = 'queued';

-- Paused queues: claim_job claims no job of a queue with a row here.
CREATE TABLE pglockkit.paused_queues (
    queue     text        PRIMARY KEY,
    paused_at timestamptz NOT NULL,
    paused_by text        NOT NULL,
    CONSTRAINT paused_queues_queue_length CHECK (pg_catalog.octet_length(queue) OPERATOR(pg_catalog.<=) 1024)
);
COMMENT ON TABLE pglockkit.paused_queues IS
    'The paused queues, with when and by whom (session user). Written by pause_queue / resume_queue; queue_stats shows paused.';

-- Pruning and history.
CREATE INDEX jobs_finished ON pglockkit.jobs (finished_at) WHERE status IN ('done', 'dead', 'cancelled');

CREATE TYPE pglockkit.claimed_job AS (
    id               bigint,
    queue            text,
    payload          jsonb,
    attempt          integer,
    max_attempts     integer,
    token            bigint,
    lease_expires_at timestamptz,
    concurrency_key  text
);
COMMENT ON TYPE pglockkit.claimed_job IS
    'A job handed out by claim_job: pass id and token to complete_job / fail_job / extend_job / release_job. concurrency_key is the job''s (NULL if none): a transaction that records outcomes of keyed jobs in several statements orders them by (queue, concurrency_key) COLLATE "C", the order the queue functions lock key rows in.';

CREATE INDEX jobs_leases ON pglockkit.jobs (queue, lease_expires_at) WHERE lease_expires_at IS NOT NULL;

-- The smallest limit among a key's unfinished jobs, and whether a key has any: one index probe.
CREATE INDEX jobs_keys ON pglockkit.jobs (queue, concurrency_key, concurrency_limit)
    WHERE concurrency_key IS NOT NULL AND status IN ('queued', 'running');

CREATE TABLE pglockkit.config (
    singleton         boolean PRIMARY KEY DEFAULT true CONSTRAINT config_one_row CHECK (singleton),
    max_payload_bytes integer NOT NULL DEFAULT 1048576
                      CONSTRAINT config_max_payload_bytes_range CHECK (max_payload_bytes BETWEEN 4096 AND 268435455)
);
COMMENT ON TABLE pglockkit.config IS
    'pglockkit''s settings: one row. Change them with the set_* functions (pglockkit_admin); read them in pglockkit.settings.';

INSERT INTO pglockkit.config DEFAULT VALUES;

-- Constants of the queue live here, once.
CREATE FUNCTION pglockkit._longest_job_lease() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN interval '7 days';
COMMENT ON FUNCTION pglockkit._longest_job_lease() IS
    'Private: the longest job lease pglockkit accepts, 7 days (a long job extends its lease while it runs).';

CREATE FUNCTION pglockkit._retry_delay(attempt integer) RETURNS interval
LANGUAGE sql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    -- Exponential backoff with "equal jitter": half of 2^(attempt-1) seconds fixed, half random,
    -- capped at one hour, so failing jobs spread out instead of retrying in lockstep.
    SELECT pg_catalog.make_interval(secs =>
        (d / 2) + ((pg_catalog.random() * d) / 2))
      FROM (SELECT LEAST(3600.0, pg_catalog.power(2.0, GREATEST(attempt, 1) - 1))::float8 AS d) s
$$;
COMMENT ON FUNCTION pglockkit._retry_delay(integer) IS
    'Private: the pause before retry n of a failed job: d/2 + random()*d/2 with d = 2^(n-1) s, capped at 1 h.';

CREATE FUNCTION pglockkit._check_queue(queue text) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION 'queue must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF queue = '' THEN
        RAISE EXCEPTION 'queue name must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._check_queue(text) IS 'Private: 22004 for a NULL queue, 22023 for an empty one.';

CREATE FUNCTION pglockkit._check_lease(lease interval) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF lease IS NULL THEN
        RAISE EXCEPTION 'lease must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- Positive in effect too: with calendar months, '-2 mon 61 days' compares as positive but can
    -- move the clock back, a lease expired when it is given (0013). The sum only within range:
    -- '300000 years' would overflow the timestamp (22008) (0015).
    IF lease <= interval '0'
       OR (lease <= pglockkit._longest_job_lease()
           AND pg_catalog.statement_timestamp() + lease <= pg_catalog.statement_timestamp()) THEN
        RAISE EXCEPTION 'lease must be positive, got %', lease USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF lease > pglockkit._longest_job_lease() THEN
        RAISE EXCEPTION 'lease % is out of range', lease USING ERRCODE = 'numeric_value_out_of_range',
            HINT = pg_catalog.format('Leases are at most %s; extend a long job''s lease with extend_job while it runs.',
                                     pglockkit._longest_job_lease());
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._check_lease(interval) IS 'Private: a job lease must be positive and at most 7 days.';

CREATE FUNCTION pglockkit._job_not_found(id bigint) RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Called when an update by (id, token) matched nothing: an unknown id is an error, a known
    -- one means the token is stale or the job is no longer running (false: nothing changed).
    IF id IS NULL THEN
        RAISE EXCEPTION 'job id must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF NOT EXISTS (SELECT FROM pglockkit.jobs j WHERE j.id = _job_not_found.id) THEN
        RAISE EXCEPTION 'no job with id %', id
            USING ERRCODE = 'undefined_object', SCHEMA = 'pglockkit', TABLE = 'jobs';
    END IF;
    RETURN false;
END
$$;
COMMENT ON FUNCTION pglockkit._job_not_found(bigint) IS
    'Private: 42704 for an unknown job id (its TABLE field says jobs), else false (stale token or job not running).';

CREATE FUNCTION pglockkit._keys_left(queues text[], keys text[]) RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    -- Jobs (one array entry each; NULL keys ignored) of these queues and concurrency keys
    -- stopped running. One UPDATE, each key's row once, the rows locked in (queue, key) order
    -- first: two transactions lowering the counts of the same keys wait for each other in one
    -- order, never in a cycle. (Claims do not wait for key rows at all.) The order is bytewise
    -- (COLLATE "C"), whatever the database's collation, so that a client can sort keys the same
    -- way (code points) and record outcomes over several statements in it: the worker does.
    WITH left_keys AS (
        SELECT x.queue, x.key, pg_catalog.count(*)::int AS n
          FROM ROWS FROM (pg_catalog.unnest(queues), pg_catalog.unnest(keys)) AS x(queue, key)
         WHERE x.key IS NOT NULL GROUP BY x.queue, x.key
    ), locked AS (
        SELECT k.queue, k.key, g.n
          FROM pglockkit.job_keys k
          JOIN left_keys g ON k.queue = g.queue AND k.key = g.key
         ORDER BY k.queue COLLATE "C", k.key COLLATE "C"
           FOR NO KEY UPDATE OF k
    )
    UPDATE pglockkit.job_keys k
       SET running = k.running - l.n
      FROM locked l
     WHERE k.queue = l.queue AND k.key = l.key
$$;
COMMENT ON FUNCTION pglockkit._keys_left(text[], text[]) IS
    'Private: lowers the running counts of per-key concurrency when jobs with these (queue, key) pairs leave ''running''; locks the rows in (queue, key) order, bytewise (COLLATE "C").';

CREATE FUNCTION pglockkit._lock_jobs(ids bigint[], tokens bigint[]) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    -- Locks the running jobs of these (id, token) pairs, in id order, waiting for each, before a
    -- caller writes their rows and their keys' rows. A row whose token went stale while this ran
    -- is locked too: PostgreSQL locks the newest version of a row updated since the snapshot
    -- before it rechecks it, and keeps the lock to the end of the transaction. Two transactions
    -- that lock job rows in id order, and key rows (_keys_left) only after them, never wait for
    -- each other in a cycle; in the order of their arrays, a caller whose leases expired while it
    -- ran and the claimer that had reclaimed its jobs each held a row the other waited for.
    PERFORM
       FROM pglockkit.jobs j
       JOIN ROWS FROM (pg_catalog.unnest(ids), pg_catalog.unnest(tokens)) AS c(id, token)
         ON j.id = c.id AND j.token = c.token
      WHERE j.status = 'running'
      ORDER BY j.id
        FOR NO KEY UPDATE OF j;
END
$$;
COMMENT ON FUNCTION pglockkit._lock_jobs(bigint[], bigint[]) IS
    'Private: locks the running jobs of these (id, token) pairs in id order, waiting for each: what complete_jobs does in its one statement, for a worker''s group that records its outcomes in several, so that job rows are always locked in one order and before key rows.';

CREATE FUNCTION pglockkit.enqueue_job(
    queue text, payload jsonb DEFAULT '{}', run_at timestamptz DEFAULT pg_catalog.now(), priority integer DEFAULT 0,
    dedup_key text DEFAULT NULL, max_attempts integer DEFAULT 5,
    concurrency_key text DEFAULT NULL, concurrency_limit integer DEFAULT NULL, rate_key text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_id bigint;
BEGIN
    -- (use_column: the ON CONFLICT target names columns; every parameter below is qualified.)
    PERFORM pglockkit._check_queue(enqueue_job.queue);
    IF enqueue_job.payload IS NULL OR enqueue_job.run_at IS NULL OR enqueue_job.priority IS NULL
       OR enqueue_job.max_attempts IS NULL THEN
        RAISE EXCEPTION 'payload, run_at, priority and max_attempts must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF NOT pg_catalog.isfinite(enqueue_job.run_at) THEN
        RAISE EXCEPTION 'run_at must be a finite time, got %', enqueue_job.run_at USING ERRCODE = 'invalid_parameter_value',
            HINT = 'A job due now takes now(); one that should never run is not enqueued (or is cancelled).';
    END IF;
    -- The payload limit: read only for a payload over its smallest value, or compressed.
    IF pg_catalog.pg_column_size(enqueue_job.payload) > 4096
       OR pg_catalog.pg_column_compression(enqueue_job.payload) IS NOT NULL THEN
        PERFORM pglockkit._check_payloads(ARRAY[enqueue_job.payload]);
    END IF;
    IF enqueue_job.max_attempts NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'max_attempts % is out of range', enqueue_job.max_attempts
            USING ERRCODE = 'numeric_value_out_of_range', HINT = 'max_attempts is 1 to 1000.';
    END IF;
    IF (enqueue_job.concurrency_key IS NULL) <> (enqueue_job.concurrency_limit IS NULL) THEN
        RAISE EXCEPTION 'concurrency_key and concurrency_limit go together' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Pass both (at most concurrency_limit jobs with this key run at once) or neither.';
    END IF;
    IF enqueue_job.concurrency_key = '' THEN
        RAISE EXCEPTION 'concurrency_key must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue_job.concurrency_limit NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'concurrency_limit % is out of range', enqueue_job.concurrency_limit
            USING ERRCODE = 'numeric_value_out_of_range', HINT = 'concurrency_limit is 1 to 10000.';
    END IF;
    IF pg_catalog.octet_length(enqueue_job.rate_key) > 1024 THEN
        RAISE EXCEPTION 'rate_key is % bytes, over 1024', pg_catalog.octet_length(enqueue_job.rate_key)
            USING ERRCODE = 'check_violation', HINT = 'A rate key is at most 1024 bytes, like a queue name.';
    END IF;
    IF enqueue_job.rate_key = '' THEN
        RAISE EXCEPTION 'rate_key must not be empty' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Pass NULL for a job without a rate key.';
    END IF;
    IF enqueue_job.concurrency_key IS NOT NULL THEN
        -- The key's row exists before any job with the key: claim_job's plain path relies on it.
        INSERT INTO pglockkit.job_keys AS k (queue, key, running, lim)
        VALUES (enqueue_job.queue, enqueue_job.concurrency_key, 0, enqueue_job.concurrency_limit)
        ON CONFLICT DO NOTHING;
    END IF;
    LOOP
        INSERT INTO pglockkit.jobs AS j (queue, payload, run_at, priority, dedup_key, max_attempts,
                                         concurrency_key, concurrency_limit, rate_key)
        VALUES (enqueue_job.queue, enqueue_job.payload, enqueue_job.run_at, enqueue_job.priority,
                enqueue_job.dedup_key, enqueue_job.max_attempts, enqueue_job.concurrency_key, enqueue_job.concurrency_limit,
                enqueue_job.rate_key)
        ON CONFLICT (queue, dedup_key) WHERE dedup_key IS NOT NULL AND status IN ('queued', 'running') DO NOTHING
        RETURNING j.id INTO v_id;
        IF v_id IS NOT NULL THEN
            PERFORM pg_catalog.pg_notify('pglockkit_jobs', enqueue_job.queue);
            RETURN v_id;
        END IF;
        -- A pending job has this dedup key: return it. (If it finished in between, insert again.)
        SELECT j.id INTO v_id FROM pglockkit.jobs j
         WHERE j.queue = enqueue_job.queue AND j.dedup_key = enqueue_job.dedup_key
           AND j.status IN ('queued', 'running');
        IF v_id IS NOT NULL THEN
            RETURN v_id;
        END IF;
    END LOOP;
END
$$;
COMMENT ON FUNCTION pglockkit.enqueue_job(text, jsonb, timestamptz, integer, text, integer, text, integer, text) IS
    'Adds a job and returns its id; NOTIFY pglockkit_jobs with the queue name wakes workers. A job is invisible until run_at. Higher priority is claimed first, then earlier run_at, then lower id. With a dedup_key, an unfinished (queued or running) job of the queue with that key is returned instead of a duplicate. With concurrency_key and concurrency_limit, at most that many jobs of the queue with that key run at once (other keys are not held up). With a rate_key, claims of the queue''s jobs with that key follow the key''s rate limit (set_rate_limit; none set: no limit); an empty rate_key is 22023. run_at must be finite (22023); a payload over max_payload_bytes (pglockkit.settings) is refused with 54000.';

CREATE FUNCTION pglockkit.enqueue_jobs(
    queue text, payloads jsonb[], run_at timestamptz DEFAULT pg_catalog.now(), priority integer DEFAULT 0,
    max_attempts integer DEFAULT 5, rate_key text DEFAULT NULL)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_ids bigint[];
BEGIN
    PERFORM pglockkit._check_queue(enqueue_jobs.queue);
    IF payloads IS NULL OR pg_catalog.array_position(payloads, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'payloads must be an array without nulls' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF enqueue_jobs.run_at IS NULL OR enqueue_jobs.priority IS NULL OR enqueue_jobs.max_attempts IS NULL THEN
        RAISE EXCEPTION 'run_at, priority and max_attempts must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF NOT pg_catalog.isfinite(enqueue_jobs.run_at) THEN
        RAISE EXCEPTION 'run_at must be a finite time, got %', enqueue_jobs.run_at USING ERRCODE = 'invalid_parameter_value',
            HINT = 'A job due now takes now(); one that should never run is not enqueued (or is cancelled).';
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.unnest(payloads) AS p(payload)
                WHERE pg_catalog.pg_column_size(p.payload) > 4096
                   OR pg_catalog.pg_column_compression(p.payload) IS NOT NULL) THEN
        PERFORM pglockkit._check_payloads(payloads);
    END IF;
    IF enqueue_jobs.max_attempts NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'max_attempts % is out of range', enqueue_jobs.max_attempts
            USING ERRCODE = 'numeric_value_out_of_range', HINT = 'max_attempts is 1 to 1000.';
    END IF;
    IF pg_catalog.octet_length(enqueue_jobs.rate_key) > 1024 THEN
        RAISE EXCEPTION 'rate_key is % bytes, over 1024', pg_catalog.octet_length(enqueue_jobs.rate_key)
            USING ERRCODE = 'check_violation', HINT = 'A rate key is at most 1024 bytes, like a queue name.';
    END IF;
    IF enqueue_jobs.rate_key = '' THEN
        RAISE EXCEPTION 'rate_key must not be empty' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Pass NULL for jobs without a rate key.';
    END IF;
    WITH inserted AS (
        INSERT INTO pglockkit.jobs (queue, payload, run_at, priority, max_attempts, rate_key)
        SELECT enqueue_jobs.queue, p.payload, enqueue_jobs.run_at, enqueue_jobs.priority, enqueue_jobs.max_attempts,
               enqueue_jobs.rate_key
          FROM pg_catalog.unnest(payloads) WITH ORDINALITY AS p(payload, n)
         ORDER BY p.n
        RETURNING id
    )
    SELECT pg_catalog.array_agg(i.id ORDER BY i.id) INTO v_ids FROM inserted i;
    IF v_ids IS NOT NULL THEN
        PERFORM pg_catalog.pg_notify('pglockkit_jobs', enqueue_jobs.queue);
    END IF;
    RETURN coalesce(v_ids, '{}');
END
$$;
COMMENT ON FUNCTION pglockkit.enqueue_jobs(text, jsonb[], timestamptz, integer, integer, text) IS
    'Adds one job per payload in one statement (ids in payload order) and notifies once; rate_key (optional) is every job''s rate key, as in enqueue_job. run_at must be finite (22023); one payload over max_payload_bytes (pglockkit.settings) refuses the whole batch (54000).';

CREATE FUNCTION pglockkit._take_rate_token(queue text, key text, t timestamptz) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_spent boolean;
BEGIN
    -- claim_job's single-job paths call this for the one job with a rate key they are about to
    -- claim, last among its conditions (a function costs more than a column test, so the planner
    -- orders it last), after the checks that gate the statement: it takes a token only for a job
    -- that is then claimed in the same statement. The key's row is locked SKIP LOCKED (a row
    -- another claimer holds: false, and the job is left to claim_job's other paths) and tat is
    -- re-checked on the row locked, its newest version. A key without a limit: true. (A function
    -- and not a NOT EXISTS in the claim itself: in the claim's generic plan that became a hashed
    -- subplan, set up at every claim, jobs without a rate key too; measured a few percent of
    -- claim + complete.)
    WITH locked AS (
        SELECT q.key FROM pglockkit.job_rates q
         WHERE q.queue = _take_rate_token.queue AND q.key = _take_rate_token.key
           AND q.tat <= _take_rate_token.t + q.step * (q.burst - 1)
           FOR NO KEY UPDATE SKIP LOCKED
    ), spent AS (
        UPDATE pglockkit.job_rates q
           SET tat = GREATEST(q.tat, _take_rate_token.t) + q.step
          FROM locked l
         WHERE q.queue = _take_rate_token.queue AND q.key = l.key
        RETURNING q.key
    )
    SELECT EXISTS (SELECT FROM spent) INTO v_spent;
    RETURN v_spent OR NOT EXISTS (SELECT FROM pglockkit.job_rates q
                                   WHERE q.queue = _take_rate_token.queue AND q.key = _take_rate_token.key);
END
$$;
COMMENT ON FUNCTION pglockkit._take_rate_token(text, text, timestamptz) IS
    'Private: takes one token of a rate-limited key for a claim at time t (GCRA: tat moves to max(tat, t) + step) if the key has one now and its row is not held by another transaction; true if taken, or if the key has no limit. Never waits.';

CREATE FUNCTION pglockkit.claim_job(
    queue text, worker text, lease interval DEFAULT '5 minutes', batch integer DEFAULT 1)
RETURNS SETOF pglockkit.claimed_job
LANGUAGE plpgsql VOLATILE SECURITY DEFINER ROWS 1
SET search_path = pg_catalog, pg_temp
SET enable_bitmapscan = off
SET enable_seqscan = off
-- A generic plan, made once per session: under the default (auto) mode PL/pgSQL re-planned this
-- multi-CTE statement at every call, which cost more than executing it (measured: claim+complete
-- 0.46 -> 0.74 of the bare statements).
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := pg_catalog.clock_timestamp();
    v_keyed   boolean;
    v_expired boolean;
    v_job     pglockkit.claimed_job;
    v_found   boolean;
    v_held    boolean;
    v_pause   float8;
    v_rated   boolean;
    v_paused  boolean;
BEGIN
    -- (use_column: ON CONFLICT (queue, key) names columns; every parameter below is qualified.)
    -- The argument checks, as one expression when the arguments are good (each IF is an
    -- expression evaluation of its own); the statements inside say which one is bad.
    IF claim_job.queue IS NULL OR claim_job.queue = ''
       OR claim_job.lease IS NULL OR claim_job.lease <= interval '0'
       OR claim_job.lease > pglockkit._longest_job_lease()  -- before the sum, which it keeps in range
       OR v_now + claim_job.lease <= v_now
       OR claim_job.worker IS NULL OR claim_job.batch IS NULL OR claim_job.worker = ''
       OR claim_job.batch NOT BETWEEN 1 AND 1000 THEN
        IF claim_job.queue IS NULL THEN
            RAISE EXCEPTION 'queue must not be null' USING ERRCODE = 'null_value_not_allowed';
        END IF;
        IF claim_job.queue = '' THEN
            RAISE EXCEPTION 'queue name must not be empty' USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF claim_job.lease IS NULL THEN
            RAISE EXCEPTION 'lease must not be null' USING ERRCODE = 'null_value_not_allowed';
        END IF;
        PERFORM pglockkit._check_lease(claim_job.lease);
        IF claim_job.worker IS NULL OR claim_job.batch IS NULL THEN
            RAISE EXCEPTION 'worker and batch must not be null' USING ERRCODE = 'null_value_not_allowed';
        END IF;
        IF claim_job.worker = '' THEN
            RAISE EXCEPTION 'worker must not be empty' USING ERRCODE = 'invalid_parameter_value',
                HINT = 'Name the worker (e.g. host:pid) so that a stuck job says who had it.';
        END IF;
        IF claim_job.batch NOT BETWEEN 1 AND 1000 THEN
            RAISE EXCEPTION 'batch % is out of range', claim_job.batch
                USING ERRCODE = 'invalid_parameter_value', HINT = 'batch is 1 to 1000.';
        END IF;
    END IF;

    -- The common case first, as the bare statement. Batch 1, the usual worker loop: claim the
    -- first due job in claim order if it has no concurrency key and the queue has no expired lease
    -- (checked inside the statement, before any row is locked: the planner makes it a one-time
    -- filter). A keyed first job is locked but not claimed here, and the keyed path below runs
    -- (the lock lasts until the caller's transaction ends, at once for an autocommit claim; other
    -- claimers skip that job meanwhile). For one job this is what that path would pick, without
    -- its per-key bookkeeping, whether or not the queue has other keyed jobs. A job with a rate
    -- key: claimed here if _take_rate_token finds the key without a limit or takes one of its
    -- tokens in this statement (a call for such jobs only: a job without a rate key costs one
    -- column test); otherwise left to the keyed path. A paused queue: a one-time filter too.
    IF claim_job.batch = 1
       AND pg_catalog.current_setting('server_version_num')::integer >= 180000 THEN
        -- PostgreSQL 18 and later: the scan in claim order is the bare statement's. Its btree skip
        -- scan jumps over the entries of jobs_ready that are scheduled for later (run_at is an index
        -- condition under the skipped priority column), so the walk over priorities below is not
        -- needed, and cost a third of this function's own time. Checked at each call, not at
        -- install, so that a pg_upgrade to 18 takes this branch without a migration.
        RETURN QUERY
        UPDATE pglockkit.jobs j
           SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
               token = pg_catalog.nextval('pglockkit.job_tokens'), lease_expires_at = v_now + claim_job.lease,
               started_at = v_now
         WHERE j.id = (
               SELECT r.id
                 FROM pglockkit.jobs r
                WHERE r.queue = claim_job.queue AND r.status = 'queued'
                  AND r.run_at <= v_now
                ORDER BY r.priority DESC, r.run_at, r.id
                LIMIT 1
                  FOR UPDATE SKIP LOCKED)
           AND j.concurrency_key IS NULL
           AND (j.rate_key IS NULL OR pglockkit._take_rate_token(claim_job.queue, j.rate_key, v_now))
           AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                            WHERE e.queue = claim_job.queue AND e.lease_expires_at <= v_now)
           AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
        RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key;
    ELSIF claim_job.batch = 1 THEN
        -- Before 18, first the queue's highest priority alone (one probe finds it): the common
        -- case, a queue whose top priority has a due job, costs two index probes and no walk.
        RETURN QUERY
        UPDATE pglockkit.jobs j
           SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
               token = pg_catalog.nextval('pglockkit.job_tokens'), lease_expires_at = v_now + claim_job.lease,
               started_at = v_now
         WHERE j.id = (
               SELECT r.id
                 FROM pglockkit.jobs r
                WHERE r.queue = claim_job.queue AND r.status = 'queued'
                  AND r.priority = (
                      SELECT t.priority FROM pglockkit.jobs t
                       WHERE t.queue = claim_job.queue AND t.status = 'queued'
                       ORDER BY t.priority DESC LIMIT 1)
                  AND r.run_at <= v_now
                ORDER BY r.run_at, r.id
                LIMIT 1
                  FOR UPDATE SKIP LOCKED)
           AND j.concurrency_key IS NULL
           AND (j.rate_key IS NULL OR pglockkit._take_rate_token(claim_job.queue, j.rate_key, v_now))
           AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                            WHERE e.queue = claim_job.queue AND e.lease_expires_at <= v_now)
           AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
        RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key;
        IF NOT FOUND THEN
            -- The top priority has no due job free (or its first is keyed): walk the priorities.
            -- (Batches walk on every version: the walk's cost is shared by the batch.)
            RETURN QUERY
            WITH RECURSIVE
            -- The queue's priorities with queued jobs, highest first, one index probe each. Joined
            -- laterally to each priority's due jobs (run_at, id order) under a LIMIT, the rows come in
            -- claim order: the recursive union yields the priorities in the order it finds them, and
            -- the nested loop keeps that order (it cannot be another join: the subquery is lateral).
            priorities(priority) AS (
                (SELECT r.priority FROM pglockkit.jobs r
                  WHERE r.queue = claim_job.queue AND r.status = 'queued'
                  ORDER BY r.priority DESC LIMIT 1)
                UNION ALL
                SELECT (SELECT r.priority FROM pglockkit.jobs r
                         WHERE r.queue = claim_job.queue AND r.status = 'queued'
                           AND r.priority < p.priority
                         ORDER BY r.priority DESC LIMIT 1)
                  FROM priorities p WHERE p.priority IS NOT NULL
            )
            UPDATE pglockkit.jobs j
               SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                   token = pg_catalog.nextval('pglockkit.job_tokens'), lease_expires_at = v_now + claim_job.lease,
                   started_at = v_now
             WHERE j.id = (
                   SELECT x.id
                     FROM priorities p CROSS JOIN LATERAL (
                          SELECT r.id
                            FROM pglockkit.jobs r
                           WHERE r.queue = claim_job.queue AND r.status = 'queued'
                             AND r.priority = p.priority AND r.run_at <= v_now
                           ORDER BY r.run_at, r.id
                           LIMIT 1
                             FOR UPDATE SKIP LOCKED) x
                    LIMIT 1)
               AND j.concurrency_key IS NULL
               AND (j.rate_key IS NULL OR pglockkit._take_rate_token(claim_job.queue, j.rate_key, v_now))
               AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                                WHERE e.queue = claim_job.queue AND e.lease_expires_at <= v_now)
               AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
            RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key;
        END IF;
    ELSE
        -- A batch: the first due jobs in claim order, if the queue has no concurrency keys (no key
        -- row: no queued or running job of it has a key, or had one since prune_jobs last ran;
        -- the enqueue creates the key's row first), no rate limit, no expired lease and is not
        -- paused, then sorted into claim order.
        RETURN QUERY
        WITH RECURSIVE
        -- The queue's priorities with queued jobs, highest first, one index probe each.
        priorities(priority) AS (
            (SELECT r.priority FROM pglockkit.jobs r
              WHERE r.queue = claim_job.queue AND r.status = 'queued'
              ORDER BY r.priority DESC LIMIT 1)
            UNION ALL
            SELECT (SELECT r.priority FROM pglockkit.jobs r
                     WHERE r.queue = claim_job.queue AND r.status = 'queued'
                       AND r.priority < p.priority
                     ORDER BY r.priority DESC LIMIT 1)
              FROM priorities p WHERE p.priority IS NOT NULL
        ), claimed AS (
            UPDATE pglockkit.jobs j
               SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                   token = pg_catalog.nextval('pglockkit.job_tokens'), lease_expires_at = v_now + claim_job.lease,
                   started_at = v_now
             WHERE j.id = ANY (ARRAY(
                   SELECT x.id
                     FROM priorities p CROSS JOIN LATERAL (
                          SELECT r.id
                            FROM pglockkit.jobs r
                           WHERE r.queue = claim_job.queue AND r.status = 'queued'
                             AND r.priority = p.priority AND r.run_at <= v_now
                             AND r.concurrency_key IS NULL
                           ORDER BY r.run_at, r.id
                           LIMIT claim_job.batch
                             FOR UPDATE SKIP LOCKED) x
                    LIMIT claim_job.batch))
               AND NOT EXISTS (SELECT FROM pglockkit.job_keys k WHERE k.queue = claim_job.queue)
               AND NOT EXISTS (SELECT FROM pglockkit.job_rates q WHERE q.queue = claim_job.queue)
               AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                                WHERE e.queue = claim_job.queue AND e.lease_expires_at <= v_now)
               AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
            RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key, j.priority, j.run_at
        )
        SELECT c.id, c.queue, c.payload, c.attempt, c.max_attempts, c.token, c.lease_expires_at, c.concurrency_key
          FROM claimed c
         ORDER BY c.priority DESC, c.run_at, c.id;
    END IF;
    IF FOUND THEN
        RETURN;
    END IF;

    -- Nothing claimed: no job was due, or the queue has keys, rate limits or expired leases, or
    -- is paused. Which one? (Separate statements, so separate snapshots under READ COMMITTED: a
    -- lease found expired only now, or a key added only now, is handled here or by the next claim.
    -- A pause committed only now is seen by every statement below as well: each checks it.)
    SELECT EXISTS (SELECT FROM pglockkit.job_keys k WHERE k.queue = claim_job.queue),
           EXISTS (SELECT FROM pglockkit.jobs j
                    WHERE j.queue = claim_job.queue AND j.lease_expires_at <= v_now),
           EXISTS (SELECT FROM pglockkit.job_rates q WHERE q.queue = claim_job.queue),
           EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
      INTO v_keyed, v_expired, v_rated, v_paused;
    IF v_paused OR (NOT v_keyed AND NOT v_rated AND NOT v_expired) THEN
        RETURN;  -- paused, or no job due (or every due job is being claimed by someone else)
    END IF;

    IF NOT v_keyed AND NOT v_rated THEN
        -- No key of this queue has a row (every queued or running keyed job's key has one: the
        -- enqueue creates it first, and prune_jobs deletes only the rows of keys without such
        -- jobs), and it has no rate limit, but leases expired: reclaim them first, without the
        -- per-key bookkeeping. Keyed jobs are excluded anyway, should one be committed meanwhile.
        RETURN QUERY
        WITH RECURSIVE
        -- The queue's priorities with queued jobs, highest first, one index probe each (none if
        -- the queue is paused).
        priorities(priority) AS (
            (SELECT r.priority FROM pglockkit.jobs r
              WHERE r.queue = claim_job.queue AND r.status = 'queued'
                AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
              ORDER BY r.priority DESC LIMIT 1)
            UNION ALL
            SELECT (SELECT r.priority FROM pglockkit.jobs r
                     WHERE r.queue = claim_job.queue AND r.status = 'queued'
                       AND r.priority < p.priority
                     ORDER BY r.priority DESC LIMIT 1)
              FROM priorities p WHERE p.priority IS NOT NULL
        ), expired AS (
            SELECT j.id, j.attempt >= j.max_attempts AS exhausted
              FROM pglockkit.jobs j
             WHERE j.queue = claim_job.queue AND j.status = 'running'
               AND j.lease_expires_at <= v_now
               AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
             ORDER BY j.lease_expires_at
             LIMIT claim_job.batch
               FOR UPDATE SKIP LOCKED
        ), buried AS (
            UPDATE pglockkit.jobs j
               SET status = 'dead', last_error = 'lease expired', finished_at = v_now, lease_expires_at = NULL
              FROM expired e
             WHERE j.id = e.id AND e.exhausted
        ), ready AS (
            SELECT x.id
              FROM priorities p CROSS JOIN LATERAL (
                   SELECT r.id
                     FROM pglockkit.jobs r
                    WHERE r.queue = claim_job.queue AND r.status = 'queued'
                      AND r.priority = p.priority AND r.run_at <= v_now
                      AND r.concurrency_key IS NULL
                    ORDER BY r.run_at, r.id
                    LIMIT claim_job.batch
                      FOR UPDATE SKIP LOCKED) x
             LIMIT claim_job.batch
        ), picked AS (
            SELECT c.id FROM (SELECT e.id, 0 AS rank FROM expired e WHERE NOT e.exhausted
                              UNION ALL SELECT r.id, 1 AS rank FROM ready r) c
             ORDER BY c.rank
             LIMIT claim_job.batch
        ), claimed AS (
            UPDATE pglockkit.jobs j
               SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                   token = pg_catalog.nextval('pglockkit.job_tokens'), lease_expires_at = v_now + claim_job.lease,
                   started_at = v_now
             WHERE j.id = ANY (ARRAY(SELECT p.id FROM picked p))
            RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key, j.priority, j.run_at
        )
        SELECT c.id, c.queue, c.payload, c.attempt, c.max_attempts, c.token, c.lease_expires_at, c.concurrency_key
          FROM claimed c
         ORDER BY c.priority DESC, c.run_at, c.id;
        RETURN;
    END IF;

    -- One statement: expired leases first (their workers died or hung; a reclaim counts as an
    -- attempt, and on the last attempt the job goes dead), then due jobs in priority order.
    -- SKIP LOCKED: a row another claimer holds is skipped, never waited for.
    --
    -- Per-key concurrency: a job of a key starts only while the key's running jobs are fewer than
    -- the smallest concurrency_limit among the key's unfinished (queued or running) jobs, its
    -- limit (one probe of jobs_keys). Due jobs whose key is at its limit (by this statement's
    -- snapshot) are passed over. Then the rows of the keys this claim may change are locked in key
    -- order, SKIP LOCKED: a key whose row another transaction holds (a claim or a completion of
    -- that key, until it commits) is passed over too, so a claim never waits for a lock and can
    -- be in no deadlock, whatever else its transaction holds. Within the batch at most
    -- limit - running jobs per key are kept, running read from the locked row. A key with a job
    -- buried here (dead on its last attempt's expiry) is not claimed in the same call, so that
    -- each key's row changes at most once per statement; a job whose key's row is held is not
    -- buried now, the next claim does it. A key with no row at all (deleted by hand) gets one.
    --
    -- Per-key rate limits (job_rates, GCRA): due jobs whose rate key has no token by this
    -- statement's snapshot are passed over; the rows of the limited rate keys among the
    -- candidates are locked in key order, SKIP LOCKED, and each key gives at most the tokens its
    -- locked row allows, in claim order (reclaims of expired leases count too, a claim is a claim);
    -- its tat then moves by one step per job taken, in this statement. A limited key whose row
    -- another claimer holds is passed over. Rate limits are applied first, then the concurrency
    -- limits to the jobs within their rate; a job is claimed only within both. A rate key without
    -- a limit has none. A paused queue claims nothing (its priorities and expired leases are empty).
    -- The statement ends with one row of NULLs if a key was passed over because its row was held.
    -- (The variables of this path are set here, not declared with values: the fast paths above
    -- would pay for that.)
    v_found := false;
    v_pause := 0.001;
    LOOP
        v_held := false;
        FOR v_job IN
        WITH RECURSIVE
        -- The queue's priorities with queued jobs, highest first, one index probe each (none if
        -- the queue is paused).
        priorities(priority) AS (
            (SELECT r.priority FROM pglockkit.jobs r
              WHERE r.queue = claim_job.queue AND r.status = 'queued'
                AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
              ORDER BY r.priority DESC LIMIT 1)
            UNION ALL
            SELECT (SELECT r.priority FROM pglockkit.jobs r
                     WHERE r.queue = claim_job.queue AND r.status = 'queued'
                       AND r.priority < p.priority
                     ORDER BY r.priority DESC LIMIT 1)
              FROM priorities p WHERE p.priority IS NOT NULL
        ), expired AS (
            SELECT j.id, j.attempt >= j.max_attempts AS exhausted, j.concurrency_key, j.rate_key, j.priority, j.run_at
              FROM pglockkit.jobs j
             WHERE j.queue = claim_job.queue AND j.status = 'running'
               AND j.lease_expires_at <= v_now
               AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
             ORDER BY j.lease_expires_at
             LIMIT claim_job.batch
               FOR UPDATE SKIP LOCKED
        ), ready AS (
            SELECT x.id, x.priority, x.run_at, x.concurrency_key, x.concurrency_limit, x.rate_key
              FROM priorities p CROSS JOIN LATERAL (
                   SELECT r.id, r.priority, r.run_at, r.concurrency_key, r.concurrency_limit, r.rate_key
                     FROM pglockkit.jobs r
                    WHERE r.queue = claim_job.queue AND r.status = 'queued'
                      AND r.priority = p.priority AND r.run_at <= v_now
                      AND (r.concurrency_key IS NULL OR NOT EXISTS (
                      SELECT FROM pglockkit.job_keys k
                       WHERE k.queue = claim_job.queue AND k.key = r.concurrency_key
                         AND (k.running >= r.concurrency_limit
                              OR (k.running > 0 AND k.running >= (
                                  SELECT pg_catalog.min(m.concurrency_limit) FROM pglockkit.jobs m
                                   WHERE m.queue = claim_job.queue
                                     AND m.concurrency_key = r.concurrency_key
                                     AND m.status IN ('queued', 'running'))))))
                      -- A rate key without a token now (by this snapshot) is passed over.
                      AND (r.rate_key IS NULL OR NOT EXISTS (
                      SELECT FROM pglockkit.job_rates q
                       WHERE q.queue = claim_job.queue AND q.key = r.rate_key
                         AND q.tat > v_now + q.step * (q.burst - 1)))
                    ORDER BY r.run_at, r.id
                    LIMIT claim_job.batch
                      FOR UPDATE SKIP LOCKED) x
             LIMIT claim_job.batch
        ), keyed AS (
            -- The keys whose rows this claim may change.
            SELECT r.concurrency_key AS key FROM ready r WHERE r.concurrency_key IS NOT NULL
            UNION
            SELECT e.concurrency_key FROM expired e WHERE e.exhausted AND e.concurrency_key IS NOT NULL
        ), locked AS (
            -- Their rows, in key order, but none that another transaction holds: never waits.
            -- running is read from the newest row version (the one locked). (Keys as an array,
            -- here and below: one index probe each, whatever the generic plan's estimates.)
            SELECT k.key, k.running
              FROM pglockkit.job_keys k
             WHERE k.queue = claim_job.queue
               AND k.key = ANY (ARRAY(SELECT y.key FROM keyed y))
             ORDER BY k.key
               FOR NO KEY UPDATE OF k SKIP LOCKED
        ), missing AS (
            -- Keys without a row in this statement's snapshot.
            SELECT y.key FROM keyed y
             WHERE y.key <> ALL (ARRAY(
                   SELECT k.key FROM pglockkit.job_keys k
                    WHERE k.queue = claim_job.queue
                      AND k.key = ANY (ARRAY(SELECT y.key FROM keyed y))))
        ), limits AS (
            SELECT y.key, (SELECT pg_catalog.min(m.concurrency_limit) FROM pglockkit.jobs m
                            WHERE m.queue = claim_job.queue AND m.concurrency_key = y.key
                              AND m.status IN ('queued', 'running')) AS lim
              FROM keyed y
        ), candidates AS (
            -- What this claim may take: reclaims of expired leases (rank 0), then due jobs.
            SELECT e.id, 0 AS rank, e.priority, e.run_at, e.concurrency_key, NULL::integer AS concurrency_limit, e.rate_key
              FROM expired e WHERE NOT e.exhausted
            UNION ALL
            SELECT r.id, 1, r.priority, r.run_at, r.concurrency_key, r.concurrency_limit, r.rate_key FROM ready r
        ), rated AS (
            SELECT DISTINCT c.rate_key AS key FROM candidates c WHERE c.rate_key IS NOT NULL
        ), rate_rows AS (
            -- The rate keys with a limit in this statement's snapshot (a key without one has no limit).
            SELECT q.key FROM pglockkit.job_rates q
             WHERE q.queue = claim_job.queue AND q.key = ANY (ARRAY(SELECT y.key FROM rated y))
        ), rate_locked AS (
            -- Their rows, in key order, but none that another transaction holds (a claim of the
            -- key, until it commits): never waits. The jobs the key may start now, from the newest
            -- row version (the one locked): floor((t + burst * step - max(tat, t)) / step).
            SELECT q.key,
                   GREATEST(pg_catalog.floor(EXTRACT(epoch FROM v_now + q.step * q.burst - GREATEST(q.tat, v_now))
                                             / EXTRACT(epoch FROM q.step)), 0)::integer AS tokens
              FROM pglockkit.job_rates q
             WHERE q.queue = claim_job.queue AND q.key = ANY (ARRAY(SELECT y.key FROM rated y))
             ORDER BY q.key
               FOR NO KEY UPDATE OF q SKIP LOCKED
        ), rate_ok AS (
            -- Candidates within their key's rate: the first tokens of each limited key, in claim
            -- order. A limited key whose row is held has no token for this claim.
            SELECT c.* FROM (
                SELECT c.*, pg_catalog.row_number() OVER (PARTITION BY c.rate_key
                                                         ORDER BY c.rank, c.priority DESC, c.run_at, c.id) AS rate_nth,
                       rr.key IS NOT NULL AS rate_limited, coalesce(rl.tokens, 0) AS tokens
                  FROM candidates c
                  LEFT JOIN rate_rows rr ON rr.key = c.rate_key
                  LEFT JOIN rate_locked rl ON rl.key = c.rate_key) c
             WHERE NOT c.rate_limited OR c.rate_nth <= c.tokens
        ), allowed AS (
            SELECT r.*, pg_catalog.row_number() OVER (ORDER BY r.priority DESC, r.run_at, r.id) AS pos
              FROM (SELECT r.*, pg_catalog.row_number() OVER (PARTITION BY r.concurrency_key
                                                           ORDER BY r.priority DESC, r.run_at, r.id) AS nth,
                           coalesce(l.running, 0) AS running_now, l.key IS NOT NULL AS have_row,
                           m.key IS NOT NULL AS create_row, coalesce(lm.lim, r.concurrency_limit) AS key_limit
                      FROM rate_ok r
                      LEFT JOIN locked l ON l.key = r.concurrency_key
                      LEFT JOIN missing m ON m.key = r.concurrency_key
                      LEFT JOIN limits lm ON lm.key = r.concurrency_key
                     WHERE r.rank = 1) r
             WHERE r.concurrency_key IS NULL
                OR ((r.have_row OR r.create_row)
                    AND r.nth <= (r.key_limit - r.running_now)
                    AND r.concurrency_key NOT IN (SELECT e.concurrency_key FROM expired e
                                                   WHERE e.exhausted AND e.concurrency_key IS NOT NULL))
        ), kept AS (
            SELECT a.* FROM allowed a
             WHERE a.pos <= (claim_job.batch - (SELECT pg_catalog.count(*) FROM rate_ok o WHERE o.rank = 0))
        ), buried AS (
            UPDATE pglockkit.jobs j
               SET status = 'dead', last_error = 'lease expired', finished_at = v_now, lease_expires_at = NULL
              FROM expired e
             WHERE j.id = e.id AND e.exhausted
               AND (e.concurrency_key IS NULL OR e.concurrency_key IN (SELECT l.key FROM locked l)
                    OR e.concurrency_key IN (SELECT m.key FROM missing m))
            RETURNING j.concurrency_key
        ), unbury AS (
            SELECT b.concurrency_key AS key, pg_catalog.count(*)::int AS n
              FROM buried b WHERE b.concurrency_key IS NOT NULL GROUP BY b.concurrency_key
        ), unburied AS (
            -- Rows locked above (or missing): no wait.
            UPDATE pglockkit.job_keys k
               SET running = k.running - b.n
              FROM unbury b
             WHERE k.queue = claim_job.queue
               AND k.key = ANY (ARRAY(SELECT u.key FROM unbury u)) AND k.key = b.key
        ), reserve AS (
            SELECT kk.concurrency_key AS key, pg_catalog.count(*)::int AS n, pg_catalog.min(kk.key_limit) AS lim
              FROM kept kk WHERE kk.have_row GROUP BY kk.concurrency_key
        ), reserved AS (
            -- Rows locked above: no wait. (The re-check of the limit cannot fail; it guards the count.)
            UPDATE pglockkit.job_keys k
               SET running = k.running + g.n, lim = g.lim
              FROM reserve g
             WHERE k.queue = claim_job.queue
               AND k.key = ANY (ARRAY(SELECT r.key FROM reserve r)) AND k.key = g.key
               AND (k.running + g.n) <= g.lim
            RETURNING k.key
        ), created AS (
            INSERT INTO pglockkit.job_keys AS k (queue, key, running, lim)
            SELECT claim_job.queue, kk.concurrency_key, pg_catalog.count(*)::int, pg_catalog.min(kk.key_limit)
              FROM kept kk WHERE kk.create_row GROUP BY kk.concurrency_key ORDER BY kk.concurrency_key
            ON CONFLICT DO NOTHING
            RETURNING k.key
        ), spend AS (
            -- The tokens the kept jobs take, per limited rate key.
            SELECT t.rate_key AS key, pg_catalog.count(*)::int AS n
              FROM (SELECT o.rate_key FROM rate_ok o WHERE o.rank = 0 AND o.rate_limited
                    UNION ALL
                    SELECT kk.rate_key FROM kept kk WHERE kk.rate_limited) t
             GROUP BY t.rate_key
        ), spent AS (
            -- Rows locked above: no wait. At most tokens jobs per key were kept, so tat stays
            -- within t + burst * step.
            UPDATE pglockkit.job_rates q
               SET tat = GREATEST(q.tat, v_now) + q.step * g.n
              FROM spend g
             WHERE q.queue = claim_job.queue
               AND q.key = ANY (ARRAY(SELECT s.key FROM spend s)) AND q.key = g.key
            RETURNING q.key
        ), picked AS (
            SELECT o.id, 0 AS rank, 0::int8 AS pos FROM rate_ok o
             WHERE o.rank = 0 AND (NOT o.rate_limited OR o.rate_key IN (SELECT sp.key FROM spent sp))
            UNION ALL
            SELECT kk.id, 1, kk.pos FROM kept kk
             WHERE (kk.concurrency_key IS NULL
                    OR kk.concurrency_key IN (SELECT rs.key FROM reserved rs UNION ALL SELECT c.key FROM created c))
               AND (NOT kk.rate_limited OR kk.rate_key IN (SELECT sp.key FROM spent sp))
        ), claimed AS (
            UPDATE pglockkit.jobs j
               SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                   token = pg_catalog.nextval('pglockkit.job_tokens'), lease_expires_at = v_now + claim_job.lease,
                   started_at = v_now
             -- = ANY(array), not a join: the row estimates of the CTEs above are rough in a generic
             -- plan, and a join estimated at hundreds of rows turned into a hash join over the table.
             WHERE j.id = ANY (ARRAY(SELECT p.id FROM picked p))
            RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key, j.priority, j.run_at
        )
        (SELECT c.id, c.queue, c.payload, c.attempt, c.max_attempts, c.token, c.lease_expires_at, c.concurrency_key
           FROM claimed c
          ORDER BY c.priority DESC, c.run_at, c.id)
        UNION ALL
        SELECT NULL::bigint, NULL::text, NULL::jsonb, NULL::integer, NULL::integer, NULL::bigint, NULL::timestamptz, NULL::text
         WHERE EXISTS (SELECT FROM ready r
                        WHERE r.concurrency_key IS NOT NULL
                          AND r.concurrency_key NOT IN (SELECT l.key FROM locked l)
                          AND r.concurrency_key NOT IN (SELECT m.key FROM missing m))
            OR EXISTS (SELECT FROM rate_rows rr WHERE rr.key NOT IN (SELECT rl.key FROM rate_locked rl))
        LOOP
            IF v_job.id IS NULL THEN
                v_held := true;
            ELSE
                v_found := true;
                RETURN NEXT v_job;
            END IF;
        END LOOP;
        -- Nothing claimed only because key rows were held (for the moment of someone's commit, as
        -- a rule): try again after 1, 2, 4 and 8 ms rather than send the worker to sleep until its
        -- next poll. Meanwhile this transaction keeps the job rows it locked and did not claim:
        -- other claimers skip them, a completion or cancel of one of them waits (for 15 ms at
        -- most); this claim waits for nothing.
        EXIT WHEN v_found OR NOT v_held OR v_pause > 0.008;
        PERFORM pg_catalog.pg_sleep(v_pause);
        v_pause := v_pause * 2;
        v_now := pg_catalog.clock_timestamp();
    END LOOP;
END
$$;
COMMENT ON FUNCTION pglockkit.claim_job(text, text, interval, integer) IS
    'Claims up to batch (1..1000) jobs of queue for worker, with a lease; never waits for a lock (SKIP LOCKED). Jobs whose lease expired are reclaimed first (counting an attempt; on the last attempt they go dead with "lease expired"), then due jobs by priority (higher first), run_at, id. A job with a concurrency key starts only while the key''s running jobs are fewer than the smallest concurrency_limit among its queued and running jobs; a key whose counter row another transaction holds at that moment is passed over by this claim. A job with a rate key that has a rate limit (set_rate_limit) is claimed only within the key''s rate, in the same statement: jobs over it are passed over, not waited for, and other keys'' jobs are claimed instead. A paused queue (pause_queue) claims nothing. Each row carries a new fencing token for complete_job / fail_job / extend_job / release_job.';

CREATE FUNCTION pglockkit.complete_job(id bigint, token bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_queue text;
    v_key   text;
BEGIN
    UPDATE pglockkit.jobs j
       SET status = 'done', finished_at = pg_catalog.clock_timestamp(), lease_expires_at = NULL
     WHERE j.id = complete_job.id AND j.token = complete_job.token
       AND j.status = 'running'
    RETURNING j.queue, j.concurrency_key INTO v_queue, v_key;
    IF NOT FOUND THEN
        RETURN pglockkit._job_not_found(complete_job.id);
    END IF;
    IF v_key IS NOT NULL THEN
        PERFORM pglockkit._keys_left(ARRAY[v_queue], ARRAY[v_key]);
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.complete_job(bigint, bigint) IS
    'Marks a running job done. True if token is the job''s current claim; false (nothing changed) if the token is stale (the job was reclaimed) or the job is not running; 42704 for an unknown id.';

CREATE FUNCTION pglockkit.complete_jobs(ids bigint[], tokens bigint[]) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_done   integer;
    v_queues text[];
    v_keys   text[];
BEGIN
    IF ids IS NULL OR tokens IS NULL THEN
        RAISE EXCEPTION 'ids and tokens must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF pg_catalog.cardinality(ids) <> pg_catalog.cardinality(tokens) THEN
        RAISE EXCEPTION 'ids and tokens differ in length (% and %)', pg_catalog.cardinality(ids), pg_catalog.cardinality(tokens)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The job rows are locked first, in id order, whatever the order of the arrays. A row whose
    -- token went stale while this statement ran is locked too (its newest version, to the end of
    -- the transaction: PostgreSQL locks a concurrently updated row before it rechecks it), so two
    -- calls that locked in their arrays' orders could each hold a row the other waited for: a
    -- stale caller and the claimer that had reclaimed its jobs deadlocked. Then the key rows, in
    -- key order (_keys_left).
    WITH mine AS (
        SELECT j.id
          FROM pglockkit.jobs j
          JOIN ROWS FROM (pg_catalog.unnest(ids), pg_catalog.unnest(tokens)) AS c(id, token)
            ON j.id = c.id AND j.token = c.token
         WHERE j.status = 'running'
         ORDER BY j.id
           FOR NO KEY UPDATE OF j
    ), done AS (
        UPDATE pglockkit.jobs j
           SET status = 'done', finished_at = pg_catalog.clock_timestamp(), lease_expires_at = NULL
          FROM mine m
         WHERE j.id = m.id
        RETURNING j.queue, j.concurrency_key
    )
    SELECT pg_catalog.count(*)::int, pg_catalog.array_agg(d.queue), pg_catalog.array_agg(d.concurrency_key)
      INTO v_done, v_queues, v_keys
      FROM done d;
    IF v_done > 0 THEN
        PERFORM pglockkit._keys_left(v_queues, v_keys);
    END IF;
    RETURN v_done;
END
$$;
COMMENT ON FUNCTION pglockkit.complete_jobs(bigint[], bigint[]) IS
    'Completes many claimed jobs in one statement (one commit for a whole batch); returns how many (id, token) pairs were current. Stale or unknown pairs are skipped. Locks the job rows in id order, then their keys'' rows in key order.';

CREATE FUNCTION pglockkit.fail_job(id bigint, token bigint, error text, retry_in interval DEFAULT NULL) RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    v_now    timestamptz := pg_catalog.clock_timestamp();
    v_status text;
    v_queue  text;
    v_key    text;
BEGIN
    IF NOT pg_catalog.isfinite(retry_in) THEN  -- infinite intervals exist from PostgreSQL 17 on
        RAISE EXCEPTION 'retry_in must be finite, got %', retry_in USING ERRCODE = 'invalid_parameter_value',
            HINT = 'To stop retrying a job, cancel_job it.';
    END IF;
    IF retry_in IS NOT NULL AND retry_in < interval '0' THEN
        RAISE EXCEPTION 'retry_in must not be negative, got %', retry_in USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE pglockkit.jobs j
       SET status = CASE WHEN j.attempt >= j.max_attempts THEN 'dead' ELSE 'queued' END,
           run_at = CASE WHEN j.attempt >= j.max_attempts THEN j.run_at
                         ELSE v_now + coalesce(retry_in, pglockkit._retry_delay(j.attempt)) END,
           finished_at = CASE WHEN j.attempt >= j.max_attempts THEN v_now END,
           last_error = fail_job.error, lease_expires_at = NULL
     WHERE j.id = fail_job.id AND j.token = fail_job.token
       AND j.status = 'running'
    RETURNING j.status, j.queue, j.concurrency_key INTO v_status, v_queue, v_key;
    IF v_status IS NULL THEN
        PERFORM pglockkit._job_not_found(fail_job.id);
        RETURN 'stale';
    END IF;
    IF v_key IS NOT NULL THEN
        PERFORM pglockkit._keys_left(ARRAY[v_queue], ARRAY[v_key]);
    END IF;
    RETURN v_status;
END
$$;
COMMENT ON FUNCTION pglockkit.fail_job(bigint, bigint, text, interval) IS
    'Records a failed attempt: returns ''queued'' (retried after retry_in, else exponential backoff with jitter), ''dead'' (that was the last attempt; kept for inspection and retry_dead_jobs), or ''stale'' (token not current: nothing changed). retry_in must be finite and not negative (22023).';

CREATE FUNCTION pglockkit.extend_job(id bigint, token bigint, lease interval) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    PERFORM pglockkit._check_lease(extend_job.lease);
    UPDATE pglockkit.jobs j
       SET lease_expires_at = pg_catalog.clock_timestamp() + extend_job.lease
     WHERE j.id = extend_job.id AND j.token = extend_job.token
       AND j.status = 'running';
    RETURN FOUND OR pglockkit._job_not_found(extend_job.id);
END
$$;
COMMENT ON FUNCTION pglockkit.extend_job(bigint, bigint, interval) IS
    'Heartbeat: the job''s lease now ends lease from now. False if the token is stale: stop working on it.';

CREATE FUNCTION pglockkit.release_job(id bigint, token bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_queue text;
    v_key   text;
BEGIN
    UPDATE pglockkit.jobs j
       SET status = 'queued', attempt = j.attempt - 1, lease_expires_at = NULL,
           run_at = LEAST(j.run_at, pg_catalog.clock_timestamp())
     WHERE j.id = release_job.id AND j.token = release_job.token
       AND j.status = 'running'
    RETURNING j.queue, j.concurrency_key INTO v_queue, v_key;
    IF NOT FOUND THEN
        RETURN pglockkit._job_not_found(release_job.id);
    END IF;
    IF v_key IS NOT NULL THEN
        PERFORM pglockkit._keys_left(ARRAY[v_queue], ARRAY[v_key]);
    END IF;
    PERFORM pg_catalog.pg_notify('pglockkit_jobs', v_queue);
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.release_job(bigint, bigint) IS
    'Gives a claimed job back unstarted (a worker shutting down): queued again at once, the attempt not counted. False if the token is stale.';

CREATE FUNCTION pglockkit.cancel_job(id bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_queue text;
    v_key   text;
BEGIN
    WITH old AS (
        SELECT j.id, j.status FROM pglockkit.jobs j
         WHERE j.id = cancel_job.id AND j.status IN ('queued', 'running')
           FOR UPDATE
    )
    UPDATE pglockkit.jobs j
       SET status = 'cancelled', finished_at = pg_catalog.clock_timestamp(), lease_expires_at = NULL
      FROM old
     WHERE j.id = old.id
    RETURNING j.queue, CASE WHEN old.status = 'running' THEN j.concurrency_key END
         INTO v_queue, v_key;
    IF NOT FOUND THEN
        RETURN pglockkit._job_not_found(cancel_job.id);
    END IF;
    IF v_key IS NOT NULL THEN
        PERFORM pglockkit._keys_left(ARRAY[v_queue], ARRAY[v_key]);
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.cancel_job(bigint) IS
    'Cancels a queued or running job (a running job''s worker then gets false from complete_job). False if it had already finished; 42704 for an unknown id.';

-- Queues dead jobs again; its UPDATE, once for all of them and, if a concurrent enqueue took a
-- dedup key meanwhile, once per job. A dead job whose dedup key an unfinished job of the queue has
-- stays dead (dedup keys are unique among unfinished jobs, index jobs_dedup).
CREATE FUNCTION pglockkit._requeue_dead(queue text, ids bigint[])
RETURNS TABLE (n integer, keys text[], limits integer[])
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    WITH requeued AS (
        UPDATE pglockkit.jobs j
           SET status = 'queued', attempt = 0, run_at = pg_catalog.clock_timestamp(), finished_at = NULL, lease_expires_at = NULL
         WHERE j.id = ANY (_requeue_dead.ids) AND j.queue = _requeue_dead.queue AND j.status = 'dead'
           AND (j.dedup_key IS NULL
                OR NOT EXISTS (SELECT FROM pglockkit.jobs p
                                WHERE p.queue = j.queue AND p.dedup_key = j.dedup_key AND p.status IN ('queued', 'running')))
        RETURNING j.concurrency_key, j.concurrency_limit
    )
    SELECT pg_catalog.count(*)::int,
           pg_catalog.array_agg(r.concurrency_key) FILTER (WHERE r.concurrency_key IS NOT NULL),
           pg_catalog.array_agg(r.concurrency_limit) FILTER (WHERE r.concurrency_key IS NOT NULL)
      FROM requeued r
$$;
COMMENT ON FUNCTION pglockkit._requeue_dead(text, bigint[]) IS
    'Private: retry_dead_jobs''s UPDATE of the dead jobs in ids (a dead job whose dedup key an unfinished job has is left dead): how many, and the concurrency keys and limits of those queued again. Runs with its caller''s rights.';

CREATE FUNCTION pglockkit.retry_dead_jobs(queue text, ids bigint[] DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_ids    bigint[];
    v_id     bigint;
    v_one    integer;
    v_n      integer := 0;
    v_keys   text[];
    v_limits integer[];
    v_k      text[];
    v_l      integer[];
BEGIN
    PERFORM pglockkit._check_queue(retry_dead_jobs.queue);
    -- Dedup keys are unique among unfinished jobs, so a key can die more than once (a daily digest
    -- that fails each day): of its dead jobs, the newest is queued again (0014).
    SELECT pg_catalog.array_agg(c.id) INTO v_ids
      FROM (SELECT j.id FROM pglockkit.jobs j
             WHERE j.queue = retry_dead_jobs.queue AND j.status = 'dead' AND j.dedup_key IS NULL
               AND (retry_dead_jobs.ids IS NULL OR j.id = ANY (retry_dead_jobs.ids))
            UNION ALL
            SELECT d.id FROM (SELECT DISTINCT ON (j.dedup_key) j.id FROM pglockkit.jobs j
                               WHERE j.queue = retry_dead_jobs.queue AND j.status = 'dead' AND j.dedup_key IS NOT NULL
                                 AND (retry_dead_jobs.ids IS NULL OR j.id = ANY (retry_dead_jobs.ids))
                               ORDER BY j.dedup_key, j.id DESC) d) c;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    BEGIN
        SELECT r.n, r.keys, r.limits INTO v_n, v_keys, v_limits
          FROM pglockkit._requeue_dead(retry_dead_jobs.queue, v_ids) r;
    EXCEPTION WHEN unique_violation THEN
        -- An enqueue took the dedup key of one of them after the check: one job at a time, each
        -- that meets such an enqueue staying dead.
        v_n := 0;
        FOREACH v_id IN ARRAY v_ids LOOP
            BEGIN
                SELECT r.n, r.keys, r.limits INTO v_one, v_k, v_l
                  FROM pglockkit._requeue_dead(retry_dead_jobs.queue, ARRAY[v_id]) r;
                v_n := v_n + v_one;
                v_keys := v_keys || v_k;
                v_limits := v_limits || v_l;
            EXCEPTION WHEN unique_violation THEN
                NULL;
            END;
        END LOOP;
    END;
    IF v_keys IS NOT NULL THEN
        -- The keys of the jobs queued again keep (or get back) their rows: prune_jobs may have
        -- deleted them while the jobs were dead.
        PERFORM pglockkit._pin_job_key(retry_dead_jobs.queue, g.key, g.lim)
           FROM (SELECT x.key, pg_catalog.min(x.lim) AS lim
                   FROM ROWS FROM (pg_catalog.unnest(v_keys), pg_catalog.unnest(v_limits)) AS x(key, lim)
                  GROUP BY x.key ORDER BY x.key) g;
    END IF;
    IF v_n > 0 THEN
        PERFORM pg_catalog.pg_notify('pglockkit_jobs', retry_dead_jobs.queue);
    END IF;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit.retry_dead_jobs(text, bigint[]) IS
    'Queues dead jobs of a queue again (all, or those in ids) with a fresh set of attempts; returns how many. Of the dead jobs with one dedup key, the newest is queued again, unless an unfinished job of the queue has the key; the others stay dead. last_error is kept until the next failure.';

-- What `pglockkit jobs` lists. No role has privileges on the table; this lets the operators'
-- role read the jobs it may retry or cancel (pglockkit_admin only, like retry_dead_jobs).
CREATE FUNCTION pglockkit.list_jobs(queue text, with_status text DEFAULT NULL, lim integer DEFAULT 50)
RETURNS TABLE (id bigint, status text, priority integer, attempt integer, max_attempts integer,
               run_at timestamptz, worker text, payload jsonb, last_error text, created_at timestamptz,
               finished_at timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pglockkit._check_queue(list_jobs.queue);
    IF list_jobs.with_status IS NOT NULL
       AND list_jobs.with_status <> ALL ('{queued,running,done,dead,cancelled}'::text[]) THEN
        RAISE EXCEPTION 'unknown job status "%"', list_jobs.with_status USING ERRCODE = 'invalid_parameter_value',
            HINT = 'A job is queued, running, done, dead or cancelled.';
    END IF;
    IF list_jobs.lim IS NULL THEN
        RAISE EXCEPTION 'lim must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF list_jobs.lim < 1 THEN
        RAISE EXCEPTION 'lim must be a positive number of jobs, got %', list_jobs.lim
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY
        SELECT j.id, j.status, j.priority, j.attempt, j.max_attempts, j.run_at, j.worker, j.payload,
               j.last_error, j.created_at, j.finished_at
          FROM pglockkit.jobs j
         WHERE j.queue = list_jobs.queue AND (list_jobs.with_status IS NULL OR j.status = list_jobs.with_status)
         ORDER BY j.id DESC
         LIMIT list_jobs.lim;
END
$$;
COMMENT ON FUNCTION pglockkit.list_jobs(text, text, integer) IS
    'A queue''s jobs, newest first, at most lim (with status with_status only, if given): what pglockkit jobs prints. pglockkit_admin only. 22004 for a NULL queue or lim, 22023 for an empty queue, an unknown status or a lim under 1.';

CREATE FUNCTION pglockkit.prune_jobs(older_than interval, queue text DEFAULT NULL, include_dead boolean DEFAULT false)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_n      bigint;
    v_queues text[];
    v_keys   text[];
BEGIN
    IF older_than IS NULL OR include_dead IS NULL THEN
        RAISE EXCEPTION 'older_than and include_dead must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF older_than < interval '0' THEN
        RAISE EXCEPTION 'older_than must not be negative, got %', older_than USING ERRCODE = 'invalid_parameter_value';
    END IF;
    DELETE FROM pglockkit.jobs j
     WHERE j.status IN ('done', 'cancelled', CASE WHEN include_dead THEN 'dead' END)
       AND j.finished_at < (pg_catalog.clock_timestamp() - older_than)
       AND (prune_jobs.queue IS NULL OR j.queue = prune_jobs.queue);
    GET DIAGNOSTICS v_n = ROW_COUNT;

    -- The rows of idle concurrency keys (no queued or running job; each such row also turned the
    -- batch fast path of claim_job off for its queue). First lock them, skipping any row another
    -- transaction holds: a claim or completion of the key, or an enqueue or retry_dead_jobs
    -- adding work to it (they pin the row, see _pin_job_key); never waits.
    SELECT pg_catalog.array_agg(i.queue), pg_catalog.array_agg(i.key) INTO v_queues, v_keys
      FROM (SELECT k.queue, k.key FROM pglockkit.job_keys k
             WHERE (prune_jobs.queue IS NULL OR k.queue = prune_jobs.queue)
               AND k.running = 0
               AND NOT EXISTS (SELECT FROM pglockkit.jobs m
                                WHERE m.queue = k.queue AND m.concurrency_key = k.key
                                  AND m.status IN ('queued', 'running'))
               FOR UPDATE OF k SKIP LOCKED) i;
    -- Then delete those still idle, seen with a snapshot taken after the locks: work added by a
    -- transaction that committed before them is seen here; one still open pinned its row (skipped
    -- above), or will find the row gone and create it again.
    IF v_keys IS NOT NULL THEN
        DELETE FROM pglockkit.job_keys k
         USING ROWS FROM (pg_catalog.unnest(v_queues), pg_catalog.unnest(v_keys)) AS c(queue, key)
         WHERE k.queue = c.queue AND k.key = c.key
           AND k.running = 0
           AND NOT EXISTS (SELECT FROM pglockkit.jobs m
                            WHERE m.queue = k.queue AND m.concurrency_key = k.key
                              AND m.status IN ('queued', 'running'));
    END IF;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit.prune_jobs(interval, text, boolean) IS
    'Deletes done and cancelled jobs (and dead ones with include_dead) that finished more than older_than ago, in one queue or all; returns how many. Also deletes the job_keys rows of concurrency keys with no queued or running job (whatever older_than), which gives a queue whose keys are all idle the claim path of a queue without keys again. Never waits for a claim. Run it from cron, e.g. prune_jobs(''7 days'').';

-- A worker whose claim came back empty while the queue's due jobs wait only for a rate token
-- sleeps until that token, not its whole poll interval (nothing NOTIFYs when a token comes): a key
-- limited to 10 a second ran at one job per poll interval (0016). Keys with a token now are left
-- out: what holds their jobs back is not the rate (a claim of another lane, a concurrency limit).
CREATE FUNCTION pglockkit.next_rate_token(queue text) RETURNS interval
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := pg_catalog.clock_timestamp();
BEGIN
    PERFORM pglockkit._check_queue(next_rate_token.queue);
    IF EXISTS (SELECT FROM pglockkit.paused_queues p WHERE p.queue = next_rate_token.queue) THEN
        RETURN NULL;
    END IF;
    RETURN (SELECT pg_catalog.min(q.tat - q.step * (q.burst - 1)) - v_now
              FROM pglockkit.job_rates q
             WHERE q.queue = next_rate_token.queue
               AND q.tat - q.step * (q.burst - 1) > v_now
               AND EXISTS (SELECT FROM pglockkit.jobs j
                            WHERE j.queue = q.queue AND j.rate_key = q.key
                              AND j.status = 'queued' AND j.run_at <= v_now));
END
$$;
COMMENT ON FUNCTION pglockkit.next_rate_token(text) IS
    'How long until a rate-limited key of queue that has due queued jobs gets its next token (what a worker whose claim came back empty sleeps at most); NULL when no due job waits for a token, or the queue is paused. 22004 for a NULL queue, 22023 for an empty one.';

CREATE FUNCTION pglockkit.set_rate_limit(queue text, key text, rate integer, per interval, burst integer DEFAULT 1)
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now  timestamptz := clock_timestamp();
    v_step interval;
BEGIN
    PERFORM pglockkit._check_queue(set_rate_limit.queue);
    IF set_rate_limit.key IS NULL OR set_rate_limit.rate IS NULL OR set_rate_limit.per IS NULL
       OR set_rate_limit.burst IS NULL THEN
        RAISE EXCEPTION 'key, rate, per and burst must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF set_rate_limit.key = '' THEN
        RAISE EXCEPTION 'rate key must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF set_rate_limit.rate <= 0 THEN
        RAISE EXCEPTION 'rate must be positive, got %', set_rate_limit.rate USING ERRCODE = 'invalid_parameter_value',
            HINT = 'To stop a key''s jobs, pause the queue (pause_queue); to lift the limit, remove_rate_limit.';
    END IF;
    -- Checked by its length in seconds, the measure the step is computed in: compared as an
    -- interval, a month is 30 days and a year 360, so '-1 year +365 days 6 hours' is "positive"
    -- and 0 s long (0011).
    IF NOT isfinite(set_rate_limit.per) OR EXTRACT(epoch FROM set_rate_limit.per) <= 0 THEN
        RAISE EXCEPTION 'per must be a positive finite interval, got %', set_rate_limit.per
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXTRACT(epoch FROM set_rate_limit.per) > 31622400 THEN  -- 366 days
        RAISE EXCEPTION 'per % is out of range', set_rate_limit.per USING ERRCODE = 'numeric_value_out_of_range',
            HINT = 'per is at most 366 days.';
    END IF;
    IF set_rate_limit.burst < 1 THEN
        RAISE EXCEPTION 'burst must be at least 1, got %', set_rate_limit.burst USING ERRCODE = 'invalid_parameter_value',
            HINT = 'burst is how many jobs of the key may start at once; 1 spaces them evenly.';
    END IF;
    IF set_rate_limit.burst > 1000000 THEN
        RAISE EXCEPTION 'burst % is out of range', set_rate_limit.burst USING ERRCODE = 'numeric_value_out_of_range',
            HINT = 'burst is 1 to 1000000.';
    END IF;
    -- The spacing of the key's jobs, rounded up to a whole microsecond (timestamptz's resolution):
    -- the limit is never looser than asked.
    v_step := make_interval(secs => ceil(EXTRACT(epoch FROM set_rate_limit.per) * 1000000 / set_rate_limit.rate) / 1000000);
    IF EXTRACT(epoch FROM v_step) * set_rate_limit.burst > 316224000 THEN
        RAISE EXCEPTION 'a burst of % jobs at % per % is out of range', set_rate_limit.burst, set_rate_limit.rate, set_rate_limit.per
            USING ERRCODE = 'numeric_value_out_of_range',
                  HINT = 'burst * per / rate (the time a full burst takes to come back) is at most 3660 days.';
    END IF;
    -- A new key starts with a full burst; a changed one keeps its place (tat), but owes at most
    -- one full burst of the new limit.
    INSERT INTO pglockkit.job_rates AS q (queue, key, rate, per, burst, step, tat)
    VALUES (set_rate_limit.queue, set_rate_limit.key, set_rate_limit.rate, set_rate_limit.per, set_rate_limit.burst,
            v_step, v_now)
    ON CONFLICT (queue, key) DO UPDATE
       SET rate = EXCLUDED.rate, per = EXCLUDED.per, burst = EXCLUDED.burst, step = EXCLUDED.step,
           tat = LEAST(q.tat, v_now + EXCLUDED.step * EXCLUDED.burst);
    PERFORM pg_notify('pglockkit_jobs', set_rate_limit.queue);
END
$$;
COMMENT ON FUNCTION pglockkit.set_rate_limit(text, text, integer, interval, integer) IS
    'Limits how fast claim_job starts the jobs of queue whose rate_key is key: at most rate per per on average, bursts of up to burst at once (in any window of length w, at most burst + rate * w / per claims; per / rate is rounded up to a whole microsecond). Jobs over the rate are passed over, never waited for. Replaces the key''s limit if it has one. pglockkit_admin only. 22004 for a NULL argument; 22023 for an empty queue or key, rate <= 0, per not positive and finite, burst < 1; 22003 for per over 366 days, burst over 1000000, or burst * per / rate over 3660 days; 23514 for a queue or key over 1024 bytes.';

CREATE FUNCTION pglockkit.remove_rate_limit(queue text, key text) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pglockkit._check_queue(remove_rate_limit.queue);
    IF remove_rate_limit.key IS NULL THEN
        RAISE EXCEPTION 'key must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    DELETE FROM pglockkit.job_rates q WHERE q.queue = remove_rate_limit.queue AND q.key = remove_rate_limit.key;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pg_notify('pglockkit_jobs', remove_rate_limit.queue);
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.remove_rate_limit(text, text) IS
    'Lifts the rate limit of a queue''s rate key: true if it had one, false if not (nothing changed). pglockkit_admin only. 22004 for a NULL queue or key; 22023 for an empty queue.';

CREATE FUNCTION pglockkit.pause_queue(queue text) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pglockkit._check_queue(pause_queue.queue);
    INSERT INTO pglockkit.paused_queues AS p (queue, paused_at, paused_by)
    VALUES (pause_queue.queue, clock_timestamp(), session_user)
    ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION pglockkit.pause_queue(text) IS
    'Pauses a queue: once this commits, claim_job claims none of its jobs (a claim whose statement started before still may). Jobs already running go on, and complete_job / fail_job / extend_job work as before; enqueue_job still adds jobs. True if the queue was running, false if it was paused already. pglockkit_admin only. 22004 for a NULL queue, 22023 for an empty one.';

CREATE FUNCTION pglockkit.resume_queue(queue text) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pglockkit._check_queue(resume_queue.queue);
    DELETE FROM pglockkit.paused_queues p WHERE p.queue = resume_queue.queue;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pg_notify('pglockkit_jobs', resume_queue.queue);  -- wakes the workers
    RETURN true;
END
$$;
COMMENT ON FUNCTION pglockkit.resume_queue(text) IS
    'Resumes a paused queue (NOTIFY pglockkit_jobs wakes its workers): true if it was paused, false if not. pglockkit_admin only. 22004 for a NULL queue, 22023 for an empty one.';

CREATE FUNCTION pglockkit.extend_jobs(ids bigint[], tokens bigint[], lease interval) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    v_n integer;
BEGIN
    IF ids IS NULL OR tokens IS NULL THEN
        RAISE EXCEPTION 'ids and tokens must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF pg_catalog.cardinality(ids) <> pg_catalog.cardinality(tokens) THEN
        RAISE EXCEPTION 'ids and tokens differ in length (% and %)', pg_catalog.cardinality(ids), pg_catalog.cardinality(tokens)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pglockkit._check_lease(extend_jobs.lease);
    WITH mine AS (
        SELECT j.id
          FROM pglockkit.jobs j
          JOIN ROWS FROM (pg_catalog.unnest(ids), pg_catalog.unnest(tokens)) AS c(id, token)
            ON j.id = c.id AND j.token = c.token
         WHERE j.status = 'running'
           FOR NO KEY UPDATE OF j SKIP LOCKED
    )
    UPDATE pglockkit.jobs j
       SET lease_expires_at = pg_catalog.clock_timestamp() + extend_jobs.lease
      FROM mine
     WHERE j.id = mine.id;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit.extend_jobs(bigint[], bigint[], interval) IS
    'Heartbeat for many jobs in one statement: each job whose (id, token) is its current claim and that is running now has its lease end lease from now. Returns how many were extended. Stale or unknown pairs are skipped, and so is a job row locked by another transaction (it is being completed, failed or claimed right now): never waits.';

CREATE FUNCTION pglockkit._pin_job_key(queue text, key text, lim integer) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    -- Work for this key is being added by the calling transaction: keep the key's row until it
    -- commits, so that prune_jobs cannot delete it meanwhile (prune_jobs skips rows it cannot
    -- lock FOR UPDATE). FOR KEY SHARE does not conflict with the claims' FOR NO KEY UPDATE.
    IF _pin_job_key.queue IS NULL OR _pin_job_key.key IS NULL OR _pin_job_key.lim IS NULL THEN
        RAISE EXCEPTION 'queue, key and lim must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    LOOP
        PERFORM FROM pglockkit.job_keys k
          WHERE k.queue = _pin_job_key.queue AND k.key = _pin_job_key.key
            FOR KEY SHARE;
        EXIT WHEN FOUND;
        -- Pruned meanwhile (or never there): create it; ours until commit. If another transaction
        -- created it first, lock that one.
        INSERT INTO pglockkit.job_keys AS k (queue, key, running, lim)
        VALUES (_pin_job_key.queue, _pin_job_key.key, 0, _pin_job_key.lim)
        ON CONFLICT DO NOTHING;
        EXIT WHEN FOUND;
    END LOOP;
END
$$;
COMMENT ON FUNCTION pglockkit._pin_job_key(text, text, integer) IS
    'Private: locks the job_keys row of (queue, key) FOR KEY SHARE until the transaction ends, creating it (running 0, limit lim) if it is gone, so that prune_jobs cannot delete the row of a key the transaction adds work to.';

CREATE FUNCTION pglockkit._pin_job_key_on_insert() RETURNS trigger
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pglockkit._pin_job_key(NEW.queue, NEW.concurrency_key, NEW.concurrency_limit);
    RETURN NEW;
END
$$;
COMMENT ON FUNCTION pglockkit._pin_job_key_on_insert() IS
    'Private: BEFORE INSERT trigger of pglockkit.jobs for keyed jobs: pins the key''s job_keys row (see _pin_job_key).';

CREATE TRIGGER jobs_pin_key BEFORE INSERT ON pglockkit.jobs
    FOR EACH ROW WHEN (NEW.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION pglockkit._pin_job_key_on_insert();

CREATE FUNCTION pglockkit.set_max_payload_bytes(bytes integer) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_old integer;
BEGIN
    IF set_max_payload_bytes.bytes IS NULL THEN
        RAISE EXCEPTION 'bytes must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF set_max_payload_bytes.bytes NOT BETWEEN 4096 AND 268435455 THEN
        RAISE EXCEPTION 'max_payload_bytes % is out of range', set_max_payload_bytes.bytes
            USING ERRCODE = 'numeric_value_out_of_range',
                  HINT = 'max_payload_bytes is 4096 (4 kB) to 268435455 (jsonb''s own maximum, 256 MB).';
    END IF;
    SELECT c.max_payload_bytes INTO v_old FROM pglockkit.config c FOR UPDATE;
    UPDATE pglockkit.config c SET max_payload_bytes = set_max_payload_bytes.bytes;
    RETURN v_old;
END
$$;
COMMENT ON FUNCTION pglockkit.set_max_payload_bytes(integer) IS
    'Sets the largest job payload enqueue_job and enqueue_jobs accept (bytes of the uncompressed jsonb, 4096 to 268435455; default 1048576) and returns the previous limit. pglockkit_admin only. Jobs already queued are kept.';

CREATE FUNCTION pglockkit._check_payloads(payloads jsonb[]) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_limit integer;
    v_n     bigint;
    v_size  integer;
BEGIN
    -- Called (by the enqueue functions, as their owner) only when a payload arrived over 4096
    -- bytes or TOAST-compressed (read from a table): #> '{}' returns the value uncompressed.
    SELECT c.max_payload_bytes INTO v_limit FROM pglockkit.config c;
    SELECT p.n, s.size INTO v_n, v_size
      FROM pg_catalog.unnest(payloads) WITH ORDINALITY AS p(payload, n),
           LATERAL (SELECT pg_catalog.pg_column_size(p.payload #> '{}'::text[]) AS size) s
     WHERE s.size > v_limit
     ORDER BY p.n
     LIMIT 1;
    IF v_n IS NOT NULL THEN
        RAISE EXCEPTION 'job payload%is % bytes, over the limit max_payload_bytes %',
            CASE WHEN pg_catalog.cardinality(payloads) > 1
                 THEN pg_catalog.format(' %s of %s ', v_n, pg_catalog.cardinality(payloads)) ELSE ' ' END,
            v_size, v_limit
            USING ERRCODE = 'program_limit_exceeded',
                  DETAIL = 'The size is pg_column_size of the uncompressed jsonb value. Nothing was enqueued.',
                  HINT = 'Store large data elsewhere and enqueue a reference to it; or pglockkit_admin raises the limit: SELECT pglockkit.set_max_payload_bytes(n);';
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._check_payloads(jsonb[]) IS
    'Private: 54000 naming the first payload over max_payload_bytes (uncompressed jsonb size), with its size and the limit.';

CREATE VIEW pglockkit.queue_stats AS
SELECT coalesce(s.queue, p.queue) AS queue,
       coalesce(s.ready, 0) AS ready, coalesce(s.scheduled, 0) AS scheduled, coalesce(s.running, 0) AS running,
       coalesce(s.expired_leases, 0) AS expired_leases, coalesce(s.done, 0) AS done, coalesce(s.dead, 0) AS dead,
       coalesce(s.cancelled, 0) AS cancelled, s.oldest_ready_age, coalesce(s.done_last_minute, 0) AS done_last_minute,
       p.queue IS NOT NULL AS paused
  FROM (SELECT j.queue,
               pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'queued' AND j.run_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()) AS ready,
               pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'queued' AND j.run_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()) AS scheduled,
               pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'running') AS running,
               pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'running' AND j.lease_expires_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()) AS expired_leases,
               pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'done') AS done,
               pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'dead') AS dead,
               pg_catalog.count(*) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'cancelled') AS cancelled,
               pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-)
                   -- A run_at of -infinity (stored before such times were refused) counts from the job's created_at.
                   pg_catalog.min(CASE WHEN pg_catalog.isfinite(j.run_at) THEN j.run_at ELSE j.created_at END) FILTER (WHERE j.status OPERATOR(pg_catalog.=) 'queued' AND j.run_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()) AS oldest_ready_age,
               pg_catalog.count(*) FILTER (WHERE j.finished_at OPERATOR(pg_catalog.>) (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) interval '1 minute')
                                            AND j.status OPERATOR(pg_catalog.=) 'done') AS done_last_minute
          FROM pglockkit.jobs j
         GROUP BY j.queue) s
  FULL JOIN pglockkit.paused_queues p ON p.queue OPERATOR(pg_catalog.=) s.queue;
COMMENT ON VIEW pglockkit.queue_stats IS
    'Per queue: jobs ready, scheduled for later, running, with expired leases (workers gone), done, dead, cancelled; the age of the oldest ready job (lag: since its run_at, or its created_at for a run_at of -infinity), jobs done in the last minute, and whether the queue is paused (pause_queue; a paused queue without jobs has a row of zeros). Scans the table: for dashboards, not hot paths.';

CREATE VIEW pglockkit.rate_limits AS
SELECT q.queue, q.key, q.rate, q.per, q.burst,
       GREATEST(q.tat OPERATOR(pg_catalog.-) (q.step OPERATOR(pg_catalog.*) (q.burst OPERATOR(pg_catalog.-) 1)), n.t) AS next_allowed_at,
       GREATEST(pg_catalog.floor(EXTRACT(epoch FROM (n.t OPERATOR(pg_catalog.+) (q.step OPERATOR(pg_catalog.*) q.burst))
                                                    OPERATOR(pg_catalog.-) GREATEST(q.tat, n.t))
                                 OPERATOR(pg_catalog./) EXTRACT(epoch FROM q.step)), 0)::integer AS tokens,
       (SELECT pg_catalog.count(*) FROM pglockkit.jobs j
         WHERE j.queue OPERATOR(pg_catalog.=) q.queue AND j.rate_key OPERATOR(pg_catalog.=) q.key
           AND j.status OPERATOR(pg_catalog.=) 'queued' AND j.run_at OPERATOR(pg_catalog.<=) n.t) AS waiting
  FROM pglockkit.job_rates q
 CROSS JOIN (SELECT pg_catalog.clock_timestamp() AS t) n;
COMMENT ON VIEW pglockkit.rate_limits IS
    'One row per rate-limited key of a queue (set_rate_limit): rate jobs per per, burst; next_allowed_at, when claim_job may next start a job of the key (now if it may now); tokens, how many it may start at once now; waiting, the key''s due queued jobs.';

CREATE VIEW pglockkit.settings AS
SELECT 'max_payload_bytes'::text AS name, c.max_payload_bytes::bigint AS value,
       'The largest job payload enqueue_job and enqueue_jobs accept, in bytes of the uncompressed jsonb value (pg_column_size); 54000 above it. Set with set_max_payload_bytes.'::text AS description
  FROM pglockkit.config c;
COMMENT ON VIEW pglockkit.settings IS
    'pglockkit''s settings, one row each: name, value, what it does. Readable by every pglockkit_user; pglockkit_admin changes them with the set_* functions.';

-- ==== sql/schema/06_schedules.sql ====

-- Schedules: cron expressions kept in the database, ticked into the job queue
--
-- The current definition of each object, once. A change edits this file and adds a delta
-- migration (see CONTRIBUTING.md); a test checks that both build the same schema.
--
-- Cron is evaluated here, in SQL, so that every client gets the same slots. The semantics follow
-- croniter (the test oracle): 5 fields, names, ranges, steps, lists; day-of-month and day-of-week
-- are ORed when both are restricted (a field is unrestricted when it covers its whole range, so
-- `*/1` and `0-7` count as `*`, but `*/2` restricts). In a time zone with DST, a slot is an
-- instant whose local time matches: a local time that occurs twice (fall back) gives two slots, one
-- that does not exist (spring forward) gives one slot at the end of the gap (the instant the
-- clocks jump), merged with a slot that falls there anyway.

CREATE TYPE pglockkit.cron_spec AS (
    minutes  integer[],
    hours    integer[],
    days     integer[],
    months   integer[],
    weekdays integer[],
    days_or  boolean
);
COMMENT ON TYPE pglockkit.cron_spec IS
    'A parsed cron expression: the sorted values of each field (weekdays 0-6, Sunday 0) and whether day-of-month and day-of-week are ORed (both restricted). Made by _cron_parse.';

CREATE TABLE pglockkit.job_schedules (
    name         text        PRIMARY KEY CHECK (name OPERATOR(pg_catalog.<>) ''),
    cron         text        NOT NULL,
    spec         pglockkit.cron_spec NOT NULL,
    timezone     text        NOT NULL,
    queue        text        NOT NULL CHECK (queue OPERATOR(pg_catalog.<>) ''),
    payload      jsonb       NOT NULL DEFAULT '{}',
    priority     integer     NOT NULL DEFAULT 0,
    max_attempts integer     NOT NULL DEFAULT 5 CHECK (max_attempts BETWEEN 1 AND 1000),
    catch_up     integer     NOT NULL DEFAULT 1 CHECK (catch_up BETWEEN 1 AND 1000),
    next_run     timestamptz NOT NULL,
    last_run     timestamptz,
    last_job_id  bigint,
    last_error   text,
    created_at   timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    updated_at   timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    CONSTRAINT job_schedules_name_length CHECK (pg_catalog.octet_length(name) OPERATOR(pg_catalog.<=) 1024),
    CONSTRAINT job_schedules_queue_length CHECK (pg_catalog.octet_length(queue) OPERATOR(pg_catalog.<=) 1024)
);
COMMENT ON TABLE pglockkit.job_schedules IS
    'Schedules: a cron expression and the job it enqueues. Write it through schedule / unschedule / tick_schedules; read pglockkit.schedules. next_run is the first slot not yet enqueued.';

-- What tick_schedules reads: the due schedules, an index range however many there are.
CREATE INDEX job_schedules_due ON pglockkit.job_schedules (next_run);

CREATE FUNCTION pglockkit._cron_field(expr text, field text, lo integer, hi integer, names text[] DEFAULT NULL)
RETURNS integer[]
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_item  text;
    v_range text;
    v_ends  text[];
    v_step  integer := 1;
    v_bound integer[];
    v_out   integer[] := '{}';
    -- `*` and `a/n` end here: day-of-week accepts 7 for Sunday, but its whole range is 0-6.
    v_top   integer := CASE WHEN field = 'day-of-week' THEN 6 ELSE hi END;
    v_end   text;
    v_val   integer;
BEGIN
    IF expr = '' THEN
        RAISE EXCEPTION 'cron % field is empty', field USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOREACH v_item IN ARRAY pg_catalog.string_to_array(expr, ',') LOOP
        IF v_item !~ '^([*]|[0-9a-z]+(-[0-9a-z]+)?)(/[0-9]+)?$' THEN
            RAISE EXCEPTION 'cron % field: "%" is not a value, a range or a step', field, v_item
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Each comma-separated item is *, a value, a range a-b, each optionally followed by /step.';
        END IF;
        v_range := pg_catalog.split_part(v_item, '/', 1);
        IF pg_catalog.strpos(v_item, '/') > 0 THEN
            IF pg_catalog.length(pg_catalog.split_part(v_item, '/', 2)) > 4
               OR pg_catalog.split_part(v_item, '/', 2)::integer NOT BETWEEN 1 AND (hi - lo + 1) THEN
                RAISE EXCEPTION 'cron % field: step in "%" is out of range', field, v_item
                    USING ERRCODE = 'invalid_parameter_value',
                          HINT = pg_catalog.format('A %s step is 1 to %s.', field, hi - lo + 1);
            END IF;
            v_step := pg_catalog.split_part(v_item, '/', 2)::integer;
        ELSE
            v_step := 1;
        END IF;
        IF v_range = '*' THEN
            v_bound := ARRAY[lo, v_top];
        ELSE
            v_ends := pg_catalog.string_to_array(v_range, '-');
            v_bound := '{}';
            FOREACH v_end IN ARRAY v_ends LOOP
                IF v_end ~ '^[0-9]+$' THEN
                    v_val := CASE WHEN pg_catalog.length(v_end) > 4 THEN -1 ELSE v_end::integer END;
                ELSE
                    v_val := pg_catalog.array_position(names, pg_catalog.upper(v_end)) + lo - 1;
                    IF v_val IS NULL THEN
                        RAISE EXCEPTION 'cron % field: "%" is not a number or a name', field, v_end
                            USING ERRCODE = 'invalid_parameter_value',
                                  HINT = CASE WHEN names IS NULL THEN pg_catalog.format('A %s is a number.', field)
                                              ELSE pg_catalog.format('Names of the %s field: %s.', field, pg_catalog.array_to_string(names, ', ')) END;
                    END IF;
                END IF;
                IF v_val NOT BETWEEN lo AND hi THEN
                    RAISE EXCEPTION 'cron % field: % is out of range', field, v_end
                        USING ERRCODE = 'invalid_parameter_value',
                              HINT = pg_catalog.format('A %s is %s to %s.', field, lo, hi);
                END IF;
                v_bound := v_bound || v_val;
            END LOOP;
            IF pg_catalog.cardinality(v_bound) = 1 THEN
                -- `a/n` runs from a to the end of the field's range (as croniter does).
                v_bound := v_bound || CASE WHEN v_step > 1 OR pg_catalog.strpos(v_item, '/') > 0 THEN v_top ELSE v_bound[1] END;
            END IF;
            IF v_bound[1] > v_bound[2] THEN
                RAISE EXCEPTION 'cron % field: the range "%" runs backwards', field, v_range
                    USING ERRCODE = 'invalid_parameter_value', HINT = 'Write a range low-high, or a list of two ranges.';
            END IF;
        END IF;
        v_out := v_out || ARRAY(SELECT pg_catalog.generate_series(v_bound[1], v_bound[2], v_step));
    END LOOP;
    IF field = 'day-of-week' THEN
        v_out := ARRAY(SELECT x % 7 FROM pg_catalog.unnest(v_out) x);  -- 7 is Sunday too
    END IF;
    RETURN ARRAY(SELECT DISTINCT x FROM pg_catalog.unnest(v_out) x ORDER BY x);
END
$$;
COMMENT ON FUNCTION pglockkit._cron_field(text, text, integer, integer, text[]) IS
    'Private: the sorted values of one cron field (*, values, names, ranges, steps, lists); 22023 naming the field for anything else.';

CREATE FUNCTION pglockkit._cron_parse(cron text) RETURNS pglockkit.cron_spec
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_expr   text;
    v_fields text[];
    v_spec   pglockkit.cron_spec;
BEGIN
    IF cron IS NULL THEN
        RAISE EXCEPTION 'cron must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF pg_catalog.octet_length(cron) > 1024 THEN
        RAISE EXCEPTION 'cron expression is % bytes, at most 1024', pg_catalog.octet_length(cron)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_expr := pg_catalog.lower(pg_catalog.btrim(cron, E' \t\n\r'));
    v_expr := CASE v_expr
        WHEN '@yearly' THEN '0 0 1 1 *' WHEN '@annually' THEN '0 0 1 1 *'
        WHEN '@monthly' THEN '0 0 1 * *' WHEN '@weekly' THEN '0 0 * * 0'
        WHEN '@daily' THEN '0 0 * * *' WHEN '@midnight' THEN '0 0 * * *'
        WHEN '@hourly' THEN '0 * * * *' ELSE v_expr END;
    v_fields := pg_catalog.regexp_split_to_array(v_expr, '[[:space:]]+');
    IF v_expr = '' OR pg_catalog.cardinality(v_fields) <> 5 THEN
        RAISE EXCEPTION 'cron expression "%" has % fields, not 5', cron, CASE WHEN v_expr = '' THEN 0 ELSE pg_catalog.cardinality(v_fields) END
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'The fields are: minute hour day-of-month month day-of-week, e.g. ''*/15 9-17 * * mon-fri''; or @hourly, @daily, @weekly, @monthly, @yearly.';
    END IF;
    v_spec.minutes  := pglockkit._cron_field(v_fields[1], 'minute', 0, 59);
    v_spec.hours    := pglockkit._cron_field(v_fields[2], 'hour', 0, 23);
    v_spec.days     := pglockkit._cron_field(v_fields[3], 'day-of-month', 1, 31);
    v_spec.months   := pglockkit._cron_field(v_fields[4], 'month', 1, 12,
        '{JAN,FEB,MAR,APR,MAY,JUN,JUL,AUG,SEP,OCT,NOV,DEC}');
    v_spec.weekdays := pglockkit._cron_field(v_fields[5], 'day-of-week', 0, 7,
        '{SUN,MON,TUE,WED,THU,FRI,SAT}');
    -- Restricted means written other than `*` (or a list of `*`s): croniter's reading, so `*/1`
    -- and `0-6` restrict although they name every value.
    v_spec.days_or := v_fields[3] !~ '^[*](,[*])*$' AND v_fields[5] !~ '^[*](,[*])*$';
    -- Days of the month ANDed with every weekday: some listed day must exist in a listed month.
    IF NOT v_spec.days_or AND NOT EXISTS (
        SELECT FROM pg_catalog.unnest(v_spec.days) d, pg_catalog.unnest(v_spec.months) m
         WHERE d <= (ARRAY[31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31])[m]) THEN
        RAISE EXCEPTION 'cron expression "%" never matches: its day-of-month field names no day of its months', cron
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN v_spec;
END
$$;
COMMENT ON FUNCTION pglockkit._cron_parse(text) IS
    'Private: parses a 5-field cron expression (or @hourly, @daily, @midnight, @weekly, @monthly, @yearly, @annually) into a cron_spec; 22004 for NULL, 22023 naming the bad field, or for an expression that never matches.';

CREATE FUNCTION pglockkit._cron_next_local(spec pglockkit.cron_spec, ts timestamp) RETURNS timestamp
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_day    date := ts::date;
    -- The first minute of the day to consider: ts rounded up to a whole minute.
    v_min    integer := pg_catalog.ceil(pg_catalog.date_part('epoch', ts - ts::date) / 60.0)::integer;
    v_dom    integer;
    v_next   integer;
    v_hour   integer;
    v_minute integer;
    v_ok     boolean;
BEGIN
    -- The first local minute at or after ts whose fields all match; no time zone here. A valid
    -- spec matches within 8 years (29 February), so the bound is never reached.
    FOR i IN 1..100000 LOOP
        IF NOT pg_catalog.date_part('month', v_day)::integer = ANY (spec.months) THEN
            v_day := (pg_catalog.date_trunc('month', v_day) + interval '1 month')::date;
            v_min := 0;
            CONTINUE;
        END IF;
        v_dom := pg_catalog.date_part('day', v_day)::integer;
        v_ok := v_dom = ANY (spec.days);
        v_ok := (spec.days_or AND (v_ok OR pg_catalog.date_part('dow', v_day)::integer = ANY (spec.weekdays)))
             OR (NOT spec.days_or AND v_ok AND pg_catalog.date_part('dow', v_day)::integer = ANY (spec.weekdays));
        IF NOT v_ok THEN
            IF NOT spec.days_or AND pg_catalog.cardinality(spec.weekdays) = 7 THEN
                -- Only the day of the month counts: jump to the next listed day, or the next month.
                SELECT pg_catalog.min(d) INTO v_next FROM pg_catalog.unnest(spec.days) d WHERE d > v_dom;
                IF v_next IS NULL OR v_next > pg_catalog.date_part('day',
                        pg_catalog.date_trunc('month', v_day) + interval '1 month - 1 day')::integer THEN
                    v_day := (pg_catalog.date_trunc('month', v_day) + interval '1 month')::date;
                ELSE
                    v_day := v_day + (v_next - v_dom);
                END IF;
            ELSE
                v_day := v_day + 1;
            END IF;
            v_min := 0;
            CONTINUE;
        END IF;
        -- A matching day: the first listed hour and minute at or after v_min.
        v_hour := v_min / 60;
        IF v_hour = ANY (spec.hours) THEN
            SELECT pg_catalog.min(m) INTO v_minute FROM pg_catalog.unnest(spec.minutes) m WHERE m >= v_min % 60;
            IF v_minute IS NOT NULL THEN
                RETURN v_day + pg_catalog.make_time(v_hour, v_minute, 0);
            END IF;
        END IF;
        SELECT pg_catalog.min(h) INTO v_hour FROM pg_catalog.unnest(spec.hours) h WHERE h > v_min / 60;
        IF v_hour IS NOT NULL THEN
            RETURN v_day + pg_catalog.make_time(v_hour, spec.minutes[1], 0);
        END IF;
        v_day := v_day + 1;
        v_min := 0;
    END LOOP;
    RAISE EXCEPTION 'cron spec % matches no time after %', spec, ts USING ERRCODE = 'internal_error';
END
$$;
COMMENT ON FUNCTION pglockkit._cron_next_local(pglockkit.cron_spec, timestamp) IS
    'Private: the first local minute at or after ts that the spec matches (no time zone involved).';

CREATE FUNCTION pglockkit._tz_offset(t timestamptz, tz text) RETURNS interval
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT (t AT TIME ZONE tz) - (t AT TIME ZONE 'UTC') $$;
COMMENT ON FUNCTION pglockkit._tz_offset(timestamptz, text) IS
    'Private: the UTC offset of time zone tz at instant t (local minus UTC).';

CREATE FUNCTION pglockkit._cron_next(spec pglockkit.cron_spec, tz text, after timestamptz) RETURNS timestamptz
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    -- Bigger than any UTC offset change (one hour, or 30 minutes on Lord Howe; two at most since
    -- 1970), and less than half the time between two changes of one zone.
    c_shift constant interval := interval '3 hours';
    v_local timestamp := after AT TIME ZONE tz;
    v_l     timestamp;
    v_c     timestamptz;
    v_c1    timestamptz;
    v_c2    timestamptz;
    v_lo    timestamptz;
    v_hi    timestamptz;
    v_mid   timestamptz;
    v_best  timestamptz;
    v_first timestamp;
    v_cand  timestamptz[];
BEGIN
    -- Fast path: the first matching local minute after local(after), if it exists and no offset
    -- change lies near after or near it (so local order and instant order agree in between).
    v_l := pglockkit._cron_next_local(spec, pg_catalog.date_trunc('minute', v_local) + interval '1 minute');
    v_c := v_l AT TIME ZONE tz;
    IF (v_c AT TIME ZONE tz) = v_l
       AND pglockkit._tz_offset(after, tz) = pglockkit._tz_offset(after + c_shift, tz)
       AND pglockkit._tz_offset(v_c - c_shift, tz) = pglockkit._tz_offset(v_c, tz)
       AND pglockkit._tz_offset(v_c, tz) = pglockkit._tz_offset(v_c + c_shift, tz) THEN
        RETURN v_c;
    END IF;
    -- Near an offset change: every matching local minute from c_shift before local(after) on,
    -- each mapped to its instants (two in a fall-back, none in a gap: then the gap's end), until
    -- c_shift past the first one found after `after`; the earliest instant wins.
    v_l := pglockkit._cron_next_local(spec, pg_catalog.date_trunc('minute', v_local - c_shift));
    LOOP
        EXIT WHEN v_first IS NOT NULL AND v_l > v_first + c_shift;
        v_c := v_l AT TIME ZONE tz;
        v_c1 := (v_l - pglockkit._tz_offset(v_c - c_shift, tz)) AT TIME ZONE 'UTC';  -- with the offset before
        v_c2 := (v_l - pglockkit._tz_offset(v_c + c_shift, tz)) AT TIME ZONE 'UTC';  -- with the offset after
        v_cand := '{}';
        IF (v_c1 AT TIME ZONE tz) = v_l THEN
            v_cand := v_cand || v_c1;
        END IF;
        IF (v_c2 AT TIME ZONE tz) = v_l THEN
            v_cand := v_cand || v_c2;
        END IF;
        IF v_cand = '{}' AND v_c2 < v_c1 THEN
            -- v_l does not exist (clocks jumped over it): the slot is the instant of the jump,
            -- found by bisection between v_c2 (old offset) and v_c1 (new offset), to the second.
            v_lo := v_c2;
            v_hi := v_c1;
            WHILE v_hi - v_lo > interval '1 second' LOOP
                v_mid := v_lo + (v_hi - v_lo) / 2;
                IF pglockkit._tz_offset(v_mid, tz) = pglockkit._tz_offset(v_hi, tz) THEN
                    v_hi := v_mid;
                ELSE
                    v_lo := v_mid;
                END IF;
            END LOOP;
            -- The first whole second already on the new offset (a jump on a whole second, as
            -- every one is, is that second itself).
            v_cand := ARRAY[pg_catalog.date_trunc('second', v_hi)];
            IF pglockkit._tz_offset(v_cand[1], tz) <> pglockkit._tz_offset(v_hi, tz) THEN
                v_cand := ARRAY[v_cand[1] + interval '1 second'];
            END IF;
        END IF;
        FOR i IN 1..pg_catalog.cardinality(v_cand) LOOP
            IF v_cand[i] > after THEN
                v_first := COALESCE(v_first, v_l);
                IF v_best IS NULL OR v_cand[i] < v_best THEN
                    v_best := v_cand[i];
                END IF;
            END IF;
        END LOOP;
        v_l := pglockkit._cron_next_local(spec, v_l + interval '1 minute');
    END LOOP;
    RETURN v_best;
END
$$;
COMMENT ON FUNCTION pglockkit._cron_next(pglockkit.cron_spec, text, timestamptz) IS
    'Private: the first slot of a parsed cron expression strictly after `after`, in time zone tz (DST: see cron_next).';

CREATE FUNCTION pglockkit.cron_next(cron text, after timestamptz DEFAULT pg_catalog.clock_timestamp(), timezone text DEFAULT 'UTC')
RETURNS timestamptz
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF after IS NULL OR timezone IS NULL THEN
        RAISE EXCEPTION 'after and timezone must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF NOT pg_catalog.isfinite(after) THEN
        RAISE EXCEPTION 'after must be a finite time, got %', after USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN pglockkit._cron_next(pglockkit._cron_parse(cron), timezone, after);
END
$$;
COMMENT ON FUNCTION pglockkit.cron_next(text, timestamptz, text) IS
    'The first slot of a 5-field cron expression strictly after `after`, with the fields read as local time in `timezone` (an IANA name; default UTC). Day-of-month and day-of-week are ORed when both are restricted. DST: a local time that occurs twice is two slots; one that does not exist is a slot at the end of the gap. 22004 for NULLs; 22023 for a bad expression (the message names the field), an unknown time zone or an infinite time.';

CREATE FUNCTION pglockkit._tick_one(s pglockkit.job_schedules, as_of timestamptz) RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lo    timestamptz;
    v_t     timestamptz;
    v_slots timestamptz[];
    v_slot  timestamptz;
    v_job   bigint;
BEGIN
    -- The caller holds the row's lock. Due slots are [s.next_run, as_of]; enqueue the newest
    -- s.catch_up of them. Search a window back from as_of, widened 24-fold until it holds enough
    -- slots or reaches next_run: a schedule that was down long does not walk every missed slot.
    v_lo := GREATEST(s.next_run - interval '1 microsecond', as_of - interval '1 hour');
    LOOP
        v_slots := '{}';
        v_t := v_lo;
        LOOP
            v_t := pglockkit._cron_next(s.spec, s.timezone, v_t);
            EXIT WHEN v_t > as_of;
            v_slots := v_slots || v_t;
        END LOOP;
        EXIT WHEN pg_catalog.cardinality(v_slots) >= s.catch_up OR v_lo <= s.next_run - interval '1 microsecond';
        v_lo := GREATEST(s.next_run - interval '1 microsecond', as_of - (as_of - v_lo) * 24);
    END LOOP;
    v_slots := v_slots[GREATEST(1, pg_catalog.cardinality(v_slots) - s.catch_up + 1):];
    FOREACH v_slot IN ARRAY v_slots LOOP
        v_job := pglockkit.enqueue_job(s.queue,
            s.payload || pg_catalog.jsonb_build_object('_schedule', s.name,
                '_slot', pg_catalog.to_char(v_slot AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')),
            v_slot, s.priority, NULL, s.max_attempts);
    END LOOP;
    -- v_t is the first slot after as_of: the next run. The slots enqueued and the advance commit
    -- together, so each slot is enqueued once, by whichever transaction held the row.
    UPDATE pglockkit.job_schedules j
       SET next_run = v_t, last_run = COALESCE(v_slots[pg_catalog.cardinality(v_slots)], j.last_run),
           last_job_id = COALESCE(v_job, j.last_job_id), last_error = NULL
     WHERE j.name = s.name;
    RETURN pg_catalog.cardinality(v_slots);
END
$$;
COMMENT ON FUNCTION pglockkit._tick_one(pglockkit.job_schedules, timestamptz) IS
    'Private: enqueues the newest catch_up due slots of one schedule whose row the caller has locked, and moves its next_run past as_of; returns how many jobs it enqueued.';

CREATE FUNCTION pglockkit._tick(as_of timestamptz, guarded boolean) RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
-- Nothing due is the common tick (every worker, every second): one probe of job_schedules_due,
-- not a scan of every schedule (bench/schedule_tick.py: with 1,000 schedules none due, a tick
-- costs what one without schedules does; a sequential scan added about 120 µs).
SET enable_seqscan = off
AS $$
DECLARE
    s       pglockkit.job_schedules;
    v_n     integer := 0;
    v_state text;
    v_msg   text;
    v_next  timestamptz;
BEGIN
    -- Due schedules whose rows nobody else holds: another ticker (or schedule/unschedule) has the
    -- others and advances them itself. Under READ COMMITTED a row committed meanwhile is
    -- re-checked against next_run <= as_of on its newest version, so it is not ticked twice.
    FOR s IN SELECT * FROM pglockkit.job_schedules j WHERE j.next_run <= as_of
              ORDER BY j.next_run FOR UPDATE SKIP LOCKED LOOP
        IF NOT guarded THEN
            v_n := v_n + pglockkit._tick_one(s, as_of);
            CONTINUE;
        END IF;
        BEGIN
            v_n := v_n + pglockkit._tick_one(s, as_of);
        EXCEPTION WHEN transaction_rollback OR lock_not_available THEN
            RAISE;
        WHEN OTHERS THEN
            -- This schedule cannot enqueue (its payload is over a limit lowered since, its time
            -- zone left the tz database, ...): skip its due slots, say why, and go on.
            GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT;
            RAISE WARNING 'pglockkit: schedule % skipped its due slots: % (%)', s.name, v_msg, v_state;
            -- Its next slot, in its own time zone: only the due slots are skipped (0011). Read in
            -- UTC only if the zone itself is what raised.
            BEGIN
                v_next := pglockkit._cron_next(s.spec, s.timezone, as_of);
            EXCEPTION WHEN OTHERS THEN
                v_next := pglockkit._cron_next(s.spec, 'UTC', as_of);
            END;
            UPDATE pglockkit.job_schedules j
               SET last_error = v_state || ': ' || v_msg,
                   next_run = COALESCE(v_next, as_of + interval '1 hour')
             WHERE j.name = s.name;
        END;
    END LOOP;
    RETURN v_n;
END
$$;
COMMENT ON FUNCTION pglockkit._tick(timestamptz, boolean) IS
    'Private: ticks every due schedule whose row is free (tick_schedules); guarded, a schedule that raises records last_error and skips its due slots instead of failing the tick.';

CREATE FUNCTION pglockkit.tick_schedules(as_of timestamptz DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := pg_catalog.clock_timestamp();
BEGIN
    IF as_of > v_now THEN
        RAISE EXCEPTION 'as_of % is in the future', as_of USING ERRCODE = 'invalid_parameter_value',
            HINT = 'A tick enqueues the slots due by as_of (default: now); a future slot cannot be due yet.';
    END IF;
    -- One pass without a subtransaction per schedule (most ticks); if some schedule raises, the
    -- pass is undone and run again with each schedule guarded.
    BEGIN
        RETURN pglockkit._tick(COALESCE(as_of, v_now), false);
    EXCEPTION WHEN transaction_rollback OR lock_not_available THEN
        RAISE;
    WHEN OTHERS THEN
        RETURN pglockkit._tick(COALESCE(as_of, v_now), true);
    END;
END
$$;
COMMENT ON FUNCTION pglockkit.tick_schedules(timestamptz) IS
    'Enqueues the due slots of every schedule (due: next_run <= as_of, default now) and returns how many jobs it enqueued. Each slot is enqueued exactly once whoever ticks: a tick locks the due schedule rows FOR UPDATE SKIP LOCKED and moves next_run past as_of in the transaction that enqueues, so concurrent ticks split the schedules and never wait. After downtime a schedule enqueues its newest catch_up due slots (default 1: the latest only). A schedule whose job cannot be enqueued skips its due slots and shows why in schedules.last_error (WARNING). Workers call it about once a second; pg_cron or any client may too. 22023 for an as_of in the future.';

CREATE FUNCTION pglockkit.schedule(
    name text, cron text, queue text, payload jsonb DEFAULT '{}', timezone text DEFAULT 'UTC',
    priority integer DEFAULT 0, max_attempts integer DEFAULT 5, catch_up integer DEFAULT 1)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_spec  pglockkit.cron_spec;
    v_now   timestamptz;
    v_next  timestamptz;
    v_old   pglockkit.job_schedules;
    v_error text;
    v_state text;
    v_job   jsonb;  -- the payload as a job of this schedule carries it
BEGIN
    IF schedule.name IS NULL OR schedule.payload IS NULL OR schedule.timezone IS NULL
       OR schedule.priority IS NULL OR schedule.max_attempts IS NULL OR schedule.catch_up IS NULL THEN
        RAISE EXCEPTION 'name, payload, timezone, priority, max_attempts and catch_up must not be null'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF schedule.name = '' OR pg_catalog.octet_length(schedule.name) > 1024 THEN
        RAISE EXCEPTION 'schedule name must be 1 to 1024 bytes, got %', pg_catalog.octet_length(schedule.name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pglockkit._check_queue(schedule.queue);
    IF pg_catalog.octet_length(schedule.queue) > 1024 THEN
        RAISE EXCEPTION 'queue name is % bytes, at most 1024', pg_catalog.octet_length(schedule.queue)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.jsonb_typeof(schedule.payload) <> 'object' THEN
        RAISE EXCEPTION 'a schedule''s payload must be a JSON object, got %', pg_catalog.jsonb_typeof(schedule.payload)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Each job gets the payload plus "_schedule" (the name) and "_slot" (the slot, UTC).';
    END IF;
    IF schedule.payload ?| ARRAY['_schedule', '_slot'] THEN
        RAISE EXCEPTION 'a schedule''s payload must not have the keys "_schedule" or "_slot": each job gets them'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Checked as its jobs carry it, with "_schedule" and "_slot" (0016): a payload under the limit
    -- whose jobs were over it was accepted, and every slot was skipped.
    v_job := schedule.payload || pg_catalog.jsonb_build_object('_schedule', schedule.name, '_slot', '2000-01-01T00:00:00Z');
    IF pg_catalog.pg_column_size(v_job) > 4096 OR pg_catalog.pg_column_compression(v_job) IS NOT NULL THEN
        PERFORM pglockkit._check_payloads(ARRAY[v_job]);
    END IF;
    IF schedule.max_attempts NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'max_attempts % is out of range', schedule.max_attempts
            USING ERRCODE = 'numeric_value_out_of_range', HINT = 'max_attempts is 1 to 1000.';
    END IF;
    IF schedule.catch_up NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'catch_up % is out of range', schedule.catch_up
            USING ERRCODE = 'numeric_value_out_of_range',
                  HINT = 'catch_up is how many missed slots a tick enqueues at most, newest first: 1 (the latest only) to 1000.';
    END IF;
    v_spec := pglockkit._cron_parse(schedule.cron);
    PERFORM pg_catalog.now() AT TIME ZONE schedule.timezone;  -- 22023: time zone "..." not recognized
    LOOP
        SELECT * INTO v_old FROM pglockkit.job_schedules j WHERE j.name = schedule.name FOR UPDATE;
        -- After the row is ours (0016): a tick that held it meanwhile has enqueued the slots up
        -- to its own clock, and the new definition starts after this one's.
        v_now := pg_catalog.clock_timestamp();
        IF FOUND THEN
            -- Slots of the old definition that are due are enqueued by it first; the new one
            -- starts after now: no slot twice, none lost. If the old definition cannot enqueue
            -- them (its payload is over a limit lowered since, ...), they are skipped as a tick
            -- skips them, with last_error saying why, and the replacement goes on: it may be
            -- the fix (0011).
            IF v_old.next_run <= v_now THEN
                BEGIN
                    PERFORM pglockkit._tick_one(v_old, v_now);
                EXCEPTION WHEN transaction_rollback OR lock_not_available THEN
                    RAISE;
                WHEN OTHERS THEN
                    GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_error = MESSAGE_TEXT;
                    RAISE WARNING 'pglockkit: schedule % skipped its due slots: % (%)', schedule.name, v_error, v_state;
                    v_error := v_state || ': ' || v_error;
                END;
            END IF;
            v_next := pglockkit._cron_next(v_spec, schedule.timezone, v_now);
            UPDATE pglockkit.job_schedules j
               SET cron = schedule.cron, spec = v_spec, timezone = schedule.timezone, queue = schedule.queue,
                   payload = schedule.payload, priority = schedule.priority, max_attempts = schedule.max_attempts,
                   catch_up = schedule.catch_up, next_run = v_next, last_error = v_error,
                   updated_at = pg_catalog.clock_timestamp()
             WHERE j.name = schedule.name;
            RETURN v_next;
        END IF;
        v_next := pglockkit._cron_next(v_spec, schedule.timezone, v_now);
        INSERT INTO pglockkit.job_schedules AS j (name, cron, spec, timezone, queue, payload, priority, max_attempts, catch_up, next_run)
        VALUES (schedule.name, schedule.cron, v_spec, schedule.timezone, schedule.queue, schedule.payload,
                schedule.priority, schedule.max_attempts, schedule.catch_up, v_next)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN v_next;
        END IF;
        -- Created by another transaction meanwhile: update that one.
    END LOOP;
END
$$;
COMMENT ON FUNCTION pglockkit.schedule(text, text, text, jsonb, text, integer, integer, integer) IS
    'Creates or replaces the schedule `name`: at every slot of `cron` (5 fields, local time in `timezone`, see cron_next) a job is enqueued into `queue` with `payload` (a JSON object) plus "_schedule" (the name) and "_slot" (the slot in UTC, e.g. "2025-03-30T01:00:00Z"), run_at the slot, and the given priority and max_attempts. Returns the next run. After downtime a tick enqueues the newest catch_up missed slots (default 1: the latest only; up to 1000). Replacing a schedule first enqueues the old definition''s due slots (or, if it cannot, skips them with a WARNING and last_error, as a tick does); the new one starts after now. pglockkit_admin only. 22004 for NULLs; 22023 for a bad cron (naming the field), time zone, name or payload; 22003 for max_attempts or catch_up out of range; 54000 for a payload over max_payload_bytes.';

CREATE FUNCTION pglockkit.unschedule(name text) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF unschedule.name IS NULL THEN
        RAISE EXCEPTION 'name must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    DELETE FROM pglockkit.job_schedules j WHERE j.name = unschedule.name;
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION pglockkit.unschedule(text) IS
    'Deletes the schedule `name`: no slot after this commits is enqueued (jobs already enqueued stay). Returns false if there was no such schedule (so it is safe to repeat). pglockkit_admin only. 22004 for NULL.';

CREATE VIEW pglockkit.schedules AS
SELECT s.name, s.cron, s.timezone, s.queue, s.payload, s.priority, s.max_attempts, s.catch_up,
       s.next_run, s.last_run, s.last_job_id, s.last_error, s.created_at, s.updated_at
  FROM pglockkit.job_schedules s;
COMMENT ON VIEW pglockkit.schedules IS
    'Every schedule: its cron expression and time zone, the job it enqueues (queue, payload, priority, max_attempts), catch_up, next_run (the next slot to enqueue), last_run (the last slot enqueued) and last_job_id, last_error (why its last due slots were skipped, if they were), created_at, updated_at.';

-- ==== sql/schema/07_monitoring.sql ====

-- Monitoring: views over pg_locks and pg_stat_activity, queue health, contention history
--
-- The current definition of each object, once. A change edits this file and adds a delta
-- migration (see CONTRIBUTING.md); a test checks that both build the same schema.

-- (Before the tables: an index of lock_sightings uses it.)
-- One bigint per advisory lock of advisory_locks (its key, or its int4 pair's two halves; which of
-- the two is key IS NULL): an equality the planner can hash, where IS NOT DISTINCT FROM on three
-- columns made sample() compare every sighting with every lock held (300 ms at 1,000 locks) (0017).
CREATE FUNCTION pglockkit._lock_ident(key bigint, key1 integer, key2 integer) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT coalesce(key, (key1::int8 << 32) | (key2::int8 & 4294967295));
END;
COMMENT ON FUNCTION pglockkit._lock_ident(bigint, integer, integer) IS
    'Private: one bigint for an advisory lock of advisory_locks: its key, or its int4 pair (key1, key2) packed (tell the two apart by key IS NULL). Inlined.';

CREATE TABLE pglockkit.lock_samples (
    sampled_at     timestamptz NOT NULL,
    namespace      text        NOT NULL,
    key            bigint,
    key1           integer,
    key2           integer,
    holders        integer     NOT NULL,
    waiters        integer     NOT NULL,
    longest_wait   interval,
    holder_queries text[],
    holder_roles   oid[]
);
COMMENT ON TABLE pglockkit.lock_samples IS
    'One row per advisory lock key per sample() call: holders, waiters, the longest wait, the holders'' queries and, aligned with them, the roles of the sessions that ran them. Readers get it through lock_history and contention_report(), which show a query only to whom pg_stat_activity would.';
COMMENT ON COLUMN pglockkit.lock_samples.holder_roles IS
    'The role (pg_stat_activity.usesysid) of the session that ran holder_queries[i]; NULL for a query whose session''s role was not recorded.';

CREATE INDEX lock_samples_time ON pglockkit.lock_samples (sampled_at);

CREATE TABLE pglockkit.queue_samples (
    sampled_at       timestamptz NOT NULL,
    queue            text        NOT NULL,
    ready            bigint      NOT NULL,
    running          bigint      NOT NULL,
    oldest_ready_age interval
);
COMMENT ON TABLE pglockkit.queue_samples IS 'Queue depth and lag per sample() call.';

CREATE INDEX queue_samples_time ON pglockkit.queue_samples (sampled_at);

-- How long a lock has been held: pg_locks does not say, and a session's state age restarts at
-- each of its transactions (a session lock leaked on a busy pooled server session never looks
-- idle for long). sample() keeps, per session and advisory lock it holds, when it first saw it
-- held; a lock no longer held at a sample is forgotten (0017).
CREATE TABLE pglockkit.lock_sightings (
    pid           integer     NOT NULL,
    backend_start timestamptz NOT NULL,
    namespace     text        NOT NULL,
    key           bigint,
    key1          integer,
    key2          integer,
    first_seen    timestamptz NOT NULL,
    last_seen     timestamptz NOT NULL
);
COMMENT ON TABLE pglockkit.lock_sightings IS
    'Per session (pid and backend_start) and advisory lock it holds: the first and the last sample() that saw it held. Read it through lock_holds.';
-- lock_holds looks each held lock up by its session and key.
CREATE INDEX lock_sightings_lock ON pglockkit.lock_sightings (pid, pglockkit._lock_ident(key, key1, key2));

-- When sample() last ran: hold times and the history are only as fresh as that, and a sampler
-- that stopped (a removed pod, a disabled pg_cron job) left no other trace (0017).
CREATE TABLE pglockkit.sampler (
    one             boolean     PRIMARY KEY DEFAULT true CHECK (one),
    last_sampled_at timestamptz NOT NULL
);
COMMENT ON TABLE pglockkit.sampler IS
    'One row once sample() has run: when it last ran. Read it through sampling.';
CREATE FUNCTION pglockkit._advisory_label(objsubid smallint, classid oid, objid oid) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE
        WHEN objsubid = 2 THEN 'int4 pair'
        WHEN k.key = 72707369 THEN 'flyway'   -- Flyway's migration lock
        WHEN k.key <= 0 THEN 'unregistered'
        ELSE coalesce((SELECT n.name FROM pglockkit.namespaces n
                        WHERE n.id = (k.key >> 48)::int4), 'unregistered')
    END
    FROM (SELECT (classid::int8 << 32) | objid::int8 AS key) k
$$;
COMMENT ON FUNCTION pglockkit._advisory_label(smallint, oid, oid) IS
    'Private: the namespace name of an advisory lock in pg_locks: the registered name, ''flyway'' for Flyway''s key, ''int4 pair'' for two-int keys, else ''unregistered''.';

-- A prepared transaction holds its locks with no session (pid NULL); its locks share a
-- virtualtransaction with the lock it holds on its own xid, which pg_prepared_xacts names (0017).
CREATE FUNCTION pglockkit._prepared_gid(virtualtransaction text) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT p.gid
      FROM pg_catalog.pg_locks x
      JOIN pg_catalog.pg_prepared_xacts p ON p.transaction = x.transactionid
     WHERE x.pid IS NULL AND x.locktype = 'transactionid'
       AND x.virtualtransaction = _prepared_gid.virtualtransaction
     LIMIT 1
$$;
COMMENT ON FUNCTION pglockkit._prepared_gid(text) IS
    'Private: the gid of the prepared transaction whose locks pg_locks lists under this virtualtransaction (NULL if none).';

CREATE FUNCTION pglockkit.sample(retention interval DEFAULT '7 days') RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now  timestamptz := pg_catalog.clock_timestamp();
    v_rows integer;
BEGIN
    IF retention IS NULL THEN
        RAISE EXCEPTION 'retention must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF retention < interval '0' THEN
        RAISE EXCEPTION 'retention must not be negative, got %', retention USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- One row per (key, query, role) pair is kept as "first" so that the two aggregates below
    -- list each pair once, in the same order: holder_queries[i] was run by holder_roles[i].
    -- pg_stat_activity is one snapshot per transaction: the view and the join agree on each pid.
    INSERT INTO pglockkit.lock_samples (sampled_at, namespace, key, key1, key2, holders, waiters, longest_wait,
                                        holder_queries, holder_roles)
    SELECT v_now, h.namespace, h.key, h.key1, h.key2,
           pg_catalog.count(*) FILTER (WHERE h.granted), pg_catalog.count(*) FILTER (WHERE NOT h.granted),
           pg_catalog.max(h.wait_time),
           pg_catalog.array_agg(h.query ORDER BY h.query, h.role) FILTER (WHERE h.granted AND h.query IS NOT NULL AND h.first),
           pg_catalog.array_agg(h.role ORDER BY h.query, h.role) FILTER (WHERE h.granted AND h.query IS NOT NULL AND h.first)
      FROM (SELECT al.namespace, al.key, al.key1, al.key2, al.granted, al.wait_time, x.query, a.usesysid AS role,
                   pg_catalog.row_number() OVER (PARTITION BY al.namespace, al.key, al.key1, al.key2, al.granted, x.query, a.usesysid)
                       = 1 AS first
              FROM pglockkit.advisory_locks al
              LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = al.pid
              CROSS JOIN LATERAL (SELECT pg_catalog.left(al.query, 200) AS query) x) h
     GROUP BY h.namespace, h.key, h.key1, h.key2;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    -- Hold times (0017). Samplers take turns, so that two never add the same sighting. A sighting
    -- is its session's (pid, backend_start) and the key: the namespace is a label, read from the
    -- registry, which may change while the lock is held.
    PERFORM pg_catalog.pg_advisory_xact_lock(pglockkit._key(pglockkit._ns_id_from_name('pglockkit'), 'sample'));
    INSERT INTO pglockkit.sampler AS s (one, last_sampled_at) VALUES (true, v_now)
    ON CONFLICT (one) DO UPDATE SET last_sampled_at = excluded.last_sampled_at;
    -- Rewritten whole at each sample: the locks held now, each with the first_seen of its sighting
    -- if it had one. A FULL JOIN can only hash or merge, where the planner, estimating one row for
    -- the locks (a function's), compared every sighting with every lock (300 ms at 1,000 locks).
    WITH held AS (
        SELECT DISTINCT al.pid, coalesce(a.backend_start, '-infinity') AS backend_start,
               al.namespace, al.key, al.key1, al.key2,
               pglockkit._lock_ident(al.key, al.key1, al.key2) AS ident, al.key IS NULL AS pair
          FROM pglockkit.advisory_locks al
          LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = al.pid
         WHERE al.granted AND al.pid IS NOT NULL
           AND al.pid <> pg_catalog.pg_backend_pid()  -- not the turn taken above
    ), seen AS (
        SELECT h.pid, h.backend_start, h.namespace, h.key, h.key1, h.key2, s.first_seen
          FROM held h
          FULL JOIN pglockkit.lock_sightings s
            ON h.pid = s.pid AND h.backend_start = s.backend_start
           AND h.ident = pglockkit._lock_ident(s.key, s.key1, s.key2) AND h.pair = (s.key IS NULL)
    ), cleared AS (
        DELETE FROM pglockkit.lock_sightings
    )
    INSERT INTO pglockkit.lock_sightings (pid, backend_start, namespace, key, key1, key2, first_seen, last_seen)
    SELECT n.pid, n.backend_start, n.namespace, n.key, n.key1, n.key2, coalesce(n.first_seen, v_now), v_now
      FROM seen n
     WHERE n.pid IS NOT NULL;  -- a sighting whose lock is no longer held is forgotten
    INSERT INTO pglockkit.queue_samples (sampled_at, queue, ready, running, oldest_ready_age)
    SELECT v_now, q.queue, q.ready, q.running, q.oldest_ready_age FROM pglockkit.queue_stats q;
    DELETE FROM pglockkit.lock_samples s WHERE s.sampled_at < (v_now - retention);
    DELETE FROM pglockkit.queue_samples s WHERE s.sampled_at < (v_now - retention);
    RETURN v_rows;
END
$$;
COMMENT ON FUNCTION pglockkit.sample(interval) IS
    'Records one snapshot of advisory-lock contention (per key: holders, waiters, longest wait, holders'' queries and their roles) and queue lag, and deletes samples older than retention; returns the lock rows recorded. It also keeps, per session and lock it holds, when a sample first saw it held (lock_holds), and forgets what is no longer held. Runs as the installing role; lock_history shows each reader only the queries it could see live. Call it every few seconds: from pg_cron, or `pglockkit sample --every 5s`.';

-- A NULL since (an unset parameter) matched no sample: an empty report, as if nothing contended.
CREATE FUNCTION pglockkit._invalid_since(since interval) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF since IS NULL THEN
        RAISE EXCEPTION 'since must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF since < interval '0' THEN
        RAISE EXCEPTION 'since must not be negative, got %', since USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pglockkit._invalid_since(interval) IS
    'Private: NULL for a since contention_report accepts; raises 22004 for NULL, 22023 for a negative one.';

CREATE VIEW pglockkit.advisory_locks AS
SELECT CASE WHEN l.objsubid OPERATOR(pg_catalog.=) 2 THEN 'int4 pair'
            WHEN l.classid::int8 OPERATOR(pg_catalog.=) 0 AND l.objid::int8 OPERATOR(pg_catalog.=) 72707369 THEN 'flyway'
            ELSE coalesce(n.name, 'unregistered') END AS namespace,
       CASE WHEN l.objsubid OPERATOR(pg_catalog.=) 1
            THEN (l.classid::int8 OPERATOR(pg_catalog.<<) 32) OPERATOR(pg_catalog.|) l.objid::int8 END AS key,
       CASE WHEN l.objsubid OPERATOR(pg_catalog.=) 2
            THEN (l.classid::int8 OPERATOR(pg_catalog.-) CASE WHEN l.classid::int8 OPERATOR(pg_catalog.>) 2147483647 THEN 4294967296 ELSE 0 END)::int4 END AS key1,
       CASE WHEN l.objsubid OPERATOR(pg_catalog.=) 2
            THEN (l.objid::int8 OPERATOR(pg_catalog.-) CASE WHEN l.objid::int8 OPERATOR(pg_catalog.>) 2147483647 THEN 4294967296 ELSE 0 END)::int4 END AS key2,
       l.granted, l.mode, l.pid,
       a.application_name, a.usename AS "user", a.client_addr, a.state,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) a.state_change AS state_age,
       CASE WHEN NOT l.granted THEN pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) l.waitstart END AS wait_time,
       CASE WHEN NOT l.granted THEN pg_catalog.pg_blocking_pids(l.pid) END AS blocked_by,
       a.query,
       CASE WHEN l.pid IS NULL THEN pglockkit._prepared_gid(l.virtualtransaction) END AS prepared_gid
  FROM pg_catalog.pg_locks l
  LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) l.pid
  -- The namespace of a positive bigint key is its top 16 bits: classid >> 16 (key >> 48).
  LEFT JOIN pglockkit.namespaces n
         ON l.objsubid OPERATOR(pg_catalog.=) 1
        AND ((l.classid::int8 OPERATOR(pg_catalog.<<) 32) OPERATOR(pg_catalog.|) l.objid::int8) OPERATOR(pg_catalog.>) 0
        AND n.id OPERATOR(pg_catalog.=) (l.classid::int8 OPERATOR(pg_catalog.>>) 16)::int4
 WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory'
   AND l.database OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database d
                                           WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database());
COMMENT ON VIEW pglockkit.advisory_locks IS
    'Every advisory lock held or awaited in this database: namespace (registered name, ''flyway'', ''int4 pair'' or ''unregistered''), key (bigint keys) or key1/key2 (int4 pairs), granted, pid, application, user, client, state and how long in it, a waiter''s wait time and the pids blocking it, the query. For a session the reader may not see (pg_stat_activity''s rule: neither the privileges of its role nor of pg_read_all_stats), user and application are shown, client, state and state_age are NULL, and the query reads ''<insufficient privilege>''. A lock of a prepared transaction has no pid and no session; prepared_gid names the transaction (COMMIT PREPARED or ROLLBACK PREPARED it).';

-- The waiters are the sessions of this database with a lock not granted in pg_locks, which every
-- reader sees (pg_stat_activity's wait_event_type is NULL for another role's session, unless the
-- reader has pg_read_all_stats), and decoded with this database's registry and catalog (0014).
CREATE VIEW pglockkit.lock_waits AS
WITH RECURSIVE waiting AS (
    SELECT a.pid, pg_catalog.pg_blocking_pids(a.pid) AS blocked_by
      FROM pg_catalog.pg_stat_activity a
     WHERE a.datid OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database d
                                            WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
       AND EXISTS (SELECT FROM pg_catalog.pg_locks l
                    WHERE l.pid OPERATOR(pg_catalog.=) a.pid AND NOT l.granted)
), up (pid, blocker, depth) AS (
    SELECT w.pid, b.blocker, 1 FROM waiting w, pg_catalog.unnest(w.blocked_by) AS b(blocker)
    UNION
    SELECT u.pid, b.blocker, u.depth OPERATOR(pg_catalog.+) 1
      FROM up u JOIN waiting w ON w.pid OPERATOR(pg_catalog.=) u.blocker, pg_catalog.unnest(w.blocked_by) AS b(blocker)
     WHERE u.depth OPERATOR(pg_catalog.<) 100
), roots AS (
    -- The blockers at the top of each chain: not waiting themselves.
    SELECT u.pid, pg_catalog.min(u.blocker) AS root
      FROM up u
     WHERE NOT EXISTS (SELECT FROM waiting w WHERE w.pid OPERATOR(pg_catalog.=) u.blocker
                                                AND pg_catalog.cardinality(w.blocked_by) OPERATOR(pg_catalog.>) 0)
     GROUP BY u.pid
)
SELECT w.pid, w.blocked_by, r.root AS root_blocker,
       (SELECT pg_catalog.count(*) FROM roots r2 WHERE r2.root OPERATOR(pg_catalog.=) r.root) AS sessions_behind_root,
       l.locktype, l.mode,
       CASE WHEN l.locktype OPERATOR(pg_catalog.=) 'advisory' THEN pglockkit._advisory_label(l.objsubid, l.classid, l.objid) END AS namespace,
       l.relation::regclass AS relation,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) l.waitstart AS wait_time,
       a.application_name, a.usename AS "user", a.query,
       -- pg_blocking_pids names a prepared transaction 0: which ones hold what this session wants.
       CASE WHEN 0 OPERATOR(pg_catalog.=) ANY (w.blocked_by) THEN
           ARRAY(SELECT DISTINCT g.gid
                   FROM pg_catalog.pg_locks h,
                        LATERAL (SELECT pglockkit._prepared_gid(h.virtualtransaction) AS gid) g
                  WHERE h.pid IS NULL AND h.granted AND g.gid IS NOT NULL
                    AND (h.locktype, h.database, h.relation, h.page, h.tuple, h.virtualxid, h.transactionid,
                         h.classid, h.objid, h.objsubid)
                        IS NOT DISTINCT FROM
                        (l.locktype, l.database, l.relation, l.page, l.tuple, l.virtualxid, l.transactionid,
                         l.classid, l.objid, l.objsubid)
                  ORDER BY g.gid)
       END AS prepared_blockers
  FROM waiting w
  JOIN pg_catalog.pg_locks l ON l.pid OPERATOR(pg_catalog.=) w.pid AND NOT l.granted
  LEFT JOIN roots r ON r.pid OPERATOR(pg_catalog.=) w.pid
  LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) w.pid
 WHERE pg_catalog.cardinality(w.blocked_by) OPERATOR(pg_catalog.>) 0;
COMMENT ON VIEW pglockkit.lock_waits IS
    'Every session of this database waiting on a lock of any type: its blockers, the root blocker of its chain (a session that is not itself waiting) and how many sessions wait behind that root, the lock (namespace for advisory locks, relation otherwise), and how long it has waited. A blocker 0 is a prepared transaction (pg_blocking_pids): prepared_blockers names those that hold the lock the session waits for (their gids; NULL when no blocker is 0).';

-- dedicated: the connections pglockkit's clients open to hold one session lock while the caller's
-- block runs (sole_writer, run_once and `pglockkit once`, a session-bound Lease) idle by design;
-- they are known by the application_name those clients give them (0017).
CREATE VIEW pglockkit.idle_lock_holders AS
SELECT al.namespace, al.key, al.key1, al.key2, al.pid, al.application_name, al."user", al.client_addr,
       al.state, al.state_age AS idle_for, al.query AS last_query,
       coalesce(al.application_name OPERATOR(pg_catalog.~) '^pglockkit (sole_writer|run|lease) ', false) AS dedicated
  FROM pglockkit.advisory_locks al
 WHERE al.granted AND al.state IN ('idle', 'idle in transaction', 'idle in transaction (aborted)');
COMMENT ON VIEW pglockkit.idle_lock_holders IS
    'Advisory locks held by sessions that are idle or idle in transaction, with how long they have idled: the leak of a session lock returned to a pool with its connection. No minimum idle time here: filter on idle_for. dedicated: a connection that a pglockkit client (sole_writer, run_once, pglockkit once, a session-bound Lease) opened to hold the lock while its block runs, known by the application_name it gave (pglockkit sole_writer ..., pglockkit run ..., pglockkit lease ...): idle by design, not a leak.';

CREATE VIEW pglockkit.namespace_stats AS
SELECT al.namespace,
       pg_catalog.count(*) FILTER (WHERE al.granted) AS locks_held,
       pg_catalog.count(*) FILTER (WHERE NOT al.granted) AS waiters,
       pg_catalog.max(al.wait_time) AS longest_wait,
       pg_catalog.max(al.state_age) FILTER (WHERE al.granted) AS longest_holder_state_age,
       pg_catalog.count(DISTINCT al.pid) AS sessions
  FROM pglockkit.advisory_locks al
 GROUP BY al.namespace;
COMMENT ON VIEW pglockkit.namespace_stats IS
    'Per namespace: advisory locks held, waiters, the longest current wait, and how long the longest-standing holder has been in its current state.';

CREATE VIEW pglockkit.table_health AS
SELECT c.relname AS table_name,
       pg_catalog.pg_total_relation_size(c.oid) AS total_bytes,
       s.n_live_tup AS live_rows,
       s.n_dead_tup AS dead_rows,
       pg_catalog.round(s.n_dead_tup::numeric OPERATOR(pg_catalog./)
                        NULLIF(s.n_live_tup OPERATOR(pg_catalog.+) s.n_dead_tup, 0), 3) AS dead_ratio,
       s.last_vacuum, s.last_autovacuum, s.autovacuum_count, s.last_autoanalyze
  FROM pg_catalog.pg_class c
  JOIN pg_catalog.pg_stat_all_tables s ON s.relid OPERATOR(pg_catalog.=) c.oid
 WHERE c.relnamespace OPERATOR(pg_catalog.=) 'pglockkit'::regnamespace AND c.relkind OPERATOR(pg_catalog.=) 'r';
COMMENT ON VIEW pglockkit.table_health IS
    'Size, live and dead rows, dead ratio and last (auto)vacuum of each pglockkit table (jobs above all). A high dead ratio that does not fall after autovacuum means something holds the xmin horizon: see pglockkit.xmin_horizon.';

CREATE VIEW pglockkit.xmin_horizon AS
SELECT 'session'::text AS kind, a.pid::text AS holder, a.application_name, a.usename AS "user", a.state,
       pg_catalog.age(a.backend_xmin) AS xmin_age,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) a.xact_start AS xact_age,
       a.query
  FROM pg_catalog.pg_stat_activity a
 WHERE a.backend_xmin IS NOT NULL AND a.pid OPERATOR(pg_catalog.<>) pg_catalog.pg_backend_pid()
UNION ALL
SELECT 'replication slot', r.slot_name::text, NULL, NULL, CASE WHEN r.active THEN 'active' ELSE 'inactive' END,
       pg_catalog.age(coalesce(r.xmin, r.catalog_xmin)), NULL, NULL
  FROM pg_catalog.pg_replication_slots r
 WHERE coalesce(r.xmin, r.catalog_xmin) IS NOT NULL
UNION ALL
SELECT 'prepared transaction', p.gid, NULL, p.owner::text, NULL,
       pg_catalog.age(p.transaction), pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) p.prepared, NULL
  FROM pg_catalog.pg_prepared_xacts p;
COMMENT ON VIEW pglockkit.xmin_horizon IS
    'What holds back the xmin horizon, oldest first when ordered by xmin_age DESC: sessions with an open snapshot (idle in transaction above all), replication slots and prepared transactions. While one is old, vacuum cannot remove the queue''s dead rows and claims slow down.';

-- Readers (pg_monitor, pglockkit_user) get the samples through views, like every other view.
CREATE VIEW pglockkit.lock_history AS
SELECT s.sampled_at, s.namespace, s.key, s.key1, s.key2, s.holders, s.waiters, s.longest_wait,
       -- pg_stat_activity's rule (HAS_PGSTAT_PERMISSIONS), applied to the reader of the history.
       (SELECT pg_catalog.array_agg(DISTINCT
                   CASE WHEN pg_catalog.pg_has_role(CURRENT_USER, 'pg_read_all_stats'::name, 'USAGE')
                          OR pg_catalog.pg_has_role(CURRENT_USER, q.role, 'USAGE')
                        THEN q.query ELSE '<insufficient privilege>' END)
          FROM ROWS FROM (pg_catalog.unnest(s.holder_queries), pg_catalog.unnest(s.holder_roles)) AS q(query, role)) AS holder_queries
  FROM pglockkit.lock_samples s;
COMMENT ON VIEW pglockkit.lock_history IS
    'The advisory-lock samples recorded by sample(), one row per key per sample. A holder''s query reads ''<insufficient privilege>'' unless the reader has the privileges of the holder''s role or of pg_read_all_stats: the rule of pg_stat_activity, so history never shows what the live view would hide.';

CREATE VIEW pglockkit.queue_history AS SELECT * FROM pglockkit.queue_samples;
COMMENT ON VIEW pglockkit.queue_history IS 'Queue depth and lag recorded by sample().';

CREATE VIEW pglockkit.sampling AS
SELECT s.last_sampled_at,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) s.last_sampled_at AS since_last_sample
  FROM pglockkit.sampler s;
COMMENT ON VIEW pglockkit.sampling IS
    'When sample() last ran, and how long ago: no row if it never ran in this database. Hold times (lock_holds) and the history are only as fresh as that.';

-- Only what is still held now, by the session that was seen holding it (its backend_start, where
-- the reader may see it): a sighting outlives its lock when sample() stops running.
CREATE VIEW pglockkit.lock_holds AS
SELECT al.namespace, s.key, s.key1, s.key2, s.pid, al.application_name, al."user", al.state,
       s.first_seen AS held_since, s.last_seen,
       s.last_seen OPERATOR(pg_catalog.-) s.first_seen AS held_for,
       coalesce(al.application_name OPERATOR(pg_catalog.~) '^pglockkit (sole_writer|run|lease) ', false) AS dedicated
  FROM pglockkit.lock_sightings s
  JOIN pglockkit.advisory_locks al
    ON al.granted AND al.pid OPERATOR(pg_catalog.=) s.pid
   AND pglockkit._lock_ident(al.key, al.key1, al.key2) OPERATOR(pg_catalog.=) pglockkit._lock_ident(s.key, s.key1, s.key2)
   AND (al.key IS NULL) OPERATOR(pg_catalog.=) (s.key IS NULL)
  JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) s.pid
   AND (a.backend_start IS NULL OR a.backend_start OPERATOR(pg_catalog.=) s.backend_start
        OR s.backend_start OPERATOR(pg_catalog.=) '-infinity');
COMMENT ON VIEW pglockkit.lock_holds IS
    'How long each advisory lock held now had been held by its session at the last sample(): held_for is at least last_seen - held_since (the first sample that saw it), whatever the session did meanwhile (on a busy pool, a leaked session lock''s session never idles long, so idle_lock_holders misses it). A lock let go since, or a session gone, is not listed, even when sample() has stopped running. Empty unless sample() runs. dedicated: as in idle_lock_holders.';

CREATE FUNCTION pglockkit.contention_report(since interval DEFAULT '1 hour')
RETURNS TABLE (namespace text, key bigint, key1 integer, key2 integer, samples bigint,
               samples_with_waiters bigint, max_waiters integer, avg_waiters numeric, longest_wait interval,
               holder_queries text[], namespace_sessions numeric, namespace_parallelism numeric)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    WITH window_ AS (
        SELECT s.* FROM pglockkit.lock_history s
         WHERE s.sampled_at >= (pg_catalog.clock_timestamp() - contention_report.since)
           AND pglockkit._invalid_since(contention_report.since) IS NULL
    ), per_ns AS (
        -- Per namespace and sample: sessions involved (holding or waiting) vs sessions holding.
        SELECT w.namespace, w.sampled_at,
               pg_catalog.sum(w.holders + w.waiters) AS sessions, pg_catalog.sum(w.holders) AS holding
          FROM window_ w GROUP BY w.namespace, w.sampled_at
    ), ns AS (
        SELECT p.namespace, pg_catalog.round(pg_catalog.avg(p.sessions), 2) AS sessions,
               pg_catalog.round(pg_catalog.avg(p.holding::numeric / p.sessions), 3) AS parallelism
          FROM per_ns p GROUP BY p.namespace
    )
    SELECT w.namespace, w.key, w.key1, w.key2, pg_catalog.count(*),
           pg_catalog.count(*) FILTER (WHERE w.waiters > 0),
           pg_catalog.max(w.waiters), pg_catalog.round(pg_catalog.avg(w.waiters), 2), pg_catalog.max(w.longest_wait),
           (SELECT pg_catalog.array_agg(DISTINCT q) FROM window_ w2, pg_catalog.unnest(w2.holder_queries) AS q
             WHERE w2.namespace = w.namespace AND w2.key IS NOT DISTINCT FROM w.key
               AND w2.key1 IS NOT DISTINCT FROM w.key1 AND w2.key2 IS NOT DISTINCT FROM w.key2),
           ns.sessions, ns.parallelism
      FROM window_ w JOIN ns ON ns.namespace = w.namespace
     GROUP BY w.namespace, w.key, w.key1, w.key2, ns.sessions, ns.parallelism
     ORDER BY pg_catalog.count(*) FILTER (WHERE w.waiters > 0) DESC, pg_catalog.max(w.waiters) DESC
$$;
COMMENT ON FUNCTION pglockkit.contention_report(interval) IS
    'Which advisory keys serialized the swarm over the last since: per key, in how many samples it had waiters, the most and average waiters, the longest wait and the holders'' queries (read from lock_history: a query the reader could not see live reads ''<insufficient privilege>''); 22004 for a NULL since, 22023 for a negative one; per namespace, the average sessions involved and the effective parallelism (sessions holding / sessions involved: 1.0 = nobody waits, 1/n = n sessions queue behind one).';

-- ==== sql/schema/08_privileges.sql ====

-- Privileges: roles, grants and who may call what
--
-- The current definition of each object, once. A change edits this file and adds a delta
-- migration (see CONTRIBUTING.md); a test checks that both build the same schema.

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
-- Privileges: EXECUTE is revoked from PUBLIC and granted to pglockkit_user; read-only tables and
-- views to pglockkit_user and pg_monitor. Every migration ends by calling this, and so does
-- `pglockkit install`, so a role created after installation gets its grants on the next install.
-- ---------------------------------------------------------------------------------------------
CREATE FUNCTION pglockkit._grant_privileges() RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_user  boolean := EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'pglockkit_user');
    v_admin boolean := EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'pglockkit_admin');
    r       record;
BEGIN
    FOR r IN SELECT p.oid::regprocedure AS sig, p.proname
               FROM pg_catalog.pg_proc p
              WHERE p.pronamespace = 'pglockkit'::regnamespace
    LOOP
        EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', r.sig);
        CONTINUE WHEN r.proname = '_grant_privileges';
        IF pglockkit._admin_only(r.proname) THEN
            IF v_user THEN
                EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM pglockkit_user', r.sig);
            END IF;
            IF v_admin THEN
                EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO pglockkit_admin', r.sig);
            END IF;
        ELSIF v_user THEN
            EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO pglockkit_user', r.sig);
        END IF;
    END LOOP;
    GRANT USAGE ON SCHEMA pglockkit TO pg_monitor;
    GRANT SELECT ON pglockkit.namespaces TO pg_monitor;
    FOR r IN SELECT c.oid::regclass AS rel FROM pg_catalog.pg_class c
              WHERE c.relnamespace = 'pglockkit'::regnamespace AND c.relkind = 'v'
    LOOP
        EXECUTE pg_catalog.format('GRANT SELECT ON %s TO pg_monitor', r.rel);
    END LOOP;
    IF v_user THEN
        GRANT USAGE ON SCHEMA pglockkit TO pglockkit_user;
        GRANT SELECT ON pglockkit.namespaces TO pglockkit_user;
        FOR r IN SELECT c.oid::regclass AS rel FROM pg_catalog.pg_class c
                  WHERE c.relnamespace = 'pglockkit'::regnamespace AND c.relkind = 'v'
        LOOP
            EXECUTE pg_catalog.format('GRANT SELECT ON %s TO pglockkit_user', r.rel);
        END LOOP;
    END IF;
    IF v_admin THEN
        GRANT USAGE ON SCHEMA pglockkit TO pglockkit_admin;
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._grant_privileges() IS
    'Private: (re)applies pglockkit''s grants: EXECUTE to pglockkit_user (if it exists) except the admin-only functions, which go to pglockkit_admin (if it exists); nothing to PUBLIC; SELECT on views and the namespace registry to pg_monitor and pglockkit_user.';

-- The views call _advisory_label with the reader's privileges: monitoring roles need it too.
GRANT EXECUTE ON FUNCTION pglockkit._advisory_label(smallint, oid, oid) TO pg_monitor;

-- A read-only report: monitoring roles may run it too.
GRANT EXECUTE ON FUNCTION pglockkit.contention_report(interval) TO pg_monitor;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'pglockkit_admin') THEN
        BEGIN
            CREATE ROLE pglockkit_admin NOLOGIN;
        EXCEPTION
            WHEN insufficient_privilege THEN
                RAISE NOTICE 'pglockkit: cannot create role pglockkit_admin (no CREATEROLE); its grants are skipped until it exists';
            WHEN duplicate_object OR unique_violation THEN
                NULL;  -- another database's installer created it at the same moment
        END;
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'pglockkit_admin')
       AND EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'pglockkit_user') THEN
        BEGIN
            GRANT pglockkit_user TO pglockkit_admin;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'pglockkit: cannot grant pglockkit_user to pglockkit_admin; a DBA may: GRANT pglockkit_user TO pglockkit_admin';
        END;
    END IF;
END
$$;

CREATE FUNCTION pglockkit._admin_only(proname name) RETURNS boolean
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT proname = ANY ('{register_namespace,list_jobs,prune_jobs,prune_leases,prune_runs,retry_dead_jobs,sample,schedule,set_max_payload_bytes,unschedule,set_rate_limit,remove_rate_limit,pause_queue,resume_queue}'::name[]) $$;
COMMENT ON FUNCTION pglockkit._admin_only(name) IS
    'Private: true for the functions only pglockkit_admin may execute (they change what every worker works with or may store, or delete history).';

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;

-- More that the views call with the reader's privileges (0017): lock_waits and advisory_locks
-- _prepared_gid; run_history _advisory_held, and _run_key with what its body calls. Granted after
-- pglockkit_user's grants, in the order the migrations grant them.
GRANT EXECUTE ON FUNCTION pglockkit._prepared_gid(text) TO pg_monitor;
GRANT EXECUTE ON FUNCTION pglockkit._lock_ident(bigint, integer, integer) TO pg_monitor;
GRANT EXECUTE ON FUNCTION pglockkit._advisory_held(bigint, boolean), pglockkit._run_key(text, text),
    pglockkit._key(smallint, text), pglockkit._h47(text), pglockkit._ns_id_from_name(text) TO pg_monitor;
-- contention_report, which pg_monitor may run, checks its argument with _invalid_since.
GRANT EXECUTE ON FUNCTION pglockkit._invalid_since(interval) TO pg_monitor;
