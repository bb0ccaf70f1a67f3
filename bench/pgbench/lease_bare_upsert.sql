-- The hand-rolled lease of bench/lease_throughput.py (its table bench_bare_leases), for lease.sql.
-- A miss returns no row: \aset leaves tok as set before it (\gset would abort the client).
\set n (:client_id + 1) * :spread
\set tok 0
INSERT INTO bench_bare_leases AS l (name, holder, token, expires_at)
VALUES ('pgbench-lease-' || :n, 'h' || :client_id, 1, clock_timestamp() + interval '30 seconds')
ON CONFLICT (name) DO UPDATE
   SET holder = excluded.holder, token = l.token + 1, expires_at = excluded.expires_at
 WHERE l.expires_at <= clock_timestamp() OR l.holder = excluded.holder
RETURNING token AS tok \aset
\if :tok > 0
UPDATE bench_bare_leases SET expires_at = clock_timestamp()
 WHERE name = 'pgbench-lease-' || :n AND holder = 'h' || :client_id AND token = :tok;
\else
\sleep :miss_pause_us us
\endif
