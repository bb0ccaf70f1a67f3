-- pglockkit 0014: xact_lock_all takes at most 1,000 resources per call.
--
-- Every advisory lock a transaction holds is an entry of the server's shared lock table, which is
-- sized for max_locks_per_transaction x (max_connections + max_prepared_transactions) entries
-- (about 6,400 with the defaults) and shared by every session. One xact_lock_all over 20,000
-- resources filled it: the call failed with 53200 (out of shared memory), and while it ran, any
-- other session that needed a lock of any kind, a table's included, could fail the same way. A
-- call over 1,000 resources is now refused before any lock is taken, with 22023 and a hint.

CREATE OR REPLACE FUNCTION pglockkit.xact_lock_all(ns text, resources text[], timeout interval DEFAULT NULL) RETURNS bigint[]
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
    RETURN pglockkit._xact_lock_all(ns, resources,
        ARRAY(SELECT pglockkit._key(v_id, r) FROM pg_catalog.unnest(resources) AS r), timeout);
END
$$;

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
        ARRAY(SELECT pglockkit._key(v_id, r) FROM pg_catalog.unnest(resources) AS r), timeout);
END
$$;

COMMENT ON FUNCTION pglockkit.xact_lock_all(text, text[], interval) IS
    'Transaction-level locks on many resources (at most 1000, 22023 otherwise), taken in ascending key order so that two callers can never deadlock on them; the timeout bounds the whole call (55P03). Returns the keys in the order taken.';
