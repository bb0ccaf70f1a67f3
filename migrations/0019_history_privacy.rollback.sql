-- Back to 0018: samples without roles (sample() and lock_history of 0007), the comments of 0005
-- and 0007, and the lock_rows of 0015.

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
    v_type     regtype;
BEGIN
    IF tbl IS NULL THEN
        RAISE EXCEPTION 'table must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF ids IS NULL OR pg_catalog.array_position(ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'ids must be an array without nulls' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    PERFORM pglockkit._check_timeout(timeout);
    SELECT a.atttypid INTO v_type
      FROM pg_catalog.pg_attribute a
     WHERE a.attrelid OPERATOR(pg_catalog.=) tbl AND a.attname OPERATOR(pg_catalog.=) 'id'
       AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'table % has no column "id"', tbl USING ERRCODE = 'undefined_column';
    END IF;
    -- regclass output is schema-qualified where needed and quoted: safe to splice in.
    v_sql := pg_catalog.format('SELECT 1 FROM %s WHERE id = $1 FOR UPDATE', tbl);
    v_deadline := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) timeout;
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
    'Locks rows of a table FOR UPDATE by their "id" column, in ascending id order, so that callers locking several rows cannot deadlock each other. The timeout bounds the whole call (55P03). Returns how many of the ids exist (and are now locked). Runs with the caller''s privileges.';

COMMENT ON VIEW pglockkit.advisory_locks IS
    'Every advisory lock held or awaited in this database: namespace (registered name, ''flyway'', ''int4 pair'' or ''unregistered''), key (bigint keys) or key1/key2 (int4 pairs), granted, pid, application, user, client, state and how long in it, a waiter''s wait time and the pids blocking it, the query. Columns from pg_stat_activity are NULL for sessions the reader may not see.';

COMMENT ON FUNCTION pglockkit.contention_report(interval) IS
    'Which advisory keys serialized the swarm over the last since: per key, in how many samples it had waiters, the most and average waiters, the longest wait and the holders'' queries; per namespace, the average sessions involved and the effective parallelism (sessions holding / sessions involved: 1.0 = nobody waits, 1/n = n sessions queue behind one).';

CREATE OR REPLACE FUNCTION pglockkit.sample(retention interval DEFAULT '7 days') RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now  timestamptz := pg_catalog.clock_timestamp();
    v_rows integer;
BEGIN
    IF retention IS NULL THEN
        RAISE EXCEPTION 'retention must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF retention OPERATOR(pg_catalog.<) interval '0' THEN
        RAISE EXCEPTION 'retention must not be negative, got %', retention USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO pglockkit.lock_samples (sampled_at, namespace, key, key1, key2, holders, waiters, longest_wait, holder_queries)
    SELECT v_now, al.namespace, al.key, al.key1, al.key2,
           pg_catalog.count(*) FILTER (WHERE al.granted), pg_catalog.count(*) FILTER (WHERE NOT al.granted),
           pg_catalog.max(al.wait_time),
           pg_catalog.array_agg(DISTINCT pg_catalog.left(al.query, 200)) FILTER (WHERE al.granted AND al.query IS NOT NULL)
      FROM pglockkit.advisory_locks al
     GROUP BY al.namespace, al.key, al.key1, al.key2;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    INSERT INTO pglockkit.queue_samples (sampled_at, queue, ready, running, oldest_ready_age)
    SELECT v_now, q.queue, q.ready, q.running, q.oldest_ready_age FROM pglockkit.queue_stats q;
    DELETE FROM pglockkit.lock_samples s WHERE s.sampled_at OPERATOR(pg_catalog.<) (v_now OPERATOR(pg_catalog.-) retention);
    DELETE FROM pglockkit.queue_samples s WHERE s.sampled_at OPERATOR(pg_catalog.<) (v_now OPERATOR(pg_catalog.-) retention);
    RETURN v_rows;
END
$$;
COMMENT ON FUNCTION pglockkit.sample(interval) IS
    'Records one snapshot of advisory-lock contention (per key: holders, waiters, longest wait, holders'' queries) and queue lag, and deletes samples older than retention; returns the lock rows recorded. Call it every few seconds: from pg_cron, or `pglockkit sample --every 5s`.';

-- The view stops reading holder_roles before the column goes; with the column gone its columns
-- are those of SELECT * again, as in 0007.
CREATE OR REPLACE VIEW pglockkit.lock_history AS
SELECT s.sampled_at, s.namespace, s.key, s.key1, s.key2, s.holders, s.waiters, s.longest_wait, s.holder_queries
  FROM pglockkit.lock_samples s;
ALTER TABLE pglockkit.lock_samples DROP COLUMN holder_roles;
CREATE OR REPLACE VIEW pglockkit.lock_history AS SELECT * FROM pglockkit.lock_samples;
COMMENT ON VIEW pglockkit.lock_history IS 'The advisory-lock samples recorded by sample(), one row per key per sample.';
COMMENT ON TABLE pglockkit.lock_samples IS
    'One row per advisory lock key per sample() call: holders, waiters, the longest wait and the holders'' queries. Read it through contention_report().';
