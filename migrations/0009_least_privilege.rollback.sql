-- Back to 0001's grants: every function to pglockkit_user. pglockkit_admin stays (roles are
-- cluster-wide), without grants in this database.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'pglockkit_admin') THEN
        REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pglockkit FROM pglockkit_admin;
        REVOKE ALL ON SCHEMA pglockkit FROM pglockkit_admin;
    END IF;
END
$$;
DROP FUNCTION pglockkit._admin_only(name);
CREATE OR REPLACE FUNCTION pglockkit._grant_privileges() RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_user boolean := EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) 'pglockkit_user');
    r      record;
BEGIN
    FOR r IN SELECT p.oid::regprocedure AS sig, p.proname
               FROM pg_catalog.pg_proc p
              WHERE p.pronamespace OPERATOR(pg_catalog.=) 'pglockkit'::regnamespace
    LOOP
        EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', r.sig);
        IF v_user AND r.proname OPERATOR(pg_catalog.<>) '_grant_privileges' THEN
            EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO pglockkit_user', r.sig);
        END IF;
    END LOOP;
    GRANT USAGE ON SCHEMA pglockkit TO pg_monitor;
    GRANT SELECT ON pglockkit.namespaces TO pg_monitor;
    FOR r IN SELECT c.oid::regclass AS rel FROM pg_catalog.pg_class c
              WHERE c.relnamespace OPERATOR(pg_catalog.=) 'pglockkit'::regnamespace AND c.relkind = 'v'
    LOOP
        EXECUTE pg_catalog.format('GRANT SELECT ON %s TO pg_monitor', r.rel);
    END LOOP;
    IF v_user THEN
        GRANT USAGE ON SCHEMA pglockkit TO pglockkit_user;
        GRANT SELECT ON pglockkit.namespaces TO pglockkit_user;
        FOR r IN SELECT c.oid::regclass AS rel FROM pg_catalog.pg_class c
                  WHERE c.relnamespace OPERATOR(pg_catalog.=) 'pglockkit'::regnamespace AND c.relkind = 'v'
        LOOP
            EXECUTE pg_catalog.format('GRANT SELECT ON %s TO pglockkit_user', r.rel);
        END LOOP;
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._grant_privileges() IS
    'Private: (re)applies pglockkit''s grants: EXECUTE to pglockkit_user (if it exists) and not PUBLIC; SELECT on views and the namespace registry to pg_monitor and pglockkit_user.';

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;
