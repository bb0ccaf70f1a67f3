-- A row lock on a row of this client's own (no contention): bench_pgbench_rows has one row per client.
SELECT id FROM bench_pgbench_rows WHERE id = :client_id FOR UPDATE;
