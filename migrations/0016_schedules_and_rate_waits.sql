-- pglockkit 0016: what an adversarial review of schedules and rate limits found.
-- * schedule() checked its payload against max_payload_bytes alone, but each job carries it plus
--   "_schedule" (the name, up to 1024 bytes) and "_slot": a payload that fit while its jobs did
--   not was accepted, and every slot was then skipped (54000 at each tick), the limit unchanged.
--   It checks the payload as its jobs carry it, and refuses it up front (54000).
-- * schedule() read the clock before it locked the schedule's row: it now reads it after, so that
--   a tick that held the row meanwhile and enqueued slots up to its own clock is never followed by
--   a new definition starting before that clock (a slot enqueued twice).
-- * next_rate_token(queue): how long until a rate-limited key with due jobs gets its next token.
--   A worker whose claim came back empty slept its whole poll interval (nothing NOTIFYs when a
--   token comes), so a key limited to 10 a second ran at one job a second; and exit_when_idle
--   stopped with due jobs left that waited only for a token.

SET LOCAL search_path = pg_catalog, pg_temp;

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
