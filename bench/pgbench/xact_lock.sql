-- pglockkit.xact_lock on a resource of this client's own (no contention): one transaction per line.
-- The resource is bound as a text parameter, as a client binds it (the bare script binds its key).
SELECT pglockkit.xact_lock('bench', :client_id::text);
