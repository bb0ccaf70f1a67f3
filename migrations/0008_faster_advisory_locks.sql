-- pglockkit 0008: advisory_locks names the namespace with a join instead of a function call per
-- row. With 1,000 locks held, the per-row call of _advisory_label was most of the view's cost
-- (bench/monitoring_cost.py); the columns and their meaning are unchanged, and so are the views
-- built on it (idle_lock_holders, namespace_stats) and sample(). lock_waits, which sees only
-- waiting backends, keeps calling _advisory_label.

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
       a.query
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
