-- Back to the xact_lock_all of 0001 (no limit on the number of resources).

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
    RETURN pglockkit._xact_lock_all(ns, resources,
        ARRAY(SELECT pglockkit._key(v_id, r) FROM pg_catalog.unnest(resources) AS r), timeout);
END
$$;
COMMENT ON FUNCTION pglockkit.xact_lock_all(text, text[], interval) IS
    'Transaction-level locks on many resources, taken in ascending key order so that two callers can never deadlock on them; the timeout bounds the whole call (55P03). Returns the keys in the order taken.';

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
    RETURN pglockkit._xact_lock_all(ns,
        ARRAY(SELECT r::text FROM pg_catalog.unnest(resources) AS r),
        ARRAY(SELECT pglockkit._key(v_id, r) FROM pg_catalog.unnest(resources) AS r), timeout);
END
$$;
COMMENT ON FUNCTION pglockkit.xact_lock_all(text, bigint[], interval) IS
    'xact_lock_all on integer resources. See xact_lock_all(text, text[], interval).';
