-- Phase 2 of the two-phase reservation: confirm reservation :id for :holder, exactly once.
-- Included by two_phase_reservation.sql.
--
-- A short transaction: lock the reservation's row (or SELECT ... FROM recipe_reservations
-- WHERE id = $1 FOR UPDATE), check it, write. A second confirm of the same row waits for this
-- one, then finds it confirmed; a reserver retiring the expired hold waits too.
BEGIN;
SELECT pglockkit.lock_rows('recipe_reservations', ARRAY[:id]::bigint[], '200ms') AS found \gset
SELECT CASE WHEN holder <> :'holder' THEN 'not yours'
            WHEN status = 'confirmed' THEN 'already confirmed'
            WHEN status = 'expired' OR expires_at <= clock_timestamp() THEN 'expired'
            ELSE 'confirmed' END AS outcome
  FROM recipe_reservations WHERE id = :id \gset
SELECT :'outcome' = 'confirmed' AS go \gset
\if :go
    UPDATE recipe_reservations SET status = 'confirmed', confirmed_at = clock_timestamp()
     WHERE id = :id;
    INSERT INTO recipe_outbox (reservation_id, message)
    VALUES (:id, :'holder' || ': your reservation ' || :id || ' is confirmed');
\else
    -- An expired hold that nobody took over yet is marked expired too.
    UPDATE recipe_reservations SET status = 'expired'
     WHERE id = :id AND status = 'held' AND expires_at <= clock_timestamp();
\endif
COMMIT;
\echo :holder confirms reservation :id: :outcome
