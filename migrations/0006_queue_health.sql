-- pglockkit 0006: queue health, the first pain of every Postgres queue: dead tuples that vacuum
-- cannot remove because something holds the xmin horizon back.

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

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;
