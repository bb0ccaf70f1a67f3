-- The hot-loop form: the key from the namespace's id (pglockkit.key, inlined, no lookup) and the
-- bare lock, on a resource of this client's own (no contention). :ns_id is passed with -D.
SELECT pg_advisory_xact_lock(pglockkit.key(:ns_id, 'pgbench-' || :client_id));
