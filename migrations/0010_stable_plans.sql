-- pglockkit 0010: plans that do not depend on the table's size when a session first calls.
--
-- The queue functions run their statements with a generic plan (plan_cache_mode =
-- force_generic_plan: re-planning at every call cost more than executing). A generic plan is
-- made from the statistics of the moment, without the argument values, and kept for the session
-- (until the table is next analyzed). Two such plans were found to grow with the table:
--
-- * On a small table, claim_job's ready-job scan was planned as a sequential scan and a sort (a
--   LIMIT given by a parameter is assumed to keep 10% of the rows), and stayed that way as the
--   backlog grew: every claim read the whole queue.
-- * complete_job looked its row up through jobs_leases (every running job, filtered by id),
--   because the partial index's predicate (status = 'running') was implied by the WHERE clause
--   and the index was tiny when planned.
--
-- The fixes: the hot-path functions do not consider sequential (or, for claim_job, bitmap) scans,
-- so the ready scan walks jobs_ready in claim order and stops at the batch; and jobs_leases is keyed
-- on what it is for, lease_expires_at IS NOT NULL (exactly the running jobs: every way out of
-- running clears the lease), which lookups by id and token do not imply.

DROP INDEX pglockkit.jobs_leases;
CREATE INDEX jobs_leases ON pglockkit.jobs (queue, lease_expires_at) WHERE lease_expires_at IS NOT NULL;

ALTER FUNCTION pglockkit.claim_job(text, text, interval, integer) SET enable_seqscan = off;
ALTER FUNCTION pglockkit.claim_job(text, text, interval, integer) SET enable_bitmapscan = off;
ALTER FUNCTION pglockkit.complete_job(bigint, bigint) SET enable_seqscan = off;
ALTER FUNCTION pglockkit.complete_jobs(bigint[], bigint[]) SET enable_seqscan = off;
ALTER FUNCTION pglockkit.fail_job(bigint, bigint, text, interval) SET enable_seqscan = off;
ALTER FUNCTION pglockkit.extend_job(bigint, bigint, interval) SET enable_seqscan = off;
ALTER FUNCTION pglockkit.release_job(bigint, bigint) SET enable_seqscan = off;
ALTER FUNCTION pglockkit.cancel_job(bigint) SET enable_seqscan = off;
