-- Undo 0001. The role pglockkit_user is cluster-wide and may serve other databases: it is left
-- in place (DROP ROLE pglockkit_user, once no database uses it).
DROP SCHEMA pglockkit CASCADE;
