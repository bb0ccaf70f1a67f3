-- The hot-loop form: the key from the namespace's id (pglockkit.key, inlined, no lookup) and the
-- bare lock, on a resource of this client's own (no contention), bound as a text parameter.
-- bench.pgbench_compare writes the namespace's id in place of :ns_id, a literal as in a hot loop
-- written in SQL.
SELECT pg_advisory_xact_lock(pglockkit.key(:ns_id, :client_id::text));
