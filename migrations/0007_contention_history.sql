-- pglockkit 0007: contention history. Waits vanish once contention is over; sample() keeps a
-- compact record (per lock key: holders, waiters, longest wait, the holders' queries; per queue:
-- lag), and contention_report() tells which keys serialized the swarm and how parallel each
-- namespace really was (seed 001: workers vs effective parallelism).

CREATE TABLE pglockkit.lock_samples (
    sampled_at     timestamptz NOT NULL,
    namespace      text        NOT NULL,
    key            bigint,
    key1           integer,
    key2           integer,
    holders        integer     NOT NULL,
    waiters        integer     NOT NULL,
    longest_wait   interval,
    holder_queries text[]
);
CREATE INDEX lock_samples_time ON pglockkit.lock_samples (sampled_at);
COMMENT ON TABLE pglockkit.lock_samples IS
    'One row per advisory lock key per sample() call: holders, waiters, the longest wait and the holders'' queries. Read it through contention_report().';

CREATE TABLE pglockkit.queue_samples (
    sampled_at       timestamptz NOT NULL,
    queue            text        NOT NULL,
    ready            bigint      NOT NULL,
    running          bigint      NOT NULL,
    oldest_ready_age interval
);
CREATE INDEX queue_samples_time ON pglockkit.queue_samples (sampled_at);
COMMENT ON TABLE pglockkit.queue_samples IS 'Queue depth and lag per sample() call.';

-- Readers (pg_monitor, pglockkit_user) get the samples through views, like every other view.
CREATE VIEW pglockkit.lock_history AS SELECT * FROM pglockkit.lock_samples;
COMMENT ON VIEW pglockkit.lock_history IS 'The advisory-lock samples recorded by sample(), one row per key per sample.';
CREATE VIEW pglockkit.queue_history AS SELECT * FROM pglockkit.queue_samples;
COMMENT ON VIEW pglockkit.queue_history IS 'Queue depth and lag recorded by sample().';

CREATE FUNCTION pglockkit.sample(retention interval DEFAULT '7 days') RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now  timestamptz := pg_catalog.clock_timestamp();
    v_rows integer;
BEGIN
    IF retention IS NULL THEN
        RAISE EXCEPTION 'retention must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF retention OPERATOR(pg_catalog.<) interval '0' THEN
        RAISE EXCEPTION 'retention must not be negative, got %', retention USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO pglockkit.lock_samples (sampled_at, namespace, key, key1, key2, holders, waiters, longest_wait, holder_queries)
    SELECT v_now, al.namespace, al.key, al.key1, al.key2,
           pg_catalog.count(*) FILTER (WHERE al.granted), pg_catalog.count(*) FILTER (WHERE NOT al.granted),
           pg_catalog.max(al.wait_time),
           pg_catalog.array_agg(DISTINCT pg_catalog.left(al.query, 200)) FILTER (WHERE al.granted AND al.query IS NOT NULL)
      FROM pglockkit.advisory_locks al
     GROUP BY al.namespace, al.key, al.key1, al.key2;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    INSERT INTO pglockkit.queue_samples (sampled_at, queue, ready, running, oldest_ready_age)
    SELECT v_now, q.queue, q.ready, q.running, q.oldest_ready_age FROM pglockkit.queue_stats q;
    DELETE FROM pglockkit.lock_samples s WHERE s.sampled_at OPERATOR(pg_catalog.<) (v_now OPERATOR(pg_catalog.-) retention);
    DELETE FROM pglockkit.queue_samples s WHERE s.sampled_at OPERATOR(pg_catalog.<) (v_now OPERATOR(pg_catalog.-) retention);
    RETURN v_rows;
END
$$;
COMMENT ON FUNCTION pglockkit.sample(interval) IS
    'Records one snapshot of advisory-lock contention (per key: holders, waiters, longest wait, holders'' queries) and queue lag, and deletes samples older than retention; returns the lock rows recorded. Call it every few seconds: from pg_cron, or `pglockkit sample --every 5s`.';

CREATE FUNCTION pglockkit.contention_report(since interval DEFAULT '1 hour')
RETURNS TABLE (namespace text, key bigint, key1 integer, key2 integer, samples bigint,
               samples_with_waiters bigint, max_waiters integer, avg_waiters numeric, longest_wait interval,
               holder_queries text[], namespace_sessions numeric, namespace_parallelism numeric)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    WITH window_ AS (
        SELECT s.* FROM pglockkit.lock_history s
         WHERE s.sampled_at OPERATOR(pg_catalog.>=) (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) contention_report.since)
    ), per_ns AS (
        -- Per namespace and sample: sessions involved (holding or waiting) vs sessions holding.
        SELECT w.namespace, w.sampled_at,
               pg_catalog.sum(w.holders OPERATOR(pg_catalog.+) w.waiters) AS sessions, pg_catalog.sum(w.holders) AS holding
          FROM window_ w GROUP BY w.namespace, w.sampled_at
    ), ns AS (
        SELECT p.namespace, pg_catalog.round(pg_catalog.avg(p.sessions), 2) AS sessions,
               pg_catalog.round(pg_catalog.avg(p.holding::numeric OPERATOR(pg_catalog./) p.sessions), 3) AS parallelism
          FROM per_ns p GROUP BY p.namespace
    )
    SELECT w.namespace, w.key, w.key1, w.key2, pg_catalog.count(*),
           pg_catalog.count(*) FILTER (WHERE w.waiters OPERATOR(pg_catalog.>) 0),
           pg_catalog.max(w.waiters), pg_catalog.round(pg_catalog.avg(w.waiters), 2), pg_catalog.max(w.longest_wait),
           (SELECT pg_catalog.array_agg(DISTINCT q) FROM window_ w2, pg_catalog.unnest(w2.holder_queries) AS q
             WHERE w2.namespace OPERATOR(pg_catalog.=) w.namespace AND w2.key IS NOT DISTINCT FROM w.key
               AND w2.key1 IS NOT DISTINCT FROM w.key1 AND w2.key2 IS NOT DISTINCT FROM w.key2),
           ns.sessions, ns.parallelism
      FROM window_ w JOIN ns ON ns.namespace OPERATOR(pg_catalog.=) w.namespace
     GROUP BY w.namespace, w.key, w.key1, w.key2, ns.sessions, ns.parallelism
     ORDER BY pg_catalog.count(*) FILTER (WHERE w.waiters OPERATOR(pg_catalog.>) 0) DESC, pg_catalog.max(w.waiters) DESC
$$;
COMMENT ON FUNCTION pglockkit.contention_report(interval) IS
    'Which advisory keys serialized the swarm over the last since: per key, in how many samples it had waiters, the most and average waiters, the longest wait and the holders'' queries; per namespace, the average sessions involved and the effective parallelism (sessions holding / sessions involved: 1.0 = nobody waits, 1/n = n sessions queue behind one).';

DO $$ BEGIN PERFORM pglockkit._grant_privileges(); END $$;
-- A read-only report: monitoring roles may run it too.
GRANT EXECUTE ON FUNCTION pglockkit.contention_report(interval) TO pg_monitor;
