-- The hot-loop form on an integer resource (no hash: the key is the namespace's id and the
-- integer, pglockkit.key(integer, bigint)), on a resource of this client's own, bound as a
-- bigint parameter. :ns_id is written in as in key_lock.sql.
SELECT pg_advisory_xact_lock(pglockkit.key(:ns_id, :client_id::bigint));
