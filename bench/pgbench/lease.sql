-- pglockkit.acquire_lease + release_lease on a name of this client's own, one transaction per call.
-- Interleaved with lease_bare_upsert.sql in one pgbench run (docs/leases.md, "What a call costs").
SELECT coalesce(pglockkit.acquire_lease('pgbench-lease-' || :client_id, 'h' || :client_id, interval '30 seconds'), 0) AS tok \gset
\if :tok > 0
SELECT pglockkit.release_lease('pgbench-lease-' || :client_id, 'h' || :client_id, :tok);
\endif
