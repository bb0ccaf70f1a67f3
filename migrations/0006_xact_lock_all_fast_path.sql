-- pglockkit 0006: xact_lock_all tries the keys first (issue 16). With a valid (or no) timeout it
-- tries the keys in ascending order in a loop of its own; only a held key goes to the waiting
-- path (_xact_lock_all), which takes the whole set in ascending order as before (keys this
-- transaction already holds are taken again at once), checks the timeout, reads the namespace's
-- lock_timeout and names the holder. Same names, signatures, results, order, errors. A free set
-- of 4 locks cost 27 us of server time more than 4 bare locks in one statement, now 6 (PG 18).

SET LOCAL search_path = pg_catalog, pg_temp;

CREATE OR REPLACE FUNCTION pglockkit.xact_lock_all(ns text, resources text[], timeout interval DEFAULT NULL) RETURNS bigint[]
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
    IF pg_catalog.cardinality(resources) OPERATOR(pg_catalog.>) 1000 THEN
        RAISE EXCEPTION 'xact_lock_all takes at most 1000 resources, got %', pg_catalog.cardinality(resources)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Each lock takes an entry of the server''s shared lock table, which all sessions share: lock a coarser resource (their parent) instead.';
    END IF;
    -- Fast path: with a valid (or no) timeout, try the keys in ascending order; all free, done.
    -- At the first held key, the waiting path takes them all in ascending order again (a key
    -- this transaction holds is taken again at once), so the order, and with it the freedom from
    -- deadlocks, is the same. The waiting path checks the timeout, reads the namespace's
    -- lock_timeout and names the holder; a free set of locks pays for none of it.
    IF timeout IS NULL OR (timeout OPERATOR(pg_catalog.>) interval '0'
                           AND timeout OPERATOR(pg_catalog.<=) interval '24 days') THEN
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

CREATE OR REPLACE FUNCTION pglockkit.xact_lock_all(ns text, resources bigint[], timeout interval DEFAULT NULL) RETURNS bigint[]
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
    IF pg_catalog.cardinality(resources) OPERATOR(pg_catalog.>) 1000 THEN
        RAISE EXCEPTION 'xact_lock_all takes at most 1000 resources, got %', pg_catalog.cardinality(resources)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Each lock takes an entry of the server''s shared lock table, which all sessions share: lock a coarser resource (their parent) instead.';
    END IF;
    -- Fast path: with a valid (or no) timeout, try the keys in ascending order; all free, done.
    -- At the first held key, the waiting path takes them all in ascending order again (a key
    -- this transaction holds is taken again at once), so the order, and with it the freedom from
    -- deadlocks, is the same. The waiting path checks the timeout, reads the namespace's
    -- lock_timeout and names the holder; a free set of locks pays for none of it.
    IF timeout IS NULL OR (timeout OPERATOR(pg_catalog.>) interval '0'
                           AND timeout OPERATOR(pg_catalog.<=) interval '24 days') THEN
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

SELECT pglockkit._grant_privileges();
