ALTER FUNCTION pglockkit.cancel_job(bigint) RESET enable_seqscan;
ALTER FUNCTION pglockkit.release_job(bigint, bigint) RESET enable_seqscan;
ALTER FUNCTION pglockkit.extend_job(bigint, bigint, interval) RESET enable_seqscan;
ALTER FUNCTION pglockkit.fail_job(bigint, bigint, text, interval) RESET enable_seqscan;
ALTER FUNCTION pglockkit.complete_jobs(bigint[], bigint[]) RESET enable_seqscan;
ALTER FUNCTION pglockkit.complete_job(bigint, bigint) RESET enable_seqscan;
ALTER FUNCTION pglockkit.claim_job(text, text, interval, integer) RESET enable_bitmapscan;
ALTER FUNCTION pglockkit.claim_job(text, text, interval, integer) RESET enable_seqscan;

DROP INDEX pglockkit.jobs_leases;
CREATE INDEX jobs_leases ON pglockkit.jobs (queue, lease_expires_at) WHERE status = 'running';
