-- pglockkit.xact_lock on a resource of this client's own (no contention): one transaction per line.
SELECT pglockkit.xact_lock('bench', 'pgbench-' || :client_id);
