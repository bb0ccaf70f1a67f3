-- The bounded critical section in plain SQL: slow work outside the lock, then a short transaction
-- that takes the lock with a timeout, re-checks a version and writes only if nothing changed.
-- Explained in docs/recipes.md; the Python version is examples/bounded_critical_section.py.
--
-- Any client runs these statements with its driver's parameters; here psql variables stand for
-- them, and psql's \if stands for the application's branch. Run it in a scratch database with
-- pglockkit installed:
--
--     psql -X -q -v ON_ERROR_STOP=1 -f sql/examples/bounded_critical_section.sql
--
-- It plays two agents, A and B, in one session: both read version 0 and compute; B writes first;
-- A's re-check then finds version 1 and A does not overwrite B's result.

SET client_min_messages = warning;  -- no "already exists, skipping" on a second run
CREATE TABLE IF NOT EXISTS recipe_reports (
    name       text PRIMARY KEY,
    version    bigint NOT NULL,
    body       jsonb NOT NULL,
    updated_by text NOT NULL,
    updated_at timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS recipe_report_log (
    name      text NOT NULL,
    version   bigint NOT NULL,
    based_on  bigint NOT NULL,
    writer    text NOT NULL,
    locked_at timestamptz NOT NULL,
    PRIMARY KEY (name, version)
);
SELECT pglockkit.register_namespace('reports',
       description => 'shared reports: re-check a version under a short lock') AS ns_id \gset
\set name 'sql-demo'
DELETE FROM recipe_report_log WHERE name = :'name';
DELETE FROM recipe_reports WHERE name = :'name';

-- Step 1, agents A and B: read the version the computation starts from (a missing row is
-- version 0). No lock, no open transaction.
SELECT coalesce((SELECT version FROM recipe_reports WHERE name = :'name'), 0) AS a_read \gset
SELECT coalesce((SELECT version FROM recipe_reports WHERE name = :'name'), 0) AS b_read \gset

-- Step 2: each computes its new body, for as long as it takes (a model call, an HTTP request).
-- Still no lock and no transaction: nobody waits for this.
\set b_body '{"total": 1234, "by": "B"}'
\set a_body '{"total": 1234, "by": "A"}'

-- Step 3, agent B: the bounded critical section. The lock waits at most 200 ms (else 55P03,
-- whose detail names the holder); the holders only re-check and write, so it is rarely waited.
BEGIN;
SELECT pglockkit.xact_lock('reports', :'name', '200ms') AS key \gset
SELECT coalesce((SELECT version FROM recipe_reports WHERE name = :'name'), 0) = :b_read AS unchanged,
       clock_timestamp() AS locked_at \gset
\if :unchanged
    INSERT INTO recipe_reports (name, version, body, updated_by, updated_at)
    VALUES (:'name', :b_read + 1, :'b_body', 'B', clock_timestamp())
    ON CONFLICT (name) DO UPDATE
       SET version = excluded.version, body = excluded.body,
           updated_by = excluded.updated_by, updated_at = excluded.updated_at;
    INSERT INTO recipe_report_log (name, version, based_on, writer, locked_at)
    VALUES (:'name', :b_read + 1, :b_read, 'B', :'locked_at');
    COMMIT;
    \echo B: wrote version 1
\else
    ROLLBACK;
    \echo B: the version changed while computing: recompute from the new body, or give up
\endif

-- Step 3, agent A: the same statements. Its re-check finds version 1, not the 0 it computed
-- from, so its result is stale and it writes nothing.
BEGIN;
SELECT pglockkit.xact_lock('reports', :'name', '200ms') AS key \gset
SELECT coalesce((SELECT version FROM recipe_reports WHERE name = :'name'), 0) = :a_read AS unchanged,
       clock_timestamp() AS locked_at \gset
\if :unchanged
    INSERT INTO recipe_reports (name, version, body, updated_by, updated_at)
    VALUES (:'name', :a_read + 1, :'a_body', 'A', clock_timestamp())
    ON CONFLICT (name) DO UPDATE
       SET version = excluded.version, body = excluded.body,
           updated_by = excluded.updated_by, updated_at = excluded.updated_at;
    INSERT INTO recipe_report_log (name, version, based_on, writer, locked_at)
    VALUES (:'name', :a_read + 1, :a_read, 'A', :'locked_at');
    COMMIT;
    \echo A: wrote version 1
\else
    ROLLBACK;
    \echo A: the version changed while computing: recompute from the new body, or give up
\endif

-- B's result stands.
SELECT name, version, body ->> 'by' AS written_by FROM recipe_reports WHERE name = :'name';
