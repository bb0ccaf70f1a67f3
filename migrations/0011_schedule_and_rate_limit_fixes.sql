-- pglockkit 0011: three defects an adversarial review found in schedules and rate limits.
-- - A tick that could not enqueue a schedule's due slots moved its next_run with the cron read in
--   UTC, not in the schedule's time zone, so slots that were not due yet were lost too (e.g.
--   hourly business hours in Tokyo lost the rest of the day).
-- - schedule() replacing a schedule whose old definition could not enqueue its due slots failed
--   on them, so the fix (a smaller payload) could not be stored until someone ticked. It now
--   skips them as a tick does, with a WARNING and last_error.
-- - set_rate_limit checked per as an interval (a year is 360 days there) but computed the step
--   in seconds (365.25 days): '-1 year +365 days 6 hours' stored a step of 0 (every claim of the
--   queue and the rate_limits view then divided by zero) and '-1 year +361 days' a negative one
--   (no limit). per is now checked in seconds. A limit stored with such a per should be set again.

SET LOCAL search_path = pg_catalog, pg_temp;

CREATE OR REPLACE FUNCTION pglockkit._tick(as_of timestamptz, guarded boolean) RETURNS integer
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
    IF pg_catalog.pg_column_size(schedule.payload) > 4096 OR pg_catalog.pg_column_compression(schedule.payload) IS NOT NULL THEN
        PERFORM pglockkit._check_payloads(ARRAY[schedule.payload]);
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
        v_now := pg_catalog.clock_timestamp();
        SELECT * INTO v_old FROM pglockkit.job_schedules j WHERE j.name = schedule.name FOR UPDATE;
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

CREATE OR REPLACE FUNCTION pglockkit.set_rate_limit(queue text, key text, rate integer, per interval, burst integer DEFAULT 1)
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

SELECT pglockkit._grant_privileges();
