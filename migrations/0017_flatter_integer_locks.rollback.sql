-- Back to the xact_lock(bigint) and try_xact_lock(bigint) of 0001.

CREATE OR REPLACE FUNCTION pglockkit.try_xact_lock(ns text, resource bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN RETURN pg_catalog.pg_try_advisory_xact_lock(pglockkit.lock_key(ns, resource)); END $$;

CREATE OR REPLACE FUNCTION pglockkit.xact_lock(ns text, resource bigint, timeout interval DEFAULT NULL) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN RETURN pglockkit._xact_lock(ns, resource::text, pglockkit.lock_key(ns, resource), timeout); END $$;
