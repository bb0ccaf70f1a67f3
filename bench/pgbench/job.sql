-- pglockkit.claim_job + complete_job of one job, one transaction each (bench/capacity.py), from the
-- queue bench_capacity that bench.capacity fills before each run. An empty queue returns no row:
-- \aset leaves id at 0 and the iteration completes nothing (bench.capacity reports a run that ran dry).
\set id 0
SELECT id, token FROM pglockkit.claim_job('bench_capacity', 'c' || :client_id) \aset
\if :id > 0
SELECT pglockkit.complete_job(:id, :token);
\endif
