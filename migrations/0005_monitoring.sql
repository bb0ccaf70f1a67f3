-- pglockkit 0005: monitoring views that name every advisory lock.
--
-- The usual lock-monitor queries never show an advisory lock's holder as a blocker, and never say
-- what a key means. These views decode every advisory key in this database (bigint keys,
-- objsubid 1, including negative ones; int4 pairs, objsubid 2), name the namespace from the
-- registry, and join the session that holds or waits. They read pg_locks and pg_stat_activity:
-- a role that cannot see other sessions' details (not a member of pg_monitor / pg_read_all_stats)
-- still gets every row, with NULL user, query and state for other roles' sessions.

CREATE FUNCTION pglockkit._advisory_label(objsubid smallint, classid oid, objid oid) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE
        WHEN objsubid OPERATOR(pg_catalog.=) 2 THEN 'int4 pair'
        WHEN k.key OPERATOR(pg_catalog.=) 72707369 THEN 'flyway'   -- Flyway's migration lock
        WHEN k.key OPERATOR(pg_catalog.<=) 0 THEN 'unregistered'
        ELSE coalesce((SELECT n.name FROM pglockkit.namespaces n
                        WHERE n.id OPERATOR(pg_catalog.=) (k.key OPERATOR(pg_catalog.>>) 48)::int4), 'unregistered')
    END
    FROM (SELECT (classid::int8 OPERATOR(pg_catalog.<<) 32) OPERATOR(pg_catalog.|) objid::int8 AS key) k
$$;
COMMENT ON FUNCTION pglockkit._advisory_label(smallint, oid, oid) IS
    'Private: the namespace name of an advisory lock in pg_locks: the registered name, ''flyway'' for Flyway''s key, ''int4 pair'' for two-int keys, else ''unregistered''.';

CREATE VIEW pglockkit.advisory_locks AS
SELECT pglockkit._advisory_label(l.objsubid, l.classid, l.objid) AS namespace,
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
       a.query
  FROM pg_catalog.pg_locks l
  LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) l.pid
 WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory'
   AND l.database OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database d
                                           WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database());
COMMENT ON VIEW pglockkit.advisory_locks IS
    'Every advisory lock held or awaited in this database: namespace (registered name, ''flyway'', ''int4 pair'' or ''unregistered''), key (bigint keys) or key1/key2 (int4 pairs), granted, pid, application, user, client, state and how long in it, a waiter''s wait time and the pids blocking it, the query. Columns from pg_stat_activity are NULL for sessions the reader may not see.';

CREATE VIEW pglockkit.lock_waits AS
WITH RECURSIVE waiting AS (
    SELECT a.pid, pg_catalog.pg_blocking_pids(a.pid) AS blocked_by
      FROM pg_catalog.pg_stat_activity a
     WHERE a.wait_event_type OPERATOR(pg_catalog.=) 'Lock'
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
       a.application_name, a.usename AS "user", a.query
  FROM waiting w
  JOIN pg_catalog.pg_locks l ON l.pid OPERATOR(pg_catalog.=) w.pid AND NOT l.granted
  LEFT JOIN roots r ON r.pid OPERATOR(pg_catalog.=) w.pid
  LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) w.pid
 WHERE pg_catalog.cardinality(w.blocked_by) OPERATOR(pg_catalog.>) 0;
COMMENT ON VIEW pglockkit.lock_waits IS
    'Every backend waiting on a lock of any type: its blockers, the root blocker of its chain (a session that is not itself waiting) and how many sessions wait behind that root, the lock (namespace for advisory locks, relation otherwise), and how long it has waited.';

CREATE VIEW pglockkit.idle_lock_holders AS
SELECT al.namespace, al.key, al.key1, al.key2, al.pid, al.application_name, al."user", al.client_addr,
       al.state, al.state_age AS idle_for, al.query AS last_query
  FROM pglockkit.advisory_locks al
 WHERE al.granted AND al.state IN ('idle', 'idle in transaction', 'idle in transaction (aborted)');
COMMENT ON VIEW pglockkit.idle_lock_holders IS
    'Advisory locks held by sessions that are idle or idle in transaction, with how long they have idled: the leak of a session lock returned to a pool (seeds 001, 003, 004). No minimum idle time here: filter on idle_for.';

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

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;
-- The views call _advisory_label with the reader's privileges: monitoring roles need it too.
GRANT EXECUTE ON FUNCTION pglockkit._advisory_label(smallint, oid, oid) TO pg_monitor;
