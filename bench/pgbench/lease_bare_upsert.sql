-- The hand-rolled lease of bench/lease_throughput.py (its table bench_bare_leases), for lease.sql.
INSERT INTO bench_bare_leases AS l (name, holder, token, expires_at)
VALUES ('pgbench-lease-' || :client_id, 'h' || :client_id, 1, clock_timestamp() + interval '30 seconds')
ON CONFLICT (name) DO UPDATE
   SET holder = excluded.holder, token = l.token + 1, expires_at = excluded.expires_at
 WHERE l.expires_at <= clock_timestamp() OR l.holder = excluded.holder
RETURNING token AS tok \gset
\if :tok > 0
UPDATE bench_bare_leases SET expires_at = clock_timestamp()
 WHERE name = 'pgbench-lease-' || :client_id AND holder = 'h' || :client_id AND token = :tok;
\endif
