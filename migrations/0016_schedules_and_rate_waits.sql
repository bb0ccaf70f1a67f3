-- pglockkit 0016: what an adversarial review of schedules and rate limits found.
-- * schedule() checked its payload against max_payload_bytes alone, but each job carries it plus
--   "_schedule" (the name, up to 1024 bytes) and "_slot": a payload that fit while its jobs did
--   not was accepted, and every slot was then skipped (54000 at each tick), the limit unchanged.
--   It checks the payload as its jobs carry it, and refuses it up front (54000).
-- * schedule() read the clock before it locked the schedule's row: it now reads it after, so that
--   a tick that held the row meanwhile and enqueued slots up to its own clock is never followed by
--   a new definition starting before that clock (a slot enqueued twice).
-- * A lock timeout with years in it ('-1 year 361 days') was checked as intervals compare (a year
--   360 days) and timed by its epoch (a year 365.25 days): timed as 1 ms, or over what the server
--   can time. It is timed as it compares (_timeout_span).
-- * lock_rows on a floating-point "id" column locked the row of 2^53 when asked for 2^53 + 1: such
--   a column is refused (42804).
-- * next_rate_token(queue): how long until a rate-limited key with due jobs gets its next token.
--   A worker whose claim came back empty slept its whole poll interval (nothing NOTIFYs when a
--   token comes), so a key limited to 10 a second ran at one job a second; and exit_when_idle
--   stopped with due jobs left that waited only for a token.

SET LOCAL search_path = pg_catalog, pg_temp;

CREATE FUNCTION pglockkit._timeout_span(timeout interval) RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    -- (OPERATOR() syntax has one precedence for all operators: the product is in parentheses.)
    SELECT pg_catalog.make_interval(secs => pg_catalog.date_part('epoch', timeout)
                                            OPERATOR(pg_catalog.-) (pg_catalog.date_part('year', timeout) OPERATOR(pg_catalog.*) 453600))
$$;
COMMENT ON FUNCTION pglockkit._timeout_span(interval) IS
    'Private: a timeout as the span its comparisons see (a month 30 days, a year 360): what a wait of that timeout lasts.';

CREATE OR REPLACE FUNCTION pglockkit._set_lock_timeout(timeout interval) RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    -- Whole milliseconds, at least 1: lock_timeout = 0 would mean "wait forever".
    SELECT pg_catalog.set_config('lock_timeout',
        (SELECT CASE WHEN ms < 1 THEN 1 ELSE ms END
           FROM (SELECT pg_catalog.ceil(pg_catalog.date_part('epoch', pglockkit._timeout_span(timeout)) OPERATOR(pg_catalog.*) 1000)::int8 AS ms) m
        )::text OPERATOR(pg_catalog.||) 'ms',
        true)
$$;
CREATE OR REPLACE FUNCTION pglockkit._xact_lock_all(ns text, labels text[], keys bigint[], timeout interval) RETURNS bigint[]
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
    v_deadline := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) pglockkit._timeout_span(v_timeout);
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
CREATE OR REPLACE FUNCTION pglockkit.lock_rows(tbl regclass, ids bigint[], timeout interval DEFAULT NULL) RETURNS integer
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
    IF v_kind OPERATOR(pg_catalog.<>) ALL ('{r,p,v,f}'::"char"[]) THEN
        RAISE EXCEPTION '% is %, not a table: lock_rows locks rows of a table, partitioned table, view or foreign table', tbl,
                        CASE WHEN v_kind = 'i' THEN 'an ' ELSE 'a ' END OPERATOR(pg_catalog.||) v_what
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
    v_deadline := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) pglockkit._timeout_span(timeout);
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
        v_found := v_found OPERATOR(pg_catalog.+) v_rows;
    END LOOP;
    IF v_deadline IS NOT NULL THEN
        PERFORM pg_catalog.set_config('lock_timeout', v_prev, true);
    END IF;
    RETURN v_found;
END
$$;
COMMENT ON FUNCTION pglockkit.lock_rows(regclass, bigint[], interval) IS
    'Locks rows of a table (or partitioned table, simple view, foreign table) FOR UPDATE by their "id" column, in ascending id order, so that callers locking several rows cannot deadlock each other. The timeout bounds the whole call (55P03). Returns how many of the ids exist (and are now locked). Another kind of relation, or a view whose rows cannot be locked, is 42809; no "id" column 42703; an "id" that is not a number, or a floating-point one, 42804; an id outside the column''s type 22003. Runs with the caller''s privileges.';

CREATE OR REPLACE FUNCTION pglockkit.schedule(
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
SELECT pglockkit._grant_privileges();
