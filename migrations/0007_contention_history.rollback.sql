DROP FUNCTION pglockkit.contention_report(interval);
DROP FUNCTION pglockkit.sample(interval);
DROP VIEW pglockkit.queue_history;
DROP VIEW pglockkit.lock_history;
DROP TABLE pglockkit.queue_samples;
DROP TABLE pglockkit.lock_samples;
