-- pglockkit in psql: a short tour of every primitive, with no client library.
--
--   psql -X -v ON_ERROR_STOP=1 -f sql/examples/walkthrough.sql 'postgresql://app@db/scratch'
--
-- Run it in a scratch database with pglockkit installed (`pglockkit install`, or
-- `psql -f sql/pglockkit.sql`): it registers the namespaces graphs and billing, and leaves a queue
-- `emails` and a lease `nightly-refresh` behind. Or paste it piece by piece into psql.
-- sql/examples/walkthrough.out is its expected output (tests/sql/test_psql_walkthrough.py checks it on
-- PostgreSQL 15 and 18). The output is deterministic: fencing tokens and job ids, which differ from
-- database to database, are kept in psql variables (\gset) and compared, never printed.

\set SHOW_CONTEXT never

\echo '== 1. Namespaces and lock keys'
-- Register a namespace once per application (idempotent: every pod may do it at start-up).
SELECT pglockkit.register_namespace('graphs', description => 'one writer per LangGraph graph');
SELECT pglockkit.register_namespace('billing', 42, 'invoices', lock_timeout => '2s');  -- explicit id

-- The key is the same in every language (sha256, see the README's "Lock keys").
SELECT pglockkit.lock_key('billing', 'invoice:7') AS text_key,
       pglockkit.lock_key('billing', 9) AS integer_key;
SELECT * FROM pglockkit.decode_key(11972594097471414);

\echo '== 2. Session locks: try_lock / unlock (a cron or leader tick)'
SELECT pglockkit.try_lock('graphs', 'restock_plan');   -- t: run the tick; f: another replica has it
-- Every advisory lock, named: the view decodes the key into its namespace.
SELECT namespace, key = pglockkit.lock_key('graphs', 'restock_plan') AS is_restock_plan, granted, mode
  FROM pglockkit.advisory_locks
 WHERE pid = pg_backend_pid();
SELECT pglockkit.unlock('graphs', 'restock_plan');     -- error 55000 if this session does not hold it
SELECT count(*) AS locks_held FROM pglockkit.advisory_locks WHERE pid = pg_backend_pid();

\echo '== 3. Transaction locks: released at COMMIT or ROLLBACK (fit for transaction poolers)'
CREATE TEMP TABLE orders (id bigint PRIMARY KEY);
INSERT INTO orders VALUES (7), (19), (42);
BEGIN;
SELECT pglockkit.try_xact_lock('billing', 'nightly-close');               -- skip if busy
SELECT pglockkit.xact_lock('billing', 'invoice:7', '200ms');              -- wait at most 200 ms, else 55P03
SELECT pglockkit.xact_lock_all('billing', ARRAY['acct:9', 'acct:3'], '1s'); -- ascending key order
SELECT pglockkit.lock_rows('orders', ARRAY[42, 7, 19], '1s');             -- rows FOR UPDATE, ascending id
SELECT count(*) AS locks_held FROM pglockkit.advisory_locks WHERE pid = pg_backend_pid();
COMMIT;
SELECT count(*) AS locks_held FROM pglockkit.advisory_locks WHERE pid = pg_backend_pid();

\echo '== 4. A lease with a fencing token'
SELECT pglockkit.acquire_lease('nightly-refresh', 'pod-a', '30 s') AS token_a \gset
SELECT :token_a IS NOT NULL AS pod_a_holds_it,
       pglockkit.acquire_lease('nightly-refresh', 'pod-b', '30 s') IS NULL AS pod_b_gets_null;
BEGIN;
SELECT pglockkit.check_fence('nightly-refresh', :token_a);  -- passes: pod-a's token is live
-- ... pod-a's writes go here; they commit under the token just checked.
COMMIT;
-- pod-a stalls; its lease ends (here: released), and pod-b takes over with the next token.
SELECT pglockkit.release_lease('nightly-refresh', 'pod-a', :token_a);
SELECT pglockkit.acquire_lease('nightly-refresh', 'pod-b', '30 s') AS token_b \gset
SELECT :token_b = :token_a + 1 AS next_token;
-- pod-a wakes up and tries to write with its old token: the fence stops it with SQLSTATE PK001
-- (message: fence check failed: token ... of lease "nightly-refresh" is stale (current token ...)).
\set VERBOSITY sqlstate
\set ON_ERROR_STOP 0
BEGIN;
SELECT pglockkit.check_fence('nightly-refresh', :token_a);
ROLLBACK;
\set ON_ERROR_STOP 1
\set VERBOSITY default
SELECT name, holder, live FROM pglockkit.lease_status WHERE name = 'nightly-refresh';

\echo '== 5. The job queue: enqueue, claim (SKIP LOCKED), complete'
SELECT pglockkit.enqueue_job('emails', '{"to": "ana@example.com"}') AS job_id \gset
SELECT id AS claimed_id, token AS token_7, payload ->> 'to' AS claimed_to
  FROM pglockkit.claim_job('emails', 'worker-7', lease => '2 minutes') \gset
SELECT :claimed_id = :job_id AS is_our_job, :'claimed_to' AS payload_to;
-- worker-7 gives the job back (shutting down); worker-8 claims it with a new token.
SELECT pglockkit.release_job(:job_id, :token_7);
SELECT token AS token_8 FROM pglockkit.claim_job('emails', 'worker-8') \gset
SELECT pglockkit.complete_job(:job_id, :token_7) AS stale_token;  -- f: worker-7's claim is over
SELECT pglockkit.complete_job(:job_id, :token_8) AS live_token;   -- t: done
SELECT queue, ready, running, done FROM pglockkit.queue_stats WHERE queue = 'emails';
