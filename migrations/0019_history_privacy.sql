-- pglockkit 0019: contention history shows each reader only the queries it may see live; the
-- live view's comment says what an unseen session shows; lock_rows names what it cannot lock.
--
-- sample() is SECURITY DEFINER: it reads pg_stat_activity with the installer's visibility (a
-- superuser's, often) and recorded every holder's query. lock_history and contention_report then
-- showed those queries to every pglockkit_user, although advisory_locks shows them
-- '<insufficient privilege>' live. sample() now records, next to each query, the role of the
-- session that ran it (holder_roles, aligned with holder_queries), and lock_history applies
-- pg_stat_activity's own rule when it is read: a query is shown to a reader that has the
-- privileges of the holder's role or of pg_read_all_stats, else it reads
-- '<insufficient privilege>'. contention_report reads lock_history, so it follows. Samples
-- recorded before 0019 have no roles: their queries are shown to pg_read_all_stats only.
--
-- advisory_locks said that user, state and query are NULL for sessions the reader may not see.
-- Like pg_stat_activity it shows their user and application, NULL for client, state and
-- state_age, and '<insufficient privilege>' as the query: the comment now says so.
--
-- lock_rows failed on relations whose rows it cannot lock with the server's bare errors: 42703
-- for a sequence, 42809 for an index, a composite type or a materialized view, 0A000 for a view
-- with an aggregate, 22003 for an oid id over 2^32 - 1. It now checks the relation's kind up
-- front (tables, partitioned tables, views and foreign tables only, else 42809 naming its kind),
-- turns a view whose rows cannot be locked into 42809 too, an id outside the id column's type into
-- 22003 naming the id, table and type, and an OID that names no relation into 42P01.

ALTER TABLE pglockkit.lock_samples ADD COLUMN holder_roles oid[];
COMMENT ON TABLE pglockkit.lock_samples IS
    'One row per advisory lock key per sample() call: holders, waiters, the longest wait, the holders'' queries and, aligned with them, the roles of the sessions that ran them. Readers get it through lock_history and contention_report(), which show a query only to whom pg_stat_activity would.';
COMMENT ON COLUMN pglockkit.lock_samples.holder_roles IS
    'The role (pg_stat_activity.usesysid) of the session that ran holder_queries[i]; NULL in samples recorded before 0019.';

CREATE OR REPLACE VIEW pglockkit.lock_history AS
SELECT s.sampled_at, s.namespace, s.key, s.key1, s.key2, s.holders, s.waiters, s.longest_wait,
       -- pg_stat_activity's rule (HAS_PGSTAT_PERMISSIONS), applied to the reader of the history.
       (SELECT pg_catalog.array_agg(DISTINCT
                   CASE WHEN pg_catalog.pg_has_role(CURRENT_USER, 'pg_read_all_stats'::name, 'USAGE')
                          OR pg_catalog.pg_has_role(CURRENT_USER, q.role, 'USAGE')
                        THEN q.query ELSE '<insufficient privilege>' END)
          FROM ROWS FROM (pg_catalog.unnest(s.holder_queries), pg_catalog.unnest(s.holder_roles)) AS q(query, role)) AS holder_queries
  FROM pglockkit.lock_samples s;
COMMENT ON VIEW pglockkit.lock_history IS
    'The advisory-lock samples recorded by sample(), one row per key per sample. A holder''s query reads ''<insufficient privilege>'' unless the reader has the privileges of the holder''s role or of pg_read_all_stats: the rule of pg_stat_activity, so history never shows what the live view would hide.';

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
    -- One row per (key, query, role) pair is kept as "first" so that the two aggregates below
    -- list each pair once, in the same order: holder_queries[i] was run by holder_roles[i].
    -- pg_stat_activity is one snapshot per transaction: the view and the join agree on each pid.
    INSERT INTO pglockkit.lock_samples (sampled_at, namespace, key, key1, key2, holders, waiters, longest_wait,
                                        holder_queries, holder_roles)
    SELECT v_now, h.namespace, h.key, h.key1, h.key2,
           pg_catalog.count(*) FILTER (WHERE h.granted), pg_catalog.count(*) FILTER (WHERE NOT h.granted),
           pg_catalog.max(h.wait_time),
           pg_catalog.array_agg(h.query ORDER BY h.query, h.role) FILTER (WHERE h.granted AND h.query IS NOT NULL AND h.first),
           pg_catalog.array_agg(h.role ORDER BY h.query, h.role) FILTER (WHERE h.granted AND h.query IS NOT NULL AND h.first)
      FROM (SELECT al.namespace, al.key, al.key1, al.key2, al.granted, al.wait_time, x.query, a.usesysid AS role,
                   pg_catalog.row_number() OVER (PARTITION BY al.namespace, al.key, al.key1, al.key2, al.granted, x.query, a.usesysid)
                       OPERATOR(pg_catalog.=) 1 AS first
              FROM pglockkit.advisory_locks al
              LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) al.pid
              CROSS JOIN LATERAL (SELECT pg_catalog.left(al.query, 200) AS query) x) h
     GROUP BY h.namespace, h.key, h.key1, h.key2;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    INSERT INTO pglockkit.queue_samples (sampled_at, queue, ready, running, oldest_ready_age)
    SELECT v_now, q.queue, q.ready, q.running, q.oldest_ready_age FROM pglockkit.queue_stats q;
    DELETE FROM pglockkit.lock_samples s WHERE s.sampled_at OPERATOR(pg_catalog.<) (v_now OPERATOR(pg_catalog.-) retention);
    DELETE FROM pglockkit.queue_samples s WHERE s.sampled_at OPERATOR(pg_catalog.<) (v_now OPERATOR(pg_catalog.-) retention);
    RETURN v_rows;
END
$$;
COMMENT ON FUNCTION pglockkit.sample(interval) IS
    'Records one snapshot of advisory-lock contention (per key: holders, waiters, longest wait, holders'' queries and their roles) and queue lag, and deletes samples older than retention; returns the lock rows recorded. Runs as the installing role; lock_history shows each reader only the queries it could see live. Call it every few seconds: from pg_cron, or `pglockkit sample --every 5s`.';

COMMENT ON FUNCTION pglockkit.contention_report(interval) IS
    'Which advisory keys serialized the swarm over the last since: per key, in how many samples it had waiters, the most and average waiters, the longest wait and the holders'' queries (read from lock_history: a query the reader could not see live reads ''<insufficient privilege>''); per namespace, the average sessions involved and the effective parallelism (sessions holding / sessions involved: 1.0 = nobody waits, 1/n = n sessions queue behind one).';

COMMENT ON VIEW pglockkit.advisory_locks IS
    'Every advisory lock held or awaited in this database: namespace (registered name, ''flyway'', ''int4 pair'' or ''unregistered''), key (bigint keys) or key1/key2 (int4 pairs), granted, pid, application, user, client, state and how long in it, a waiter''s wait time and the pids blocking it, the query. For a session the reader may not see (pg_stat_activity''s rule: neither the privileges of its role nor of pg_read_all_stats), user and application are shown, client, state and state_age are NULL, and the query reads ''<insufficient privilege>''.';

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
             ON a.attrelid OPERATOR(pg_catalog.=) c.oid AND a.attname OPERATOR(pg_catalog.=) 'id'
            AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped
     WHERE c.oid OPERATOR(pg_catalog.=) tbl;
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
                        CASE WHEN v_kind OPERATOR(pg_catalog.=) 'i' THEN 'an ' ELSE 'a ' END OPERATOR(pg_catalog.||) v_what
            USING ERRCODE = 'wrong_object_type';
    END IF;
    IF v_type IS NULL THEN
        RAISE EXCEPTION '% % has no column "id"', v_what, tbl USING ERRCODE = 'undefined_column',
            HINT = 'lock_rows locks rows by their "id" column; for other keys: SELECT ... ORDER BY key FOR UPDATE.';
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
    'Locks rows of a table (or partitioned table, simple view, foreign table) FOR UPDATE by their "id" column, in ascending id order, so that callers locking several rows cannot deadlock each other. The timeout bounds the whole call (55P03). Returns how many of the ids exist (and are now locked). Another kind of relation, or a view whose rows cannot be locked, is 42809; no "id" column 42703; an "id" that is not a number 42804; an id outside the column''s type 22003. Runs with the caller''s privileges.';
