-- The floor of the hot-loop form: the key formula of lock keys written out in SQL, no pglockkit
-- function, on a resource of this client's own bound as a text parameter. bench.pgbench_compare
-- writes in the namespace's high bits (:ns_bits, (id << 48) | (1 << 47)) and this server's
-- reading of the hash's first 6 bytes (:h48: PostgreSQL 18 casts bytea to bigint, earlier
-- servers read its hex digits as bit(48)).
SELECT pg_advisory_xact_lock(:ns_bits | (:h48 >> 1));
