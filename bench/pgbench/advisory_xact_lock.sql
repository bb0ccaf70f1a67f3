-- The bare function pglockkit.xact_lock wraps, on a key of this client's own (no contention).
\set key 4242000000 + :client_id
SELECT pg_advisory_xact_lock(:key);
