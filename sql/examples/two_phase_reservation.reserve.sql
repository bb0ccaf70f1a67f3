-- Phase 1 of the two-phase reservation: hold :key for :holder for :ttl, unless it is held or
-- confirmed. Included by two_phase_reservation.sql; sets :free, and :reserved_id when it holds.
--
-- A short transaction. There is no row to lock before the insert, so lock the natural key (at
-- most 200 ms, else 55P03 naming the holder). Every reserver of the key takes this lock, so no
-- other reserver can find the key free between this check and this insert.
BEGIN;
SELECT pglockkit.xact_lock('reservations', :'key', '200ms') AS lock_key \gset
-- An expired hold stays, marked expired, for the record. If a confirm holds that row's lock, this
-- waits for it, and leaves the row alone if the confirm went through.
UPDATE recipe_reservations SET status = 'expired'
 WHERE natural_key = :'key' AND status = 'held' AND expires_at <= clock_timestamp();
SELECT count(*) = 0 AS free, max(holder) AS live_holder FROM recipe_reservations
 WHERE natural_key = :'key' AND status IN ('held', 'confirmed') \gset
\if :free
    INSERT INTO recipe_reservations (natural_key, holder, status, expires_at)
    VALUES (:'key', :'holder', 'held', clock_timestamp() + :'ttl')
    RETURNING id AS reserved_id \gset
    \echo :holder holds :key
\else
    \echo :holder finds :key taken by :live_holder
\endif
COMMIT;
