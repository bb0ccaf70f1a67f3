-- Privileges: roles, grants and who may call what
--
-- The current definition of each object, once. A change edits this file and adds a delta
-- migration (see CONTRIBUTING.md); a test checks that both build the same schema.

-- The role that callers are granted. Created here when the installer may create roles; otherwise
-- a DBA creates it (CREATE ROLE pglockkit_user NOLOGIN) and reruns `pglockkit install`, which
-- re-applies the grants. Roles are cluster-wide, so uninstall never drops it.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'pglockkit_user') THEN
        BEGIN
            CREATE ROLE pglockkit_user NOLOGIN;
        EXCEPTION
            WHEN insufficient_privilege THEN
                RAISE NOTICE 'pglockkit: cannot create role pglockkit_user (no CREATEROLE); grants to it are skipped until it exists';
            WHEN duplicate_object OR unique_violation THEN
                NULL;  -- another database's installer created it at the same moment
        END;
    END IF;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Privileges: EXECUTE is revoked from PUBLIC and granted to pglockkit_user; read-only tables and
-- views to pglockkit_user and pg_monitor. Every migration ends by calling this, and so does
-- `pglockkit install`, so a role created after installation gets its grants on the next install.
-- ---------------------------------------------------------------------------------------------
CREATE FUNCTION pglockkit._grant_privileges() RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_user  boolean := EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'pglockkit_user');
    v_admin boolean := EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'pglockkit_admin');
    r       record;
BEGIN
    FOR r IN SELECT p.oid::regprocedure AS sig, p.proname
               FROM pg_catalog.pg_proc p
              WHERE p.pronamespace = 'pglockkit'::regnamespace
    LOOP
        EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', r.sig);
        CONTINUE WHEN r.proname = '_grant_privileges';
        IF pglockkit._admin_only(r.proname) THEN
            IF v_user THEN
                EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM pglockkit_user', r.sig);
            END IF;
            IF v_admin THEN
                EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO pglockkit_admin', r.sig);
            END IF;
        ELSIF v_user THEN
            EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO pglockkit_user', r.sig);
        END IF;
    END LOOP;
    GRANT USAGE ON SCHEMA pglockkit TO pg_monitor;
    GRANT SELECT ON pglockkit.namespaces TO pg_monitor;
    FOR r IN SELECT c.oid::regclass AS rel FROM pg_catalog.pg_class c
              WHERE c.relnamespace = 'pglockkit'::regnamespace AND c.relkind = 'v'
    LOOP
        EXECUTE pg_catalog.format('GRANT SELECT ON %s TO pg_monitor', r.rel);
    END LOOP;
    IF v_user THEN
        GRANT USAGE ON SCHEMA pglockkit TO pglockkit_user;
        GRANT SELECT ON pglockkit.namespaces TO pglockkit_user;
        FOR r IN SELECT c.oid::regclass AS rel FROM pg_catalog.pg_class c
                  WHERE c.relnamespace = 'pglockkit'::regnamespace AND c.relkind = 'v'
        LOOP
            EXECUTE pg_catalog.format('GRANT SELECT ON %s TO pglockkit_user', r.rel);
        END LOOP;
    END IF;
    IF v_admin THEN
        GRANT USAGE ON SCHEMA pglockkit TO pglockkit_admin;
    END IF;
END
$$;
COMMENT ON FUNCTION pglockkit._grant_privileges() IS
    'Private: (re)applies pglockkit''s grants: EXECUTE to pglockkit_user (if it exists) except the admin-only functions, which go to pglockkit_admin (if it exists); nothing to PUBLIC; SELECT on views and the namespace registry to pg_monitor and pglockkit_user.';

-- The views call _advisory_label with the reader's privileges: monitoring roles need it too.
GRANT EXECUTE ON FUNCTION pglockkit._advisory_label(smallint, oid, oid) TO pg_monitor;

-- A read-only report: monitoring roles may run it too.
GRANT EXECUTE ON FUNCTION pglockkit.contention_report(interval) TO pg_monitor;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'pglockkit_admin') THEN
        BEGIN
            CREATE ROLE pglockkit_admin NOLOGIN;
        EXCEPTION
            WHEN insufficient_privilege THEN
                RAISE NOTICE 'pglockkit: cannot create role pglockkit_admin (no CREATEROLE); its grants are skipped until it exists';
            WHEN duplicate_object OR unique_violation THEN
                NULL;  -- another database's installer created it at the same moment
        END;
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'pglockkit_admin')
       AND EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'pglockkit_user') THEN
        BEGIN
            GRANT pglockkit_user TO pglockkit_admin;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'pglockkit: cannot grant pglockkit_user to pglockkit_admin; a DBA may: GRANT pglockkit_user TO pglockkit_admin';
        END;
    END IF;
END
$$;

CREATE FUNCTION pglockkit._admin_only(proname name) RETURNS boolean
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT proname = ANY ('{register_namespace,list_jobs,prune_jobs,prune_leases,prune_runs,retry_dead_jobs,sample,schedule,set_max_payload_bytes,unschedule,set_rate_limit,remove_rate_limit,pause_queue,resume_queue}'::name[]) $$;
COMMENT ON FUNCTION pglockkit._admin_only(name) IS
    'Private: true for the functions only pglockkit_admin may execute (they change what every worker works with or may store, or delete history).';

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;

-- More that the views call with the reader's privileges (0017): lock_waits and advisory_locks
-- _prepared_gid; run_history _advisory_held, and _run_key with what its body calls. Granted after
-- pglockkit_user's grants, in the order the migrations grant them.
GRANT EXECUTE ON FUNCTION pglockkit._prepared_gid(text) TO pg_monitor;
GRANT EXECUTE ON FUNCTION pglockkit._lock_ident(bigint, integer, integer) TO pg_monitor;
GRANT EXECUTE ON FUNCTION pglockkit._advisory_held(bigint, boolean), pglockkit._run_key(text, text),
    pglockkit._key(smallint, text), pglockkit._h47(text), pglockkit._ns_id_from_name(text) TO pg_monitor;
-- contention_report, which pg_monitor may run, checks its argument with _invalid_since.
GRANT EXECUTE ON FUNCTION pglockkit._invalid_since(interval) TO pg_monitor;
