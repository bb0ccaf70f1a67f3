-- The two-phase reservation in plain SQL: an advisory lock on the natural key before the insert,
-- a row lock on confirm. Explained in docs/recipes.md; the Python version is
-- examples/two_phase_reservation.py. The statements of each phase are in
-- two_phase_reservation.reserve.sql and two_phase_reservation.confirm.sql.
--
-- Any client runs those statements with its driver's parameters; here psql variables stand for
-- them, and psql's \if stands for the application's branch. Run it in a scratch database with
-- pglockkit installed, from the repository's root or from here:
--
--     psql -X -q -v ON_ERROR_STOP=1 -f sql/examples/two_phase_reservation.sql
--
-- It plays agents in one session: A holds a slot, B finds it taken, A confirms, a retried confirm
-- does nothing; then a hold that expires is taken over and its late confirm is refused.

SET client_min_messages = warning;  -- no "already exists, skipping" on a second run
CREATE TABLE IF NOT EXISTS recipe_reservations (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    natural_key  text NOT NULL,
    holder       text NOT NULL,
    status       text NOT NULL CHECK (status IN ('held', 'confirmed', 'expired')),
    held_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at   timestamptz NOT NULL,
    confirmed_at timestamptz
);
CREATE INDEX IF NOT EXISTS recipe_reservations_natural_key ON recipe_reservations (natural_key);
-- The backstop: at most one live reservation per key, whatever a writer does. The lock still
-- matters: losers see "taken" instead of a unique_violation that aborts their transaction.
CREATE UNIQUE INDEX IF NOT EXISTS recipe_reservations_one_live
    ON recipe_reservations (natural_key) WHERE status IN ('held', 'confirmed');
CREATE TABLE IF NOT EXISTS recipe_outbox (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    reservation_id bigint NOT NULL REFERENCES recipe_reservations (id),
    message        text NOT NULL
);
SELECT pglockkit.register_namespace('reservations',
       description => 'reservations by natural key: lock the key before the insert') AS ns_id \gset
DELETE FROM recipe_outbox WHERE reservation_id IN
    (SELECT id FROM recipe_reservations WHERE natural_key LIKE 'sql-demo:%');
DELETE FROM recipe_reservations WHERE natural_key LIKE 'sql-demo:%';

-- A holds the 10:00 slot; B, a moment later, finds it taken.
\set key 'sql-demo:slot:2026-03-06T10:00/room-3'
\set ttl '30 seconds'
\set holder 'A'
\ir two_phase_reservation.reserve.sql
\set a_id :reserved_id
\set holder 'B'
\ir two_phase_reservation.reserve.sql

-- A confirms; the same request again (a retry, a double click) changes nothing.
\set id :a_id
\set holder 'A'
\ir two_phase_reservation.confirm.sql
\ir two_phase_reservation.confirm.sql
SELECT count(*) AS confirmation_messages FROM recipe_outbox WHERE reservation_id = :a_id;

-- C holds the 11:00 slot for one second and never confirms. After the hold expires, D takes the
-- key over, and C's late confirm is refused.
\set key 'sql-demo:slot:2026-03-06T11:00/room-3'
\set ttl '1 second'
\set holder 'C'
\ir two_phase_reservation.reserve.sql
\set c_id :reserved_id
SELECT pg_sleep(1.2) AS slept \gset
\set ttl '30 seconds'
\set holder 'D'
\ir two_phase_reservation.reserve.sql
\set id :c_id
\set holder 'C'
\ir two_phase_reservation.confirm.sql

SELECT natural_key, holder, status FROM recipe_reservations
 WHERE natural_key LIKE 'sql-demo:%' ORDER BY id;
