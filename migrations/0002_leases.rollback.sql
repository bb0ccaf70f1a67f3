DROP VIEW pglockkit.lease_status;
DROP FUNCTION pglockkit.check_fence(text, bigint);
DROP FUNCTION pglockkit.release_lease(text, text, bigint);
DROP FUNCTION pglockkit.renew_lease(text, text, bigint, interval);
DROP FUNCTION pglockkit.acquire_lease(text, text, interval, boolean);
DROP FUNCTION pglockkit._check_lease_args(text, text, interval);
DROP FUNCTION pglockkit._advisory_held(bigint, boolean);
DROP FUNCTION pglockkit._lease_session_key(text);
DROP TABLE pglockkit.leases;
