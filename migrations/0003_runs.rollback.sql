DROP VIEW pglockkit.run_history;
DROP FUNCTION pglockkit.finish_run(bigint, boolean, text);
DROP FUNCTION pglockkit.start_run(text, text, text);
DROP FUNCTION pglockkit._run_key(text, text);
DROP TABLE pglockkit.runs;
