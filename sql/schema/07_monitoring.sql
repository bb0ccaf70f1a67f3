-- Monitoring: views over pg_locks and pg_stat_activity, queue health, contention history
--
-- The current definition of each object, once. A change edits this file and adds a delta
-- migration (see CONTRIBUTING.md); a test checks that both build the same schema.

-- (Before the tables: an index of lock_sightings uses it.)
-- One bigint per advisory lock of advisory_locks (its key, or its int4 pair's two halves; which of
-- the two is key IS NULL): an equality the planner can hash, where IS NOT DISTINCT FROM on three
-- columns made sample() compare every sighting with every lock held (300 ms at 1,000 locks) (0017).
CREATE FUNCTION pglockkit._lock_ident(key bigint, key1 integer, key2 integer) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT coalesce(key, (key1::int8 << 32) | (key2::int8 & 4294967295));
END;
COMMENT ON FUNCTION pglockkit._lock_ident(bigint, integer, integer) IS
    'Private: one bigint for an advisory lock of advisory_locks: its key, or its int4 pair (key1, key2) packed (tell the two apart by key IS NULL). Inlined.';

CREATE TABLE pglockkit.lock_samples (
    sampled_at     timestamptz NOT NULL,
    namespace      text        NOT NULL,
    key            bigint,
    key1           integer,
    key2           integer,
    holders        integer     NOT NULL,
    waiters        integer     NOT NULL,
    longest_wait   interval,
    holder_queries text[],
    holder_roles   oid[]
);
COMMENT ON TABLE pglockkit.lock_samples IS
    'One row per advisory lock key per sample() call: holders, waiters, the longest wait, the holders'' queries and, aligned with them, the roles of the sessions that ran them. Readers get it through lock_history and contention_report(), which show a query only to whom pg_stat_activity would.';
COMMENT ON COLUMN pglockkit.lock_samples.holder_roles IS
    'The role (pg_stat_activity.usesysid) of the session that ran holder_queries[i]; NULL for a query whose session''s role was not recorded.';

CREATE INDEX lock_samples_time ON pglockkit.lock_samples (sampled_at);

CREATE TABLE pglockkit.queue_samples (
    sampled_at       timestamptz NOT NULL,
    queue            text        NOT NULL,
    ready            bigint      NOT NULL,
    running          bigint      NOT NULL,
    oldest_ready_age interval
);
COMMENT ON TABLE pglockkit.queue_samples IS 'Queue depth and lag per sample() call.';

CREATE INDEX queue_samples_time ON pglockkit.queue_samples (sampled_at);

-- How long a lock has been held: pg_locks does not say, and a session's state age restarts at
-- each of its transactions (a session lock leaked on a busy pooled server session never looks
-- idle for long). sample() keeps, per session and advisory lock it holds, when it first saw it
-- held; a lock no longer held at a sample is forgotten (0017).
CREATE TABLE pglockkit.lock_sightings (
    pid           integer     NOT NULL,
    backend_start timestamptz NOT NULL,
    namespace     text        NOT NULL,
    key           bigint,
    key1          integer,
    key2          integer,
    first_seen    timestamptz NOT NULL,
    last_seen     timestamptz NOT NULL
);
COMMENT ON TABLE pglockkit.lock_sightings IS
    'Per session (pid and backend_start) and advisory lock it holds: the first and the last sample() that saw it held. Read it through lock_holds.';
-- lock_holds looks each held lock up by its session and key.
CREATE INDEX lock_sightings_lock ON pglockkit.lock_sightings (pid, pglockkit._lock_ident(key, key1, key2));

-- When sample() last ran: hold times and the history are only as fresh as that, and a sampler
-- that stopped (a removed pod, a disabled pg_cron job) left no other trace (0017).
CREATE TABLE pglockkit.sampler (
    one             boolean     PRIMARY KEY DEFAULT true CHECK (one),
    last_sampled_at timestamptz NOT NULL
);
COMMENT ON TABLE pglockkit.sampler IS
    'One row once sample() has run: when it last ran. Read it through sampling.';
CREATE FUNCTION pglockkit._advisory_label(objsubid smallint, classid oid, objid oid) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE
        WHEN objsubid = 2 THEN 'int4 pair'
        WHEN k.key = 72707369 THEN 'flyway'   -- Flyway's migration lock
        WHEN k.key <= 0 THEN 'unregistered'
        ELSE coalesce((SELECT n.name FROM pglockkit.namespaces n
                        WHERE n.id = (k.key >> 48)::int4), 'unregistered')
    END
    FROM (SELECT (classid::int8 << 32) | objid::int8 AS key) k
$$;
COMMENT ON FUNCTION pglockkit._advisory_label(smallint, oid, oid) IS
    'Private: the namespace name of an advisory lock in pg_locks: the registered name, ''flyway'' for Flyway''s key, ''int4 pair'' for two-int keys, else ''unregistered''.';

-- A prepared transaction holds its locks with no session (pid NULL); its locks share a
-- virtualtransaction with the lock it holds on its own xid, which pg_prepared_xacts names (0017).
CREATE FUNCTION pglockkit._prepared_gid(virtualtransaction text) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT p.gid
      FROM pg_catalog.pg_locks x
      JOIN pg_catalog.pg_prepared_xacts p ON p.transaction = x.transactionid
     WHERE x.pid IS NULL AND x.locktype = 'transactionid'
       AND x.virtualtransaction = _prepared_gid.virtualtransaction
     LIMIT 1
$$;
COMMENT ON FUNCTION pglockkit._prepared_gid(text) IS
    'Private: the gid of the prepared transaction whose locks pg_locks lists under this virtualtransaction (NULL if none).';

CREATE FUNCTION pglockkit.sample(retention interval DEFAULT '7 days') RETURNS integer
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
    IF retention < interval '0' THEN
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
                       = 1 AS first
              FROM pglockkit.advisory_locks al
              LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = al.pid
              CROSS JOIN LATERAL (SELECT pg_catalog.left(al.query, 200) AS query) x) h
     GROUP BY h.namespace, h.key, h.key1, h.key2;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    -- Hold times (0017). Samplers take turns, so that two never add the same sighting. A sighting
    -- is its session's (pid, backend_start) and the key: the namespace is a label, read from the
    -- registry, which may change while the lock is held.
    PERFORM pg_catalog.pg_advisory_xact_lock(pglockkit._key(pglockkit._ns_id_from_name('pglockkit'), 'sample'));
    INSERT INTO pglockkit.sampler AS s (one, last_sampled_at) VALUES (true, v_now)
    ON CONFLICT (one) DO UPDATE SET last_sampled_at = excluded.last_sampled_at;
    -- Rewritten whole at each sample: the locks held now, each with the first_seen of its sighting
    -- if it had one. A FULL JOIN can only hash or merge, where the planner, estimating one row for
    -- the locks (a function's), compared every sighting with every lock (300 ms at 1,000 locks).
    WITH held AS (
        SELECT DISTINCT al.pid, coalesce(a.backend_start, '-infinity') AS backend_start,
               al.namespace, al.key, al.key1, al.key2,
               pglockkit._lock_ident(al.key, al.key1, al.key2) AS ident, al.key IS NULL AS pair
          FROM pglockkit.advisory_locks al
          LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = al.pid
         WHERE al.granted AND al.pid IS NOT NULL
           AND al.pid <> pg_catalog.pg_backend_pid()  -- not the turn taken above
    ), seen AS (
        SELECT h.pid, h.backend_start, h.namespace, h.key, h.key1, h.key2, s.first_seen
          FROM held h
          FULL JOIN pglockkit.lock_sightings s
            ON h.pid = s.pid AND h.backend_start = s.backend_start
           AND h.ident = pglockkit._lock_ident(s.key, s.key1, s.key2) AND h.pair = (s.key IS NULL)
    ), cleared AS (
        DELETE FROM pglockkit.lock_sightings
    )
    INSERT INTO pglockkit.lock_sightings (pid, backend_start, namespace, key, key1, key2, first_seen, last_seen)
    SELECT n.pid, n.backend_start, n.namespace, n.key, n.key1, n.key2, coalesce(n.first_seen, v_now), v_now
      FROM seen n
     WHERE n.pid IS NOT NULL;  -- a sighting whose lock is no longer held is forgotten
    INSERT INTO pglockkit.queue_samples (sampled_at, queue, ready, running, oldest_ready_age)
    SELECT v_now, q.queue, q.ready, q.running, q.oldest_ready_age FROM pglockkit.queue_stats q;
    DELETE FROM pglockkit.lock_samples s WHERE s.sampled_at < (v_now - retention);
    DELETE FROM pglockkit.queue_samples s WHERE s.sampled_at < (v_now - retention);
    RETURN v_rows;
END
$$;
COMMENT ON FUNCTION pglockkit.sample(interval) IS
    'Records one snapshot of advisory-lock contention (per key: holders, waiters, longest wait, holders'' queries and their roles) and queue lag, and deletes samples older than retention; returns the lock rows recorded. It also keeps, per session and lock it holds, when a sample first saw it held (lock_holds), and forgets what is no longer held. Runs as the installing role; lock_history shows each reader only the queries it could see live. Call it every few seconds: from pg_cron, or `pglockkit sample --every 5s`.';

-- A NULL since (an unset parameter) matched no sample: an empty report, as if nothing contended.
CREATE FUNCTION pglockkit._invalid_since(since interval) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF since IS NULL THEN
        RAISE EXCEPTION 'since must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF since < interval '0' THEN
        RAISE EXCEPTION 'since must not be negative, got %', since USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pglockkit._invalid_since(interval) IS
    'Private: NULL for a since contention_report accepts; raises 22004 for NULL, 22023 for a negative one.';

CREATE VIEW pglockkit.advisory_locks AS
SELECT CASE WHEN l.objsubid OPERATOR(pg_catalog.=) 2 THEN 'int4 pair'
            WHEN l.classid::int8 OPERATOR(pg_catalog.=) 0 AND l.objid::int8 OPERATOR(pg_catalog.=) 72707369 THEN 'flyway'
            ELSE coalesce(n.name, 'unregistered') END AS namespace,
       CASE WHEN l.objsubid OPERATOR(pg_catalog.=) 1
            THEN (l.classid::int8 OPERATOR(pg_catalog.<<) 32) OPERATOR(pg_catalog.|) l.objid::int8 END AS key,
       CASE WHEN l.objsubid OPERATOR(pg_catalog.=) 2
            THEN (l.classid::int8 OPERATOR(pg_catalog.-) CASE WHEN l.classid::int8 OPERATOR(pg_catalog.>) 2147483647 THEN 4294967296 ELSE 0 END)::int4 END AS key1,
       CASE WHEN l.objsubid OPERATOR(pg_catalog.=) 2
            THEN (l.objid::int8 OPERATOR(pg_catalog.-) CASE WHEN l.objid::int8 OPERATOR(pg_catalog.>) 2147483647 THEN 4294967296 ELSE 0 END)::int4 END AS key2,
       l.granted, l.mode, l.pid,
       a.application_name, a.usename AS "user", a.client_addr, a.state,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) a.state_change AS state_age,
       CASE WHEN NOT l.granted THEN pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) l.waitstart END AS wait_time,
       CASE WHEN NOT l.granted THEN pg_catalog.pg_blocking_pids(l.pid) END AS blocked_by,
       a.query,
       CASE WHEN l.pid IS NULL THEN pglockkit._prepared_gid(l.virtualtransaction) END AS prepared_gid
  FROM pg_catalog.pg_locks l
  LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) l.pid
  -- The namespace of a positive bigint key is its top 16 bits: classid >> 16 (key >> 48).
  LEFT JOIN pglockkit.namespaces n
         ON l.objsubid OPERATOR(pg_catalog.=) 1
        AND ((l.classid::int8 OPERATOR(pg_catalog.<<) 32) OPERATOR(pg_catalog.|) l.objid::int8) OPERATOR(pg_catalog.>) 0
        AND n.id OPERATOR(pg_catalog.=) (l.classid::int8 OPERATOR(pg_catalog.>>) 16)::int4
 WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory'
   AND l.database OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database d
                                           WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database());
COMMENT ON VIEW pglockkit.advisory_locks IS
    'Every advisory lock held or awaited in this database: namespace (registered name, ''flyway'', ''int4 pair'' or ''unregistered''), key (bigint keys) or key1/key2 (int4 pairs), granted, pid, application, user, client, state and how long in it, a waiter''s wait time and the pids blocking it, the query. For a session the reader may not see (pg_stat_activity''s rule: neither the privileges of its role nor of pg_read_all_stats), user and application are shown, client, state and state_age are NULL, and the query reads ''<insufficient privilege>''. A lock of a prepared transaction has no pid and no session; prepared_gid names the transaction (COMMIT PREPARED or ROLLBACK PREPARED it).';

-- The waiters are the sessions of this database with a lock not granted in pg_locks, which every
-- reader sees (pg_stat_activity's wait_event_type is NULL for another role's session, unless the
-- reader has pg_read_all_stats), and decoded with this database's registry and catalog (0014).
CREATE VIEW pglockkit.lock_waits AS
WITH RECURSIVE waiting AS (
    SELECT a.pid, pg_catalog.pg_blocking_pids(a.pid) AS blocked_by
      FROM pg_catalog.pg_stat_activity a
     WHERE a.datid OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database d
                                            WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
       AND EXISTS (SELECT FROM pg_catalog.pg_locks l
                    WHERE l.pid OPERATOR(pg_catalog.=) a.pid AND NOT l.granted)
), up (pid, blocker, depth) AS (
    SELECT w.pid, b.blocker, 1 FROM waiting w, pg_catalog.unnest(w.blocked_by) AS b(blocker)
    UNION
    SELECT u.pid, b.blocker, u.depth OPERATOR(pg_catalog.+) 1
      FROM up u JOIN waiting w ON w.pid OPERATOR(pg_catalog.=) u.blocker, pg_catalog.unnest(w.blocked_by) AS b(blocker)
     WHERE u.depth OPERATOR(pg_catalog.<) 100
), roots AS (
    -- The blockers at the top of each chain: not waiting themselves.
    SELECT u.pid, pg_catalog.min(u.blocker) AS root
      FROM up u
     WHERE NOT EXISTS (SELECT FROM waiting w WHERE w.pid OPERATOR(pg_catalog.=) u.blocker
                                                AND pg_catalog.cardinality(w.blocked_by) OPERATOR(pg_catalog.>) 0)
     GROUP BY u.pid
)
SELECT w.pid, w.blocked_by, r.root AS root_blocker,
       (SELECT pg_catalog.count(*) FROM roots r2 WHERE r2.root OPERATOR(pg_catalog.=) r.root) AS sessions_behind_root,
       l.locktype, l.mode,
       CASE WHEN l.locktype OPERATOR(pg_catalog.=) 'advisory' THEN pglockkit._advisory_label(l.objsubid, l.classid, l.objid) END AS namespace,
       l.relation::regclass AS relation,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) l.waitstart AS wait_time,
       a.application_name, a.usename AS "user", a.query,
       -- pg_blocking_pids names a prepared transaction 0: which ones hold what this session wants.
       CASE WHEN 0 OPERATOR(pg_catalog.=) ANY (w.blocked_by) THEN
           ARRAY(SELECT DISTINCT g.gid
                   FROM pg_catalog.pg_locks h,
                        LATERAL (SELECT pglockkit._prepared_gid(h.virtualtransaction) AS gid) g
                  WHERE h.pid IS NULL AND h.granted AND g.gid IS NOT NULL
                    AND (h.locktype, h.database, h.relation, h.page, h.tuple, h.virtualxid, h.transactionid,
                         h.classid, h.objid, h.objsubid)
                        IS NOT DISTINCT FROM
                        (l.locktype, l.database, l.relation, l.page, l.tuple, l.virtualxid, l.transactionid,
                         l.classid, l.objid, l.objsubid)
                  ORDER BY g.gid)
       END AS prepared_blockers
  FROM waiting w
  JOIN pg_catalog.pg_locks l ON l.pid OPERATOR(pg_catalog.=) w.pid AND NOT l.granted
  LEFT JOIN roots r ON r.pid OPERATOR(pg_catalog.=) w.pid
  LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) w.pid
 WHERE pg_catalog.cardinality(w.blocked_by) OPERATOR(pg_catalog.>) 0;
COMMENT ON VIEW pglockkit.lock_waits IS
    'Every session of this database waiting on a lock of any type: its blockers, the root blocker of its chain (a session that is not itself waiting) and how many sessions wait behind that root, the lock (namespace for advisory locks, relation otherwise), and how long it has waited. A blocker 0 is a prepared transaction (pg_blocking_pids): prepared_blockers names those that hold the lock the session waits for (their gids; NULL when no blocker is 0).';

-- dedicated: the connections pglockkit's clients open to hold one session lock while the caller's
-- block runs (sole_writer, run_once and `pglockkit once`, a session-bound Lease) idle by design;
-- they are known by the application_name those clients give them (0017).
CREATE VIEW pglockkit.idle_lock_holders AS
SELECT al.namespace, al.key, al.key1, al.key2, al.pid, al.application_name, al."user", al.client_addr,
       al.state, al.state_age AS idle_for, al.query AS last_query,
       coalesce(al.application_name OPERATOR(pg_catalog.~) '^pglockkit (sole_writer|run|lease) ', false) AS dedicated
  FROM pglockkit.advisory_locks al
 WHERE al.granted AND al.state IN ('idle', 'idle in transaction', 'idle in transaction (aborted)');
COMMENT ON VIEW pglockkit.idle_lock_holders IS
    'Advisory locks held by sessions that are idle or idle in transaction, with how long they have idled: the leak of a session lock returned to a pool with its connection. No minimum idle time here: filter on idle_for. dedicated: a connection that a pglockkit client (sole_writer, run_once, pglockkit once, a session-bound Lease) opened to hold the lock while its block runs, known by the application_name it gave (pglockkit sole_writer ..., pglockkit run ..., pglockkit lease ...): idle by design, not a leak.';

CREATE VIEW pglockkit.namespace_stats AS
SELECT al.namespace,
       pg_catalog.count(*) FILTER (WHERE al.granted) AS locks_held,
       pg_catalog.count(*) FILTER (WHERE NOT al.granted) AS waiters,
       pg_catalog.max(al.wait_time) AS longest_wait,
       pg_catalog.max(al.state_age) FILTER (WHERE al.granted) AS longest_holder_state_age,
       pg_catalog.count(DISTINCT al.pid) AS sessions
  FROM pglockkit.advisory_locks al
 GROUP BY al.namespace;
COMMENT ON VIEW pglockkit.namespace_stats IS
    'Per namespace: advisory locks held, waiters, the longest current wait, and how long the longest-standing holder has been in its current state.';

CREATE VIEW pglockkit.table_health AS
SELECT c.relname AS table_name,
       pg_catalog.pg_total_relation_size(c.oid) AS total_bytes,
       s.n_live_tup AS live_rows,
       s.n_dead_tup AS dead_rows,
       pg_catalog.round(s.n_dead_tup::numeric OPERATOR(pg_catalog./)
                        NULLIF(s.n_live_tup OPERATOR(pg_catalog.+) s.n_dead_tup, 0), 3) AS dead_ratio,
       s.last_vacuum, s.last_autovacuum, s.autovacuum_count, s.last_autoanalyze
  FROM pg_catalog.pg_class c
  JOIN pg_catalog.pg_stat_all_tables s ON s.relid OPERATOR(pg_catalog.=) c.oid
 WHERE c.relnamespace OPERATOR(pg_catalog.=) 'pglockkit'::regnamespace AND c.relkind OPERATOR(pg_catalog.=) 'r';
COMMENT ON VIEW pglockkit.table_health IS
    'Size, live and dead rows, dead ratio and last (auto)vacuum of each pglockkit table (jobs above all). A high dead ratio that does not fall after autovacuum means something holds the xmin horizon: see pglockkit.xmin_horizon.';

CREATE VIEW pglockkit.xmin_horizon AS
SELECT 'session'::text AS kind, a.pid::text AS holder, a.application_name, a.usename AS "user", a.state,
       pg_catalog.age(a.backend_xmin) AS xmin_age,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) a.xact_start AS xact_age,
       a.query
  FROM pg_catalog.pg_stat_activity a
 WHERE a.backend_xmin IS NOT NULL AND a.pid OPERATOR(pg_catalog.<>) pg_catalog.pg_backend_pid()
UNION ALL
SELECT 'replication slot', r.slot_name::text, NULL, NULL, CASE WHEN r.active THEN 'active' ELSE 'inactive' END,
       pg_catalog.age(coalesce(r.xmin, r.catalog_xmin)), NULL, NULL
  FROM pg_catalog.pg_replication_slots r
 WHERE coalesce(r.xmin, r.catalog_xmin) IS NOT NULL
UNION ALL
SELECT 'prepared transaction', p.gid, NULL, p.owner::text, NULL,
       pg_catalog.age(p.transaction), pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) p.prepared, NULL
  FROM pg_catalog.pg_prepared_xacts p;
COMMENT ON VIEW pglockkit.xmin_horizon IS
    'What holds back the xmin horizon, oldest first when ordered by xmin_age DESC: sessions with an open snapshot (idle in transaction above all), replication slots and prepared transactions. While one is old, vacuum cannot remove the queue''s dead rows and claims slow down.';

-- Readers (pg_monitor, pglockkit_user) get the samples through views, like every other view.
CREATE VIEW pglockkit.lock_history AS
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

CREATE VIEW pglockkit.queue_history AS SELECT * FROM pglockkit.queue_samples;
COMMENT ON VIEW pglockkit.queue_history IS 'Queue depth and lag recorded by sample().';

CREATE VIEW pglockkit.sampling AS
SELECT s.last_sampled_at,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) s.last_sampled_at AS since_last_sample
  FROM pglockkit.sampler s;
COMMENT ON VIEW pglockkit.sampling IS
    'When sample() last ran, and how long ago: no row if it never ran in this database. Hold times (lock_holds) and the history are only as fresh as that.';

-- Only what is still held now, by the session that was seen holding it (its backend_start, where
-- the reader may see it): a sighting outlives its lock when sample() stops running.
CREATE VIEW pglockkit.lock_holds AS
SELECT al.namespace, s.key, s.key1, s.key2, s.pid, al.application_name, al."user", al.state,
       s.first_seen AS held_since, s.last_seen,
       s.last_seen OPERATOR(pg_catalog.-) s.first_seen AS held_for,
       coalesce(al.application_name OPERATOR(pg_catalog.~) '^pglockkit (sole_writer|run|lease) ', false) AS dedicated
  FROM pglockkit.lock_sightings s
  JOIN pglockkit.advisory_locks al
    ON al.granted AND al.pid OPERATOR(pg_catalog.=) s.pid
   AND pglockkit._lock_ident(al.key, al.key1, al.key2) OPERATOR(pg_catalog.=) pglockkit._lock_ident(s.key, s.key1, s.key2)
   AND (al.key IS NULL) OPERATOR(pg_catalog.=) (s.key IS NULL)
  JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) s.pid
   AND (a.backend_start IS NULL OR a.backend_start OPERATOR(pg_catalog.=) s.backend_start
        OR s.backend_start OPERATOR(pg_catalog.=) '-infinity');
COMMENT ON VIEW pglockkit.lock_holds IS
    'How long each advisory lock held now had been held by its session at the last sample(): held_for is at least last_seen - held_since (the first sample that saw it), whatever the session did meanwhile (on a busy pool, a leaked session lock''s session never idles long, so idle_lock_holders misses it). A lock let go since, or a session gone, is not listed, even when sample() has stopped running. Empty unless sample() runs. dedicated: as in idle_lock_holders.';

CREATE FUNCTION pglockkit.contention_report(since interval DEFAULT '1 hour')
RETURNS TABLE (namespace text, key bigint, key1 integer, key2 integer, samples bigint,
               samples_with_waiters bigint, max_waiters integer, avg_waiters numeric, longest_wait interval,
               holder_queries text[], namespace_sessions numeric, namespace_parallelism numeric)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    WITH window_ AS (
        SELECT s.* FROM pglockkit.lock_history s
         WHERE s.sampled_at >= (pg_catalog.clock_timestamp() - contention_report.since)
           AND pglockkit._invalid_since(contention_report.since) IS NULL
    ), per_ns AS (
        -- Per namespace and sample: sessions involved (holding or waiting) vs sessions holding.
        SELECT w.namespace, w.sampled_at,
               pg_catalog.sum(w.holders + w.waiters) AS sessions, pg_catalog.sum(w.holders) AS holding
          FROM window_ w GROUP BY w.namespace, w.sampled_at
    ), ns AS (
        SELECT p.namespace, pg_catalog.round(pg_catalog.avg(p.sessions), 2) AS sessions,
               pg_catalog.round(pg_catalog.avg(p.holding::numeric / p.sessions), 3) AS parallelism
          FROM per_ns p GROUP BY p.namespace
    )
    SELECT w.namespace, w.key, w.key1, w.key2, pg_catalog.count(*),
           pg_catalog.count(*) FILTER (WHERE w.waiters > 0),
           pg_catalog.max(w.waiters), pg_catalog.round(pg_catalog.avg(w.waiters), 2), pg_catalog.max(w.longest_wait),
           (SELECT pg_catalog.array_agg(DISTINCT q) FROM window_ w2, pg_catalog.unnest(w2.holder_queries) AS q
             WHERE w2.namespace = w.namespace AND w2.key IS NOT DISTINCT FROM w.key
               AND w2.key1 IS NOT DISTINCT FROM w.key1 AND w2.key2 IS NOT DISTINCT FROM w.key2),
           ns.sessions, ns.parallelism
      FROM window_ w JOIN ns ON ns.namespace = w.namespace
     GROUP BY w.namespace, w.key, w.key1, w.key2, ns.sessions, ns.parallelism
     ORDER BY pg_catalog.count(*) FILTER (WHERE w.waiters > 0) DESC, pg_catalog.max(w.waiters) DESC
$$;
COMMENT ON FUNCTION pglockkit.contention_report(interval) IS
    'Which advisory keys serialized the swarm over the last since: per key, in how many samples it had waiters, the most and average waiters, the longest wait and the holders'' queries (read from lock_history: a query the reader could not see live reads ''<insufficient privilege>''); 22004 for a NULL since, 22023 for a negative one; per namespace, the average sessions involved and the effective parallelism (sessions holding / sessions involved: 1.0 = nobody waits, 1/n = n sessions queue behind one).';
