-- pglockkit.acquire_lease + release_lease, one transaction per call (bench/lease_pgbench.py).
-- :spread 1: a name of this client's own (1, 2, ...); 0: one name for all clients (0). A miss sleeps :miss_pause_us.
\set n (:client_id + 1) * :spread
SELECT coalesce(pglockkit.acquire_lease('pgbench-lease-' || :n, 'h' || :client_id, interval '30 seconds'), 0) AS tok \gset
\if :tok > 0
SELECT pglockkit.release_lease('pgbench-lease-' || :n, 'h' || :client_id, :tok);
\else
\sleep :miss_pause_us us
\endif
