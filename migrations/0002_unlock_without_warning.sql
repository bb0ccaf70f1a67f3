-- pglockkit 0002: an unlock of a lock not held raises its 55000 alone, without the server's own
-- WARNING before it (the function sets client_min_messages = error for its call).
SET LOCAL search_path = pg_catalog, pg_temp;

CREATE OR REPLACE FUNCTION pglockkit._unlock(ns text, label text, key bigint) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET client_min_messages = error
AS $$
BEGIN
    IF NOT pg_catalog.pg_advisory_unlock(key) THEN
        RAISE EXCEPTION 'session lock %/% (key %) is not held by this session', ns, label, key
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Session locks belong to the server session that took them. Through a transaction-mode pooler (PgBouncer) the unlock can reach another session, and the lock stays held: take session locks on a dedicated, unpooled connection.';
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._unlock(text, text, bigint) IS
    'Private: releases one hold of a session advisory lock, or raises 55000 if this session does not hold it.';

SELECT pglockkit._grant_privileges();
