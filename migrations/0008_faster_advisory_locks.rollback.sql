-- Back to 0005's definition of advisory_locks (a label function call per row).
CREATE OR REPLACE VIEW pglockkit.advisory_locks AS
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
