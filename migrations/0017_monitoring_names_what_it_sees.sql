-- pglockkit 0017: monitoring that names what it sees, and what pg_monitor may read.
-- * A prepared transaction (two-phase commit) holds its locks with no session: pg_blocking_pids
--   names it 0, and lock_waits, advisory_locks and `pglockkit top` said only "a prepared
--   transaction", so an operator could not tell which to COMMIT or ROLLBACK PREPARED.
--   advisory_locks gets prepared_gid (the gid of a lock held by a prepared transaction) and
--   lock_waits prepared_blockers (the gids of those holding what the session waits for).
-- * idle_lock_holders gets dedicated: the connections sole_writer, run_once, `pglockkit once`
--   and a session-bound Lease hold their lock on are idle by design, and doctor called each a
--   pool leak (and advised ending it, which frees the lock mid-run); the exporter counted them.
--   The new columns come last.
-- * run_history calls _advisory_held and _run_key with its reader's rights: a pg_monitor role
--   could not read it (42501). pg_monitor may execute them and what _run_key calls.
-- * _run_key and _lease_session_key, inlined with their text parsed in the caller's context,
--   cast to an unqualified text: a reader's type "text" earlier on its search_path changed the
--   key (run_history showed a live run as abandoned). The casts are qualified.
-- * lock_holds: how long each advisory lock has been held, kept by sample() in lock_sightings.
--   A lock's hold time was its holder's state age, which restarts at each transaction: a session
--   lock leaked on a busy pooled server session never showed (seed: alert on locks held longer
--   than expected). sampling (table sampler): when sample() last ran, so that a sampler that
--   stopped is seen (doctor, the exporter and an alert).
-- * From other clients' SQL (review of SQL-first use): every cron expression was refused (22023)
--   in a session with standard_conforming_strings off, which read the parsers' '\s+' as 's+'
--   (their regular expressions take no backslash now); contention_report(NULL) returned an empty
--   report (22004 now, 22023 for a negative since); release_lease's NULL error named a ttl it
--   does not take; decode_key called a key of namespace 0 (pg_advisory_lock(42)) an integer key
--   (foreign now) and a NULL key one too.

SET LOCAL search_path = pg_catalog, pg_temp;

-- A prepared transaction holds its locks with no session (pid NULL); its locks share a
-- virtualtransaction with the lock it holds on its own xid, which pg_prepared_xacts names (0017).
CREATE FUNCTION pglockkit._prepared_gid(virtualtransaction text) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT p.gid
      FROM pg_catalog.pg_locks x
      JOIN pg_catalog.pg_prepared_xacts p ON p.transaction OPERATOR(pg_catalog.=) x.transactionid
     WHERE x.pid IS NULL AND x.locktype OPERATOR(pg_catalog.=) 'transactionid'
       AND x.virtualtransaction OPERATOR(pg_catalog.=) _prepared_gid.virtualtransaction
     LIMIT 1
$$;
COMMENT ON FUNCTION pglockkit._prepared_gid(text) IS
    'Private: the gid of the prepared transaction whose locks pg_locks lists under this virtualtransaction (NULL if none).';

CREATE OR REPLACE VIEW pglockkit.advisory_locks AS
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

CREATE OR REPLACE VIEW pglockkit.lock_waits AS
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

CREATE OR REPLACE VIEW pglockkit.idle_lock_holders AS
SELECT al.namespace, al.key, al.key1, al.key2, al.pid, al.application_name, al."user", al.client_addr,
       al.state, al.state_age AS idle_for, al.query AS last_query,
       coalesce(al.application_name OPERATOR(pg_catalog.~) '^pglockkit (sole_writer|run|lease) ', false) AS dedicated
  FROM pglockkit.advisory_locks al
 WHERE al.granted AND al.state IN ('idle', 'idle in transaction', 'idle in transaction (aborted)');
COMMENT ON VIEW pglockkit.idle_lock_holders IS
    'Advisory locks held by sessions that are idle or idle in transaction, with how long they have idled: the leak of a session lock returned to a pool with its connection. No minimum idle time here: filter on idle_for. dedicated: a connection that a pglockkit client (sole_writer, run_once, pglockkit once, a session-bound Lease) opened to hold the lock while its block runs, known by the application_name it gave (pglockkit sole_writer ..., pglockkit run ..., pglockkit lease ...): idle by design, not a leak.';

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

CREATE VIEW pglockkit.sampling AS
SELECT s.last_sampled_at,
       pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) s.last_sampled_at AS since_last_sample
  FROM pglockkit.sampler s;
COMMENT ON VIEW pglockkit.sampling IS
    'When sample() last ran, and how long ago: no row if it never ran in this database. Hold times (lock_holds) and the history are only as fresh as that.';

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
           AND al.pid OPERATOR(pg_catalog.<>) pg_catalog.pg_backend_pid()  -- not the turn taken above
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
    DELETE FROM pglockkit.lock_samples s WHERE s.sampled_at OPERATOR(pg_catalog.<) (v_now OPERATOR(pg_catalog.-) retention);
    DELETE FROM pglockkit.queue_samples s WHERE s.sampled_at OPERATOR(pg_catalog.<) (v_now OPERATOR(pg_catalog.-) retention);
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

CREATE OR REPLACE FUNCTION pglockkit.contention_report(since interval DEFAULT '1 hour')
RETURNS TABLE (namespace text, key bigint, key1 integer, key2 integer, samples bigint,
               samples_with_waiters bigint, max_waiters integer, avg_waiters numeric, longest_wait interval,
               holder_queries text[], namespace_sessions numeric, namespace_parallelism numeric)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    WITH window_ AS (
        SELECT s.* FROM pglockkit.lock_history s
         WHERE s.sampled_at OPERATOR(pg_catalog.>=) (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) contention_report.since)
           AND pglockkit._invalid_since(contention_report.since) IS NULL
    ), per_ns AS (
        -- Per namespace and sample: sessions involved (holding or waiting) vs sessions holding.
        SELECT w.namespace, w.sampled_at,
               pg_catalog.sum(w.holders OPERATOR(pg_catalog.+) w.waiters) AS sessions, pg_catalog.sum(w.holders) AS holding
          FROM window_ w GROUP BY w.namespace, w.sampled_at
    ), ns AS (
        SELECT p.namespace, pg_catalog.round(pg_catalog.avg(p.sessions), 2) AS sessions,
               pg_catalog.round(pg_catalog.avg(p.holding::numeric OPERATOR(pg_catalog./) p.sessions), 3) AS parallelism
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

CREATE OR REPLACE FUNCTION pglockkit._cron_field(expr text, field text, lo integer, hi integer, names text[] DEFAULT NULL)
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

CREATE OR REPLACE FUNCTION pglockkit._cron_parse(cron text) RETURNS pglockkit.cron_spec
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

CREATE OR REPLACE FUNCTION pglockkit.release_lease(name text, holder text, token bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_bound boolean;
    v_key   bigint;
BEGIN
    UPDATE pglockkit.leases l
       SET released_at = pg_catalog.clock_timestamp()
     WHERE l.name = release_lease.name
       AND l.holder = release_lease.holder
       AND l.token = release_lease.token
       AND l.released_at IS NULL
       AND l.expires_at > pg_catalog.clock_timestamp()
       AND NOT l.session_bound
       AND release_lease.holder <> '';
    IF FOUND THEN
        RETURN true;
    END IF;
    IF release_lease.name IS NULL OR release_lease.holder IS NULL OR release_lease.token IS NULL THEN
        -- Its own message: the shared check's names a ttl, which release takes none of (0017).
        RAISE EXCEPTION 'lease name, holder and token must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF release_lease.name = '' OR release_lease.holder = '' THEN
        PERFORM pglockkit._check_lease_args(release_lease.name, release_lease.holder, interval '1 second');
    END IF;
    -- A session-bound lease, or not ours (any more: taken over, released, or past its ttl).
    UPDATE pglockkit.leases l
       SET released_at = pg_catalog.clock_timestamp()
     WHERE l.name = release_lease.name
       AND l.holder = release_lease.holder
       AND l.token = release_lease.token
       AND l.released_at IS NULL
       AND l.expires_at > pg_catalog.clock_timestamp()
    RETURNING l.session_bound, l.session_key INTO v_bound, v_key;
    IF NOT v_bound THEN  -- unbound: only if the row changed since the first look
        RETURN true;
    END IF;
    IF v_bound IS NULL THEN
        -- Not ours (any more): a stale bound holder lets go of its key.
        PERFORM pglockkit._lease_drop_stale_key(release_lease.name);
        RETURN false;
    END IF;
    IF v_key IS NOT NULL AND pglockkit._advisory_held(v_key, true) THEN
        PERFORM pg_catalog.pg_advisory_unlock(v_key);
    END IF;
    RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION pglockkit.decode_key(
    key bigint,
    OUT namespace_id integer, OUT namespace text, OUT form text, OUT resource_bits bigint)
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    -- Namespace ids are 1..32767: a key under 2^48 (namespace 0, a plain pg_advisory_lock(42))
    -- or negative is foreign (0017).
    SELECT CASE WHEN (key OPERATOR(pg_catalog.>>) 48) OPERATOR(pg_catalog.>) 0 THEN (key OPERATOR(pg_catalog.>>) 48)::int4 END,
           (SELECT n.name FROM pglockkit.namespaces n
             WHERE (key OPERATOR(pg_catalog.>>) 48) OPERATOR(pg_catalog.>) 0
               AND n.id OPERATOR(pg_catalog.=) (key OPERATOR(pg_catalog.>>) 48)::int4),
           CASE WHEN (key OPERATOR(pg_catalog.>>) 48) OPERATOR(pg_catalog.<=) 0 THEN 'foreign'
                WHEN (key OPERATOR(pg_catalog.&) (1::int8 OPERATOR(pg_catalog.<<) 47)) OPERATOR(pg_catalog.<>) 0 THEN 'text'
                WHEN key IS NOT NULL THEN 'integer' END,
           key OPERATOR(pg_catalog.&) ((1::int8 OPERATOR(pg_catalog.<<) 47) OPERATOR(pg_catalog.-) 1)
$$;
COMMENT ON FUNCTION pglockkit.decode_key(bigint) IS
    'Splits a lock key into namespace id, registered namespace name (NULL if unregistered), form (''text'' hash, ''integer'' id, or ''foreign'' for keys below 2^48 or negative, in no namespace id 1..32767: pglockkit never makes them, a plain pg_advisory_lock(42) does) and the low 47 bits. All NULL for a NULL key.';

CREATE OR REPLACE FUNCTION pglockkit._run_key(job text, slot text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT pglockkit._key(pglockkit._ns_id_from_name('pglockkit'),
        'run:' OPERATOR(pg_catalog.||) pg_catalog.length(job)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
               OPERATOR(pg_catalog.||) job OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) slot)
$$;
COMMENT ON FUNCTION pglockkit._run_key(text, text) IS
    'Private: the advisory key (namespace pglockkit, resource run:<len(job)>:<job>:<slot>) that a run''s starter holds while it runs. Inlined, its text parsed in the caller''s context (run_history''s reader''s): every name in it, types included, is qualified.';

CREATE OR REPLACE FUNCTION pglockkit._lease_session_key(name text, pid integer) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT pglockkit._key(pglockkit._ns_id_from_name('pglockkit'),
        'lease-session:' OPERATOR(pg_catalog.||) pid::pg_catalog.text OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) name)
$$;
-- pg_monitor's grants after pglockkit_user's, as a fresh install orders them.
SELECT pglockkit._grant_privileges();
GRANT EXECUTE ON FUNCTION pglockkit._prepared_gid(text) TO pg_monitor;
GRANT EXECUTE ON FUNCTION pglockkit._lock_ident(bigint, integer, integer) TO pg_monitor;
GRANT EXECUTE ON FUNCTION pglockkit._invalid_since(interval) TO pg_monitor;
GRANT EXECUTE ON FUNCTION pglockkit._advisory_held(bigint, boolean), pglockkit._run_key(text, text),
    pglockkit._key(smallint, text), pglockkit._h47(text), pglockkit._ns_id_from_name(text) TO pg_monitor;

SELECT pglockkit._grant_privileges();
