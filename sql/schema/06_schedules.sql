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
