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
--   than expected).

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
CREATE INDEX lock_sightings_pid ON pglockkit.lock_sightings (pid);

CREATE VIEW pglockkit.lock_holds AS
SELECT s.namespace, s.key, s.key1, s.key2, s.pid, al.application_name, al."user", al.state,
       s.first_seen AS held_since, s.last_seen,
       s.last_seen OPERATOR(pg_catalog.-) s.first_seen AS held_for,
       coalesce(al.application_name OPERATOR(pg_catalog.~) '^pglockkit (sole_writer|run|lease) ', false) AS dedicated
  FROM pglockkit.lock_sightings s
  JOIN pglockkit.advisory_locks al
    ON al.granted AND al.pid OPERATOR(pg_catalog.=) s.pid AND al.namespace OPERATOR(pg_catalog.=) s.namespace
   AND al.key IS NOT DISTINCT FROM s.key AND al.key1 IS NOT DISTINCT FROM s.key1 AND al.key2 IS NOT DISTINCT FROM s.key2
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
    -- Hold times (0017). Samplers take turns, so that two never add the same sighting.
    PERFORM pg_catalog.pg_advisory_xact_lock(pglockkit._key(pglockkit._ns_id_from_name('pglockkit'), 'sample'));
    WITH held AS (
        SELECT DISTINCT al.pid, coalesce(a.backend_start, '-infinity') AS backend_start,
               al.namespace, al.key, al.key1, al.key2
          FROM pglockkit.advisory_locks al
          LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = al.pid
         WHERE al.granted AND al.pid IS NOT NULL
           AND al.pid OPERATOR(pg_catalog.<>) pg_catalog.pg_backend_pid()  -- not the turn taken above
    ), gone AS (
        DELETE FROM pglockkit.lock_sightings s
         WHERE NOT EXISTS (SELECT FROM held h
                            WHERE h.pid = s.pid AND h.backend_start = s.backend_start AND h.namespace = s.namespace
                              AND h.key IS NOT DISTINCT FROM s.key AND h.key1 IS NOT DISTINCT FROM s.key1
                              AND h.key2 IS NOT DISTINCT FROM s.key2)
    ), still AS (
        UPDATE pglockkit.lock_sightings s SET last_seen = v_now
          FROM held h
         WHERE h.pid = s.pid AND h.backend_start = s.backend_start AND h.namespace = s.namespace
           AND h.key IS NOT DISTINCT FROM s.key AND h.key1 IS NOT DISTINCT FROM s.key1
           AND h.key2 IS NOT DISTINCT FROM s.key2
    )
    INSERT INTO pglockkit.lock_sightings (pid, backend_start, namespace, key, key1, key2, first_seen, last_seen)
    SELECT h.pid, h.backend_start, h.namespace, h.key, h.key1, h.key2, v_now, v_now
      FROM held h
     WHERE NOT EXISTS (SELECT FROM pglockkit.lock_sightings s
                        WHERE h.pid = s.pid AND h.backend_start = s.backend_start AND h.namespace = s.namespace
                          AND h.key IS NOT DISTINCT FROM s.key AND h.key1 IS NOT DISTINCT FROM s.key1
                          AND h.key2 IS NOT DISTINCT FROM s.key2);
    INSERT INTO pglockkit.queue_samples (sampled_at, queue, ready, running, oldest_ready_age)
    SELECT v_now, q.queue, q.ready, q.running, q.oldest_ready_age FROM pglockkit.queue_stats q;
    DELETE FROM pglockkit.lock_samples s WHERE s.sampled_at OPERATOR(pg_catalog.<) (v_now OPERATOR(pg_catalog.-) retention);
    DELETE FROM pglockkit.queue_samples s WHERE s.sampled_at OPERATOR(pg_catalog.<) (v_now OPERATOR(pg_catalog.-) retention);
    RETURN v_rows;
END
$$;
COMMENT ON FUNCTION pglockkit.sample(interval) IS
    'Records one snapshot of advisory-lock contention (per key: holders, waiters, longest wait, holders'' queries and their roles) and queue lag, and deletes samples older than retention; returns the lock rows recorded. It also keeps, per session and lock it holds, when a sample first saw it held (lock_holds), and forgets what is no longer held. Runs as the installing role; lock_history shows each reader only the queries it could see live. Call it every few seconds: from pg_cron, or `pglockkit sample --every 5s`.';

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
GRANT EXECUTE ON FUNCTION pglockkit._advisory_held(bigint, boolean), pglockkit._run_key(text, text),
    pglockkit._key(smallint, text), pglockkit._h47(text), pglockkit._ns_id_from_name(text) TO pg_monitor;

SELECT pglockkit._grant_privileges();
