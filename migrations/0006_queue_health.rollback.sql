DROP VIEW pglockkit.xmin_horizon;
DROP VIEW pglockkit.table_health;
