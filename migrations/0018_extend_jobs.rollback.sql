-- Back to one extend_job per job.

DROP FUNCTION pglockkit.extend_jobs(bigint[], bigint[], interval);
