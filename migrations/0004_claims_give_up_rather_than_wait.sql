-- pglockkit 0004: claim_job gives up after 10 ms, returning no rows, where PostgreSQL would make
-- it wait for a row despite SKIP LOCKED (following a row's update chain); such a wait could close
-- a deadlock with a completion (40P01).
SET LOCAL search_path = pg_catalog, pg_temp;

CREATE OR REPLACE FUNCTION pglockkit.claim_job(
    queue text, worker text, lease interval DEFAULT '5 minutes', batch integer DEFAULT 1)
RETURNS SETOF pglockkit.claimed_job
LANGUAGE plpgsql VOLATILE SECURITY DEFINER ROWS 1
SET search_path = pg_catalog, pg_temp
SET enable_bitmapscan = off
SET enable_seqscan = off
-- A generic plan, made once per session: under the default (auto) mode PL/pgSQL re-planned this
-- multi-CTE statement at every call, which cost more than executing it (measured: claim+complete
-- 0.46 -> 0.74 of the bare statements).
SET plan_cache_mode = force_generic_plan
-- The longest a claim waits for a lock before it gives up and returns nothing (see the block).
SET lock_timeout = '10ms'
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := pg_catalog.clock_timestamp();
    v_keyed   boolean;
    v_expired boolean;
    v_job     pglockkit.claimed_job;
    v_found   boolean;
    v_held    boolean;
    v_pause   float8;
    v_rated   boolean;
    v_paused  boolean;
BEGIN
    -- (use_column: ON CONFLICT (queue, key) names columns; every parameter below is qualified.)
    -- The argument checks, as one expression when the arguments are good (each IF is an
    -- expression evaluation of its own); the statements inside say which one is bad.
    IF claim_job.queue IS NULL OR claim_job.queue = ''
       OR claim_job.lease IS NULL OR claim_job.lease <= interval '0'
       OR claim_job.lease > pglockkit._longest_job_lease()  -- before the sum, which it keeps in range
       OR v_now + claim_job.lease <= v_now
       OR claim_job.worker IS NULL OR claim_job.batch IS NULL OR claim_job.worker = ''
       OR claim_job.batch NOT BETWEEN 1 AND 1000 THEN
        IF claim_job.queue IS NULL THEN
            RAISE EXCEPTION 'queue must not be null' USING ERRCODE = 'null_value_not_allowed';
        END IF;
        IF claim_job.queue = '' THEN
            RAISE EXCEPTION 'queue name must not be empty' USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF claim_job.lease IS NULL THEN
            RAISE EXCEPTION 'lease must not be null' USING ERRCODE = 'null_value_not_allowed';
        END IF;
        PERFORM pglockkit._check_lease(claim_job.lease);
        IF claim_job.worker IS NULL OR claim_job.batch IS NULL THEN
            RAISE EXCEPTION 'worker and batch must not be null' USING ERRCODE = 'null_value_not_allowed';
        END IF;
        IF claim_job.worker = '' THEN
            RAISE EXCEPTION 'worker must not be empty' USING ERRCODE = 'invalid_parameter_value',
                HINT = 'Name the worker (e.g. host:pid) so that a stuck job says who had it.';
        END IF;
        IF claim_job.batch NOT BETWEEN 1 AND 1000 THEN
            RAISE EXCEPTION 'batch % is out of range', claim_job.batch
                USING ERRCODE = 'invalid_parameter_value', HINT = 'batch is 1 to 1000.';
        END IF;
    END IF;

    -- Every statement below locks with SKIP LOCKED, but PostgreSQL still waits in one case: when
    -- the updater of a row ended just as this claim reached it, the newer versions of the row are
    -- locked by following its update chain, and that walk waits for a transaction that holds the
    -- newest one, whatever the wait policy (heap_lock_updated_tuple). Such a wait, while this claim
    -- held rows it had locked in claim order, now and then closed a cycle with a completion that
    -- locks in id order (40P01, about once in an hour of racing claims). So the claim runs in a
    -- block of its own under lock_timeout 10 ms (the function's SET): a claim that would wait
    -- longer, or that the deadlock detector picks, undoes what it did, which frees every row it
    -- locked, and returns nothing, as a claim that found every job taken does. Every statement
    -- that can wait runs before any row is returned (the rows come from the statement that locks).
    BEGIN
        -- The common case first, as the bare statement. Batch 1, the usual worker loop: claim the
        -- first due job in claim order if it has no concurrency key and the queue has no expired lease
        -- (checked inside the statement, before any row is locked: the planner makes it a one-time
        -- filter). A keyed first job is locked but not claimed here, and the keyed path below runs
        -- (the lock lasts until the caller's transaction ends, at once for an autocommit claim; other
        -- claimers skip that job meanwhile). For one job this is what that path would pick, without
        -- its per-key bookkeeping, whether or not the queue has other keyed jobs. A job with a rate
        -- key: claimed here if _take_rate_token finds the key without a limit or takes one of its
        -- tokens in this statement (a call for such jobs only: a job without a rate key costs one
        -- column test); otherwise left to the keyed path. A paused queue: a one-time filter too.
        IF claim_job.batch = 1
           AND pg_catalog.current_setting('server_version_num')::integer >= 180000 THEN
            -- PostgreSQL 18 and later: the scan in claim order is the bare statement's. Its btree skip
            -- scan jumps over the entries of jobs_ready that are scheduled for later (run_at is an index
            -- condition under the skipped priority column), so the walk over priorities below is not
            -- needed, and cost a third of this function's own time. Checked at each call, not at
            -- install, so that a pg_upgrade to 18 takes this branch without a migration.
            RETURN QUERY
            UPDATE pglockkit.jobs j
               SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                   token = pglockkit._next_token('pglockkit.job_tokens', j.token), lease_expires_at = v_now + claim_job.lease,
                   started_at = v_now
             WHERE j.id = (
                   SELECT r.id
                     FROM pglockkit.jobs r
                    WHERE r.queue = claim_job.queue AND r.status = 'queued'
                      AND r.run_at <= v_now
                    ORDER BY r.priority DESC, r.run_at, r.id
                    LIMIT 1
                      FOR UPDATE SKIP LOCKED)
               AND j.concurrency_key IS NULL
               AND (j.rate_key IS NULL OR pglockkit._take_rate_token(claim_job.queue, j.rate_key, v_now))
               AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                                WHERE e.queue = claim_job.queue AND e.lease_expires_at <= v_now)
               AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
            RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key;
        ELSIF claim_job.batch = 1 THEN
            -- Before 18, first the queue's highest priority alone (one probe finds it): the common
            -- case, a queue whose top priority has a due job, costs two index probes and no walk.
            RETURN QUERY
            UPDATE pglockkit.jobs j
               SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                   token = pglockkit._next_token('pglockkit.job_tokens', j.token), lease_expires_at = v_now + claim_job.lease,
                   started_at = v_now
             WHERE j.id = (
                   SELECT r.id
                     FROM pglockkit.jobs r
                    WHERE r.queue = claim_job.queue AND r.status = 'queued'
                      AND r.priority = (
                          SELECT t.priority FROM pglockkit.jobs t
                           WHERE t.queue = claim_job.queue AND t.status = 'queued'
                           ORDER BY t.priority DESC LIMIT 1)
                      AND r.run_at <= v_now
                    ORDER BY r.run_at, r.id
                    LIMIT 1
                      FOR UPDATE SKIP LOCKED)
               AND j.concurrency_key IS NULL
               AND (j.rate_key IS NULL OR pglockkit._take_rate_token(claim_job.queue, j.rate_key, v_now))
               AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                                WHERE e.queue = claim_job.queue AND e.lease_expires_at <= v_now)
               AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
            RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key;
            IF NOT FOUND THEN
                -- The top priority has no due job free (or its first is keyed): walk the priorities.
                -- (Batches walk on every version: the walk's cost is shared by the batch.)
                RETURN QUERY
                WITH RECURSIVE
                -- The queue's priorities with queued jobs, highest first, one index probe each. Joined
                -- laterally to each priority's due jobs (run_at, id order) under a LIMIT, the rows come in
                -- claim order: the recursive union yields the priorities in the order it finds them, and
                -- the nested loop keeps that order (it cannot be another join: the subquery is lateral).
                priorities(priority) AS (
                    (SELECT r.priority FROM pglockkit.jobs r
                      WHERE r.queue = claim_job.queue AND r.status = 'queued'
                      ORDER BY r.priority DESC LIMIT 1)
                    UNION ALL
                    SELECT (SELECT r.priority FROM pglockkit.jobs r
                             WHERE r.queue = claim_job.queue AND r.status = 'queued'
                               AND r.priority < p.priority
                             ORDER BY r.priority DESC LIMIT 1)
                      FROM priorities p WHERE p.priority IS NOT NULL
                )
                UPDATE pglockkit.jobs j
                   SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                       token = pglockkit._next_token('pglockkit.job_tokens', j.token), lease_expires_at = v_now + claim_job.lease,
                       started_at = v_now
                 WHERE j.id = (
                       SELECT x.id
                         FROM priorities p CROSS JOIN LATERAL (
                              SELECT r.id
                                FROM pglockkit.jobs r
                               WHERE r.queue = claim_job.queue AND r.status = 'queued'
                                 AND r.priority = p.priority AND r.run_at <= v_now
                               ORDER BY r.run_at, r.id
                               LIMIT 1
                                 FOR UPDATE SKIP LOCKED) x
                        LIMIT 1)
                   AND j.concurrency_key IS NULL
                   AND (j.rate_key IS NULL OR pglockkit._take_rate_token(claim_job.queue, j.rate_key, v_now))
                   AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                                    WHERE e.queue = claim_job.queue AND e.lease_expires_at <= v_now)
                   AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
                RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key;
            END IF;
        ELSE
            -- A batch: the first due jobs in claim order, if the queue has no concurrency keys (no key
            -- row: no queued or running job of it has a key, or had one since prune_jobs last ran;
            -- the enqueue creates the key's row first), no rate limit, no expired lease and is not
            -- paused, then sorted into claim order.
            RETURN QUERY
            WITH RECURSIVE
            -- The queue's priorities with queued jobs, highest first, one index probe each.
            priorities(priority) AS (
                (SELECT r.priority FROM pglockkit.jobs r
                  WHERE r.queue = claim_job.queue AND r.status = 'queued'
                  ORDER BY r.priority DESC LIMIT 1)
                UNION ALL
                SELECT (SELECT r.priority FROM pglockkit.jobs r
                         WHERE r.queue = claim_job.queue AND r.status = 'queued'
                           AND r.priority < p.priority
                         ORDER BY r.priority DESC LIMIT 1)
                  FROM priorities p WHERE p.priority IS NOT NULL
            ), claimed AS (
                UPDATE pglockkit.jobs j
                   SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                       token = pglockkit._next_token('pglockkit.job_tokens', j.token), lease_expires_at = v_now + claim_job.lease,
                       started_at = v_now
                 WHERE j.id = ANY (ARRAY(
                       SELECT x.id
                         FROM priorities p CROSS JOIN LATERAL (
                              SELECT r.id
                                FROM pglockkit.jobs r
                               WHERE r.queue = claim_job.queue AND r.status = 'queued'
                                 AND r.priority = p.priority AND r.run_at <= v_now
                                 AND r.concurrency_key IS NULL
                               ORDER BY r.run_at, r.id
                               LIMIT claim_job.batch
                                 FOR UPDATE SKIP LOCKED) x
                        LIMIT claim_job.batch))
                   AND NOT EXISTS (SELECT FROM pglockkit.job_keys k WHERE k.queue = claim_job.queue)
                   AND NOT EXISTS (SELECT FROM pglockkit.job_rates q WHERE q.queue = claim_job.queue)
                   AND NOT EXISTS (SELECT FROM pglockkit.jobs e
                                    WHERE e.queue = claim_job.queue AND e.lease_expires_at <= v_now)
                   AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
                RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key, j.priority, j.run_at
            )
            SELECT c.id, c.queue, c.payload, c.attempt, c.max_attempts, c.token, c.lease_expires_at, c.concurrency_key
              FROM claimed c
             ORDER BY c.priority DESC, c.run_at, c.id;
        END IF;
        IF FOUND THEN
            RETURN;
        END IF;

        -- Nothing claimed: no job was due, or the queue has keys, rate limits or expired leases, or
        -- is paused. Which one? (Separate statements, so separate snapshots under READ COMMITTED: a
        -- lease found expired only now, or a key added only now, is handled here or by the next claim.
        -- A pause committed only now is seen by every statement below as well: each checks it.)
        SELECT EXISTS (SELECT FROM pglockkit.job_keys k WHERE k.queue = claim_job.queue),
               EXISTS (SELECT FROM pglockkit.jobs j
                        WHERE j.queue = claim_job.queue AND j.lease_expires_at <= v_now),
               EXISTS (SELECT FROM pglockkit.job_rates q WHERE q.queue = claim_job.queue),
               EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
          INTO v_keyed, v_expired, v_rated, v_paused;
        IF v_paused OR (NOT v_keyed AND NOT v_rated AND NOT v_expired) THEN
            RETURN;  -- paused, or no job due (or every due job is being claimed by someone else)
        END IF;

        IF NOT v_keyed AND NOT v_rated THEN
            -- No key of this queue has a row (every queued or running keyed job's key has one: the
            -- enqueue creates it first, and prune_jobs deletes only the rows of keys without such
            -- jobs), and it has no rate limit, but leases expired: reclaim them first, without the
            -- per-key bookkeeping. Keyed jobs are excluded anyway, should one be committed meanwhile.
            RETURN QUERY
            WITH RECURSIVE
            -- The queue's priorities with queued jobs, highest first, one index probe each (none if
            -- the queue is paused).
            priorities(priority) AS (
                (SELECT r.priority FROM pglockkit.jobs r
                  WHERE r.queue = claim_job.queue AND r.status = 'queued'
                    AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
                  ORDER BY r.priority DESC LIMIT 1)
                UNION ALL
                SELECT (SELECT r.priority FROM pglockkit.jobs r
                         WHERE r.queue = claim_job.queue AND r.status = 'queued'
                           AND r.priority < p.priority
                         ORDER BY r.priority DESC LIMIT 1)
                  FROM priorities p WHERE p.priority IS NOT NULL
            ), expired AS (
                SELECT j.id, j.attempt >= j.max_attempts AS exhausted
                  FROM pglockkit.jobs j
                 WHERE j.queue = claim_job.queue AND j.status = 'running'
                   AND j.lease_expires_at <= v_now
                   AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
                 ORDER BY j.lease_expires_at
                 LIMIT claim_job.batch
                   FOR UPDATE SKIP LOCKED
            ), buried AS (
                UPDATE pglockkit.jobs j
                   SET status = 'dead', last_error = 'lease expired', finished_at = v_now, lease_expires_at = NULL
                  FROM expired e
                 WHERE j.id = e.id AND e.exhausted
            ), ready AS (
                SELECT x.id
                  FROM priorities p CROSS JOIN LATERAL (
                       SELECT r.id
                         FROM pglockkit.jobs r
                        WHERE r.queue = claim_job.queue AND r.status = 'queued'
                          AND r.priority = p.priority AND r.run_at <= v_now
                          AND r.concurrency_key IS NULL
                        ORDER BY r.run_at, r.id
                        LIMIT claim_job.batch
                          FOR UPDATE SKIP LOCKED) x
                 LIMIT claim_job.batch
            ), picked AS (
                SELECT c.id FROM (SELECT e.id, 0 AS rank FROM expired e WHERE NOT e.exhausted
                                  UNION ALL SELECT r.id, 1 AS rank FROM ready r) c
                 ORDER BY c.rank
                 LIMIT claim_job.batch
            ), claimed AS (
                UPDATE pglockkit.jobs j
                   SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                       token = pglockkit._next_token('pglockkit.job_tokens', j.token), lease_expires_at = v_now + claim_job.lease,
                       started_at = v_now
                 WHERE j.id = ANY (ARRAY(SELECT p.id FROM picked p))
                RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key, j.priority, j.run_at
            )
            SELECT c.id, c.queue, c.payload, c.attempt, c.max_attempts, c.token, c.lease_expires_at, c.concurrency_key
              FROM claimed c
             ORDER BY c.priority DESC, c.run_at, c.id;
            RETURN;
        END IF;

        -- One statement: expired leases first (their workers died or hung; a reclaim counts as an
        -- attempt, and on the last attempt the job goes dead), then due jobs in priority order.
        -- SKIP LOCKED: a row another claimer holds is skipped, never waited for.
        --
        -- Per-key concurrency: a job of a key starts only while the key's running jobs are fewer than
        -- the smallest concurrency_limit among the key's unfinished (queued or running) jobs, its
        -- limit (one probe of jobs_keys). Due jobs whose key is at its limit (by this statement's
        -- snapshot) are passed over. Then the rows of the keys this claim may change are locked in key
        -- order, SKIP LOCKED: a key whose row another transaction holds (a claim or a completion of
        -- that key, until it commits) is passed over too, so a claim never waits for a lock and can
        -- be in no deadlock, whatever else its transaction holds. Within the batch at most
        -- limit - running jobs per key are kept, running read from the locked row. A key with a job
        -- buried here (dead on its last attempt's expiry) is not claimed in the same call, so that
        -- each key's row changes at most once per statement; a job whose key's row is held is not
        -- buried now, the next claim does it. A key with no row at all (deleted by hand) gets one.
        --
        -- Per-key rate limits (job_rates, GCRA): due jobs whose rate key has no token by this
        -- statement's snapshot are passed over; the rows of the limited rate keys among the
        -- candidates are locked in key order, SKIP LOCKED, and each key gives at most the tokens its
        -- locked row allows, in claim order (reclaims of expired leases count too, a claim is a claim);
        -- its tat then moves by one step per job taken, in this statement. A limited key whose row
        -- another claimer holds is passed over. Rate limits are applied first, then the concurrency
        -- limits to the jobs within their rate; a job is claimed only within both. A rate key without
        -- a limit has none. A paused queue claims nothing (its priorities and expired leases are empty).
        -- The statement ends with one row of NULLs if a key was passed over because its row was held.
        -- (The variables of this path are set here, not declared with values: the fast paths above
        -- would pay for that.)
        v_found := false;
        v_pause := 0.001;
        LOOP
            v_held := false;
            FOR v_job IN
            WITH RECURSIVE
            -- The queue's priorities with queued jobs, highest first, one index probe each (none if
            -- the queue is paused).
            priorities(priority) AS (
                (SELECT r.priority FROM pglockkit.jobs r
                  WHERE r.queue = claim_job.queue AND r.status = 'queued'
                    AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
                  ORDER BY r.priority DESC LIMIT 1)
                UNION ALL
                SELECT (SELECT r.priority FROM pglockkit.jobs r
                         WHERE r.queue = claim_job.queue AND r.status = 'queued'
                           AND r.priority < p.priority
                         ORDER BY r.priority DESC LIMIT 1)
                  FROM priorities p WHERE p.priority IS NOT NULL
            ), expired AS (
                SELECT j.id, j.attempt >= j.max_attempts AS exhausted, j.concurrency_key, j.rate_key, j.priority, j.run_at
                  FROM pglockkit.jobs j
                 WHERE j.queue = claim_job.queue AND j.status = 'running'
                   AND j.lease_expires_at <= v_now
                   AND NOT EXISTS (SELECT FROM pglockkit.paused_queues pq WHERE pq.queue = claim_job.queue)
                 ORDER BY j.lease_expires_at
                 LIMIT claim_job.batch
                   FOR UPDATE SKIP LOCKED
            ), ready AS (
                SELECT x.id, x.priority, x.run_at, x.concurrency_key, x.concurrency_limit, x.rate_key
                  FROM priorities p CROSS JOIN LATERAL (
                       SELECT r.id, r.priority, r.run_at, r.concurrency_key, r.concurrency_limit, r.rate_key
                         FROM pglockkit.jobs r
                        WHERE r.queue = claim_job.queue AND r.status = 'queued'
                          AND r.priority = p.priority AND r.run_at <= v_now
                          AND (r.concurrency_key IS NULL OR NOT EXISTS (
                          SELECT FROM pglockkit.job_keys k
                           WHERE k.queue = claim_job.queue AND k.key = r.concurrency_key
                             AND (k.running >= r.concurrency_limit
                                  OR (k.running > 0 AND k.running >= (
                                      SELECT pg_catalog.min(m.concurrency_limit) FROM pglockkit.jobs m
                                       WHERE m.queue = claim_job.queue
                                         AND m.concurrency_key = r.concurrency_key
                                         AND m.status IN ('queued', 'running'))))))
                          -- A rate key without a token now (by this snapshot) is passed over.
                          AND (r.rate_key IS NULL OR NOT EXISTS (
                          SELECT FROM pglockkit.job_rates q
                           WHERE q.queue = claim_job.queue AND q.key = r.rate_key
                             AND q.tat > v_now + q.step * (q.burst - 1)))
                        ORDER BY r.run_at, r.id
                        LIMIT claim_job.batch
                          FOR UPDATE SKIP LOCKED) x
                 LIMIT claim_job.batch
            ), keyed AS (
                -- The keys whose rows this claim may change.
                SELECT r.concurrency_key AS key FROM ready r WHERE r.concurrency_key IS NOT NULL
                UNION
                SELECT e.concurrency_key FROM expired e WHERE e.exhausted AND e.concurrency_key IS NOT NULL
            ), locked AS (
                -- Their rows, in key order, but none that another transaction holds: never waits.
                -- running is read from the newest row version (the one locked). (Keys as an array,
                -- here and below: one index probe each, whatever the generic plan's estimates.)
                SELECT k.key, k.running
                  FROM pglockkit.job_keys k
                 WHERE k.queue = claim_job.queue
                   AND k.key = ANY (ARRAY(SELECT y.key FROM keyed y))
                 ORDER BY k.key
                   FOR NO KEY UPDATE OF k SKIP LOCKED
            ), missing AS (
                -- Keys without a row in this statement's snapshot.
                SELECT y.key FROM keyed y
                 WHERE y.key <> ALL (ARRAY(
                       SELECT k.key FROM pglockkit.job_keys k
                        WHERE k.queue = claim_job.queue
                          AND k.key = ANY (ARRAY(SELECT y.key FROM keyed y))))
            ), limits AS (
                SELECT y.key, (SELECT pg_catalog.min(m.concurrency_limit) FROM pglockkit.jobs m
                                WHERE m.queue = claim_job.queue AND m.concurrency_key = y.key
                                  AND m.status IN ('queued', 'running')) AS lim
                  FROM keyed y
            ), candidates AS (
                -- What this claim may take: reclaims of expired leases (rank 0), then due jobs.
                SELECT e.id, 0 AS rank, e.priority, e.run_at, e.concurrency_key, NULL::integer AS concurrency_limit, e.rate_key
                  FROM expired e WHERE NOT e.exhausted
                UNION ALL
                SELECT r.id, 1, r.priority, r.run_at, r.concurrency_key, r.concurrency_limit, r.rate_key FROM ready r
            ), rated AS (
                SELECT DISTINCT c.rate_key AS key FROM candidates c WHERE c.rate_key IS NOT NULL
            ), rate_rows AS (
                -- The rate keys with a limit in this statement's snapshot (a key without one has no limit).
                SELECT q.key FROM pglockkit.job_rates q
                 WHERE q.queue = claim_job.queue AND q.key = ANY (ARRAY(SELECT y.key FROM rated y))
            ), rate_locked AS (
                -- Their rows, in key order, but none that another transaction holds (a claim of the
                -- key, until it commits): never waits. The jobs the key may start now, from the newest
                -- row version (the one locked): floor((t + burst * step - max(tat, t)) / step).
                SELECT q.key,
                       GREATEST(pg_catalog.floor(EXTRACT(epoch FROM v_now + q.step * q.burst - GREATEST(q.tat, v_now))
                                                 / EXTRACT(epoch FROM q.step)), 0)::integer AS tokens
                  FROM pglockkit.job_rates q
                 WHERE q.queue = claim_job.queue AND q.key = ANY (ARRAY(SELECT y.key FROM rated y))
                 ORDER BY q.key
                   FOR NO KEY UPDATE OF q SKIP LOCKED
            ), rate_ok AS (
                -- Candidates within their key's rate: the first tokens of each limited key, in claim
                -- order. A limited key whose row is held has no token for this claim.
                SELECT c.* FROM (
                    SELECT c.*, pg_catalog.row_number() OVER (PARTITION BY c.rate_key
                                                             ORDER BY c.rank, c.priority DESC, c.run_at, c.id) AS rate_nth,
                           rr.key IS NOT NULL AS rate_limited, coalesce(rl.tokens, 0) AS tokens
                      FROM candidates c
                      LEFT JOIN rate_rows rr ON rr.key = c.rate_key
                      LEFT JOIN rate_locked rl ON rl.key = c.rate_key) c
                 WHERE NOT c.rate_limited OR c.rate_nth <= c.tokens
            ), allowed AS (
                SELECT r.*, pg_catalog.row_number() OVER (ORDER BY r.priority DESC, r.run_at, r.id) AS pos
                  FROM (SELECT r.*, pg_catalog.row_number() OVER (PARTITION BY r.concurrency_key
                                                               ORDER BY r.priority DESC, r.run_at, r.id) AS nth,
                               coalesce(l.running, 0) AS running_now, l.key IS NOT NULL AS have_row,
                               m.key IS NOT NULL AS create_row, coalesce(lm.lim, r.concurrency_limit) AS key_limit
                          FROM rate_ok r
                          LEFT JOIN locked l ON l.key = r.concurrency_key
                          LEFT JOIN missing m ON m.key = r.concurrency_key
                          LEFT JOIN limits lm ON lm.key = r.concurrency_key
                         WHERE r.rank = 1) r
                 WHERE r.concurrency_key IS NULL
                    OR ((r.have_row OR r.create_row)
                        AND r.nth <= (r.key_limit - r.running_now)
                        AND r.concurrency_key NOT IN (SELECT e.concurrency_key FROM expired e
                                                       WHERE e.exhausted AND e.concurrency_key IS NOT NULL))
            ), kept AS (
                SELECT a.* FROM allowed a
                 WHERE a.pos <= (claim_job.batch - (SELECT pg_catalog.count(*) FROM rate_ok o WHERE o.rank = 0))
            ), buried AS (
                UPDATE pglockkit.jobs j
                   SET status = 'dead', last_error = 'lease expired', finished_at = v_now, lease_expires_at = NULL
                  FROM expired e
                 WHERE j.id = e.id AND e.exhausted
                   AND (e.concurrency_key IS NULL OR e.concurrency_key IN (SELECT l.key FROM locked l)
                        OR e.concurrency_key IN (SELECT m.key FROM missing m))
                RETURNING j.concurrency_key
            ), unbury AS (
                SELECT b.concurrency_key AS key, pg_catalog.count(*)::int AS n
                  FROM buried b WHERE b.concurrency_key IS NOT NULL GROUP BY b.concurrency_key
            ), unburied AS (
                -- Rows locked above (or missing): no wait.
                UPDATE pglockkit.job_keys k
                   SET running = k.running - b.n
                  FROM unbury b
                 WHERE k.queue = claim_job.queue
                   AND k.key = ANY (ARRAY(SELECT u.key FROM unbury u)) AND k.key = b.key
            ), reserve AS (
                SELECT kk.concurrency_key AS key, pg_catalog.count(*)::int AS n, pg_catalog.min(kk.key_limit) AS lim
                  FROM kept kk WHERE kk.have_row GROUP BY kk.concurrency_key
            ), reserved AS (
                -- Rows locked above: no wait. (The re-check of the limit cannot fail; it guards the count.)
                UPDATE pglockkit.job_keys k
                   SET running = k.running + g.n, lim = g.lim
                  FROM reserve g
                 WHERE k.queue = claim_job.queue
                   AND k.key = ANY (ARRAY(SELECT r.key FROM reserve r)) AND k.key = g.key
                   AND (k.running + g.n) <= g.lim
                RETURNING k.key
            ), created AS (
                INSERT INTO pglockkit.job_keys AS k (queue, key, running, lim)
                SELECT claim_job.queue, kk.concurrency_key, pg_catalog.count(*)::int, pg_catalog.min(kk.key_limit)
                  FROM kept kk WHERE kk.create_row GROUP BY kk.concurrency_key ORDER BY kk.concurrency_key
                ON CONFLICT DO NOTHING
                RETURNING k.key
            ), spend AS (
                -- The tokens the kept jobs take, per limited rate key.
                SELECT t.rate_key AS key, pg_catalog.count(*)::int AS n
                  FROM (SELECT o.rate_key FROM rate_ok o WHERE o.rank = 0 AND o.rate_limited
                        UNION ALL
                        SELECT kk.rate_key FROM kept kk WHERE kk.rate_limited) t
                 GROUP BY t.rate_key
            ), spent AS (
                -- Rows locked above: no wait. At most tokens jobs per key were kept, so tat stays
                -- within t + burst * step.
                UPDATE pglockkit.job_rates q
                   SET tat = GREATEST(q.tat, v_now) + q.step * g.n
                  FROM spend g
                 WHERE q.queue = claim_job.queue
                   AND q.key = ANY (ARRAY(SELECT s.key FROM spend s)) AND q.key = g.key
                RETURNING q.key
            ), picked AS (
                SELECT o.id, 0 AS rank, 0::int8 AS pos FROM rate_ok o
                 WHERE o.rank = 0 AND (NOT o.rate_limited OR o.rate_key IN (SELECT sp.key FROM spent sp))
                UNION ALL
                SELECT kk.id, 1, kk.pos FROM kept kk
                 WHERE (kk.concurrency_key IS NULL
                        OR kk.concurrency_key IN (SELECT rs.key FROM reserved rs UNION ALL SELECT c.key FROM created c))
                   AND (NOT kk.rate_limited OR kk.rate_key IN (SELECT sp.key FROM spent sp))
            ), claimed AS (
                UPDATE pglockkit.jobs j
                   SET status = 'running', attempt = j.attempt + 1, worker = claim_job.worker,
                       token = pglockkit._next_token('pglockkit.job_tokens', j.token), lease_expires_at = v_now + claim_job.lease,
                       started_at = v_now
                 -- = ANY(array), not a join: the row estimates of the CTEs above are rough in a generic
                 -- plan, and a join estimated at hundreds of rows turned into a hash join over the table.
                 WHERE j.id = ANY (ARRAY(SELECT p.id FROM picked p))
                RETURNING j.id, j.queue, j.payload, j.attempt, j.max_attempts, j.token, j.lease_expires_at, j.concurrency_key, j.priority, j.run_at
            )
            (SELECT c.id, c.queue, c.payload, c.attempt, c.max_attempts, c.token, c.lease_expires_at, c.concurrency_key
               FROM claimed c
              ORDER BY c.priority DESC, c.run_at, c.id)
            UNION ALL
            SELECT NULL::bigint, NULL::text, NULL::jsonb, NULL::integer, NULL::integer, NULL::bigint, NULL::timestamptz, NULL::text
             WHERE EXISTS (SELECT FROM ready r
                            WHERE r.concurrency_key IS NOT NULL
                              AND r.concurrency_key NOT IN (SELECT l.key FROM locked l)
                              AND r.concurrency_key NOT IN (SELECT m.key FROM missing m))
                OR EXISTS (SELECT FROM rate_rows rr WHERE rr.key NOT IN (SELECT rl.key FROM rate_locked rl))
            LOOP
                IF v_job.id IS NULL THEN
                    v_held := true;
                ELSE
                    v_found := true;
                    RETURN NEXT v_job;
                END IF;
            END LOOP;
            -- Nothing claimed only because key rows were held (for the moment of someone's commit, as
            -- a rule): try again after 1, 2, 4 and 8 ms rather than send the worker to sleep until its
            -- next poll. Meanwhile this transaction keeps the job rows it locked and did not claim:
            -- other claimers skip them, a completion or cancel of one of them waits (for 15 ms at
            -- most); this claim waits for no lock (but see the block).
            EXIT WHEN v_found OR NOT v_held OR v_pause > 0.008;
            PERFORM pg_catalog.pg_sleep(v_pause);
            v_pause := v_pause * 2;
            v_now := pg_catalog.clock_timestamp();
        END LOOP;
    EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
        RETURN;
    END;
END
$$;
COMMENT ON FUNCTION pglockkit.claim_job(text, text, interval, integer) IS
    'Claims up to batch (1..1000) jobs of queue for worker, with a lease; never waits for a lock (SKIP LOCKED; in the rare case where PostgreSQL waits anyway, following a row''s update chain, the claim gives up after 10 ms, undoes what it did and returns no rows). Jobs whose lease expired are reclaimed first (counting an attempt; on the last attempt they go dead with "lease expired"), then due jobs by priority (higher first), run_at, id. A job with a concurrency key starts only while the key''s running jobs are fewer than the smallest concurrency_limit among its queued and running jobs; a key whose counter row another transaction holds at that moment is passed over by this claim. A job with a rate key that has a rate limit (set_rate_limit) is claimed only within the key''s rate, in the same statement: jobs over it are passed over, not waited for, and other keys'' jobs are claimed instead. A paused queue (pause_queue) claims nothing. Each row carries a new fencing token for complete_job / fail_job / extend_job / release_job.';

SELECT pglockkit._grant_privileges();
