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

-- client_min_messages: pg_advisory_unlock of a lock this session does not hold sends its own
-- WARNING ("you don't own a lock of type ExclusiveLock") before returning false; the caller gets
-- the 55000 below, which says what happened, and nothing else. Looking in pg_locks first instead
-- would read every lock of the server on each unlock.
CREATE FUNCTION pglockkit._unlock(ns text, label text, key bigint) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET client_min_messages = error
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
