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

-- ---------------------------------------------------------------------------------------------
-- Fencing tokens (leases, job claims): the epoch in bits 47-62, a sequence's value in bits 0-46.
-- The epoch is the server's timeline less 1 (0 on a cluster never promoted, whose tokens are the
-- sequence's values as before), which grows at every promotion of a standby (and at every
-- point-in-time recovery). A promotion carries each sequence on from the last value that was
-- WAL-logged (a sequence logs about 32 values ahead) and reached the standby; with asynchronous
-- replication, whatever the old primary handed out past it was handed out again. Under the new
-- timeline every token is above every token of the old one, so none repeats. The timeline is the
-- one WAL is written on now: pg_walfile_name(pg_current_wal_lsn()) names it from the promotion
-- on, where pg_control_checkpoint()'s lags until the first checkpoint after it. 16 bits of epoch
-- keep tokens positive bigints (a timeline past 65536 is refused), 47 of sequence are 1.4e14
-- tokens per epoch (the sequences stop there, 2200H, rather than run into the epoch's bits).
-- ---------------------------------------------------------------------------------------------
CREATE FUNCTION pglockkit._timeline_too_large(timeline bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'timeline % is past the 65536 that fencing tokens can carry', timeline
        USING ERRCODE = 'program_limit_exceeded';
END
$$;
COMMENT ON FUNCTION pglockkit._timeline_too_large(bigint) IS
    'Private: raises 54000 for a timeline that fencing tokens cannot carry (bits 47-62).';

CREATE FUNCTION pglockkit._token_epoch() RETURNS bigint
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    -- One expression (the timeline read twice), so that it is inlined into the caller's.
    SELECT CASE WHEN ('x' || pg_catalog.substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))
                     ::bit(32)::bigint <= 65536
                THEN (('x' || pg_catalog.substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))
                      ::bit(32)::bigint - 1) << 47
                ELSE pglockkit._timeline_too_large(
                         ('x' || pg_catalog.substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))
                         ::bit(32)::bigint) END;
END;
COMMENT ON FUNCTION pglockkit._token_epoch() IS
    'Private: the current timeline less 1, shifted into the epoch bits of a fencing token (47-62): 0 on a cluster never promoted.';

CREATE FUNCTION pglockkit._next_token(seq regclass, previous bigint) RETURNS bigint
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    -- The epoch never goes down for a name: a dump restored into a new cluster starts again at
    -- timeline 1, but its sequences carry on from the dump, so the previous token's epoch above
    -- the sequence's next value is still above the previous token.
    SELECT GREATEST(pglockkit._token_epoch(), (previous >> 47) << 47) | pg_catalog.nextval(seq);
END;
COMMENT ON FUNCTION pglockkit._next_token(regclass, bigint) IS
    'Private: a new fencing token: the larger of the current epoch and that of previous (the token it replaces, or NULL), above the next value of seq.';

-- The kit's own namespace (installer mutex and other internal locks).
INSERT INTO pglockkit.namespaces (id, name, description)
VALUES (pglockkit._ns_id_from_name('pglockkit'), 'pglockkit', 'pglockkit''s own locks (the installer''s mutex, ...)');
