DROP VIEW pglockkit.namespace_stats;
DROP VIEW pglockkit.idle_lock_holders;
DROP VIEW pglockkit.lock_waits;
DROP VIEW pglockkit.advisory_locks;
DROP FUNCTION pglockkit._advisory_label(smallint, oid, oid);
