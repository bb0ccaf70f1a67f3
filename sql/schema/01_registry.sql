-- Registry and keys: the schema, the namespace registry and the lock-key formula
--
-- The current definition of each object, once. A change edits this file and adds a delta
-- migration (see CONTRIBUTING.md); a test checks that both build the same schema.

CREATE SCHEMA pglockkit;
COMMENT ON SCHEMA pglockkit IS
    'pglockkit: coordination primitives (namespaced advisory locks, job queue, leases, singleton runs, monitoring). Call the functions; the tables are private.';

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
    CONSTRAINT namespaces_lock_timeout_max CHECK (lock_timeout OPERATOR(pg_catalog.<=) interval '24 days')
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
    SELECT n.id INTO v_id FROM pglockkit.namespaces n WHERE n.name = ns;
    IF v_id IS NULL THEN
        RAISE EXCEPTION 'unknown lock namespace "%"', ns
            USING ERRCODE = 'undefined_object', SCHEMA = 'pglockkit', TABLE = 'namespaces',
                  HINT = pg_catalog.format('Register it first: SELECT pglockkit.register_namespace(%L);', ns);
    END IF;
    RETURN v_id;
END
$$;
COMMENT ON FUNCTION pglockkit._ns_id(text) IS
    'Private: the id of a registered namespace; 22004 for NULL, 42704 for an unknown name (its TABLE field says namespaces).';

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
    IF resource < 0 OR resource OPERATOR(pg_catalog.>=) (1::int8 OPERATOR(pg_catalog.<<) 47) THEN
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
    SELECT n.id INTO v_id FROM pglockkit.namespaces n WHERE n.name = ns;
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
    SELECT CASE WHEN key > 0 THEN (key OPERATOR(pg_catalog.>>) 48)::int4 END,
           (SELECT n.name FROM pglockkit.namespaces n
             WHERE key > 0 AND n.id OPERATOR(pg_catalog.=) (key OPERATOR(pg_catalog.>>) 48)::int4),
           CASE WHEN key <= 0 THEN 'foreign'
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

    SELECT n.id INTO v_id FROM pglockkit.namespaces n WHERE n.name = register_namespace.name;
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

-- The kit's own namespace (installer mutex and other internal locks).
INSERT INTO pglockkit.namespaces (id, name, description)
VALUES (pglockkit._ns_id_from_name('pglockkit'), 'pglockkit', 'pglockkit''s own locks (the installer''s mutex, ...)');
