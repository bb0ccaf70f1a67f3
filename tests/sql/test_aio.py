"""pglockkit.aio on real AsyncConnections, on both servers: the sync contract, awaited.

Each test drives its coroutines with ``asyncio.run`` (no pytest plugin needed). That the async
layer cannot drift from the sync one (same names and signatures, every operation built from the
same call description in ``pglockkit._calls``) is checked without a server in
tests/unit/test_aio_calls.py; ``aio.sole_writer`` through PgBouncer in tests/system/test_pgbouncer.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime

import psycopg
import pytest

import pglockkit
import pglockkit.aio as aio
import pglockkit.locks_async
from pglockkit import lock_key, namespace_id

# --- helpers ---------------------------------------------------------------------------------


async def _aconnect(db, **kwargs) -> psycopg.AsyncConnection:
    kwargs.setdefault("autocommit", True)
    return await aio.connect(db.dsn, **kwargs)


# --- locks -----------------------------------------------------------------------------------


def test_register_namespace_and_namespaces(db):
    async def main():
        async with await _aconnect(db) as conn:
            ns_id = await aio.register_namespace(conn, "billing", description="invoices", lock_timeout=2)
            assert ns_id == namespace_id("billing")
            assert await aio.register_namespace(conn, "billing") == ns_id  # idempotent
            with pytest.raises(pglockkit.NamespaceConflict) as err:
                await aio.register_namespace(conn, "other", id=ns_id)
            assert err.value.sqlstate == "23505" and "billing" in str(err.value)
            return await aio.namespaces(conn)

    rows = asyncio.run(main())
    assert rows == pglockkit.namespaces(db.conn)
    billing = next(r for r in rows if r["name"] == "billing")
    assert billing["description"] == "invoices" and billing["lock_timeout"].total_seconds() == 2


def test_xact_lock_contention_times_out_with_lock_timeout(db, ns, caplog):
    caplog.set_level(logging.INFO, logger="pglockkit.locks")

    async def main():
        async with await _aconnect(db) as a, await _aconnect(db) as b:
            async with a.transaction():
                key = await aio.xact_lock(a, ns, "invoice:7", timeout=1)
                assert key == lock_key(namespace_id(ns), "invoice:7")
                started = time.monotonic()
                with pytest.raises(pglockkit.LockTimeout) as err:
                    async with b.transaction():
                        await aio.xact_lock(b, ns, "invoice:7", timeout=0.2)
                waited = time.monotonic() - started
                assert err.value.sqlstate == "55P03" and err.value.retry_after == 0.2
                assert 0.15 < waited < 2
                async with b.transaction():
                    assert await aio.try_xact_lock(b, ns, "invoice:7") is False
            async with b.transaction():  # a committed: free
                assert await aio.try_xact_lock(b, ns, "invoice:7") is True

    asyncio.run(main())
    events = [r.pglockkit for r in caplog.records if hasattr(r, "pglockkit")]
    assert [e["event"] for e in events] == ["acquired", "timeout", "skipped", "acquired"]
    assert events[1]["wait_ms"] >= 150 and events[1]["namespace"] == ns


def test_a_waiting_xact_lock_does_not_block_the_event_loop(db, ns):
    """The waiter and the holder share one event loop: the holder can only commit while the
    waiter waits if the wait is awaited, not blocking."""

    async def main():
        async with await _aconnect(db) as a, await _aconnect(db) as b:
            order = []

            async def holder():
                async with a.transaction():
                    await aio.xact_lock(a, ns, "r")
                    holding.set()
                    await asyncio.sleep(0.3)
                    order.append("holder commits")

            async def waiter():
                await holding.wait()
                async with b.transaction():
                    await aio.xact_lock(b, ns, "r", timeout=5)
                    order.append("waiter locked")

            holding = asyncio.Event()
            started = time.monotonic()
            await asyncio.gather(holder(), waiter())
            return order, time.monotonic() - started

    order, elapsed = asyncio.run(main())
    assert order == ["holder commits", "waiter locked"]
    assert 0.25 < elapsed < 3


def test_autocommit_bad_input_and_unknown_namespace_are_refused(db, ns, advisory_locks):
    async def main():
        async with await _aconnect(db) as conn:
            for call in (
                aio.xact_lock(conn, ns, "r"),
                aio.try_xact_lock(conn, ns, "r"),
                aio.xact_lock_all(conn, ns, ["r"]),
                aio.lock_rows(conn, "pglockkit.namespaces", [1]),
            ):
                with pytest.raises(ValueError, match="autocommit"):
                    await call
            async with conn.transaction():
                with pytest.raises(pglockkit.InvalidArgument) as err:
                    await aio.xact_lock(conn, ns, "r", timeout=0)
            assert err.value.sqlstate == "22023"
            async with conn.transaction():
                with pytest.raises(pglockkit.UnknownNamespace) as err:
                    await aio.xact_lock(conn, "nope", "r", timeout=1)
            assert err.value.sqlstate == "42704"

    asyncio.run(main())
    assert advisory_locks(db.conn) == 0


def test_xact_lock_all_orders_keys_and_lock_rows_times_out(db, ns):
    db.conn.execute("CREATE TABLE orders (id bigint PRIMARY KEY)")
    db.conn.execute("INSERT INTO orders SELECT generate_series(1, 5)")
    ns_id = namespace_id(ns)

    async def main():
        async with await _aconnect(db) as a, await _aconnect(db) as b:
            async with a.transaction():
                keys = await aio.xact_lock_all(a, ns, ["z", "a", "m", "a"], timeout=1)
                assert keys == sorted({lock_key(ns_id, r) for r in ("z", "a", "m")})
                assert await aio.xact_lock_all(a, ns, [3, 1], timeout=1) == [
                    lock_key(ns_id, 1),
                    lock_key(ns_id, 3),
                ]
                assert await aio.lock_rows(a, "orders", [5, 2, 99], timeout=1) == 2
                with pytest.raises(pglockkit.LockTimeout):
                    async with b.transaction():
                        await aio.lock_rows(b, "orders", [1, 2], timeout=0.1)
                with pytest.raises(pglockkit.LockTimeout):
                    async with b.transaction():
                        await aio.xact_lock_all(b, ns, ["q", "m"], timeout=0.1)
            async with b.transaction():
                assert await aio.lock_rows(b, "orders", [1, 2], timeout=0.1) == 2

    asyncio.run(main())


def test_sole_writer_one_task_wins_one_skips_and_a_failure_releases(
    db, ns, caplog, monkeypatch, advisory_locks
):
    caplog.set_level(logging.INFO, logger="pglockkit.locks")
    lock_conns: dict[asyncio.Task, psycopg.AsyncConnection] = {}
    real_keepalives = aio.set_server_keepalives

    async def spy(conn, window=None):  # sole_writer's own connection, per task
        lock_conns[asyncio.current_task()] = conn
        await real_keepalives(conn, window)

    # sole_writer is pglockkit.locks_async's (aio re-exports it): the name it calls is there.
    monkeypatch.setattr(pglockkit.locks_async, "aset_server_keepalives", spy)

    async def replica(name, gate, log):
        await gate.wait()
        async with aio.sole_writer(db.dsn, ns, "restock_plan", keepalives={"tcp_keepalives_idle": 2}) as mine:
            if not mine:
                log.append(f"{name}: skipped")
                return
            cur = await lock_conns[asyncio.current_task()].execute("SHOW tcp_user_timeout")
            log.append(f"{name}: ran, tcp_user_timeout {(await cur.fetchone())[0]}")
            await asyncio.sleep(0.3)  # both tasks are inside sole_writer at once

    async def failing():
        async with aio.sole_writer(db.dsn, ns, "restock_plan") as mine:
            assert mine
            raise RuntimeError("supplier feed down")

    async def main():
        gate, log = asyncio.Event(), []
        tasks = [asyncio.create_task(replica(n, gate, log)) for n in ("replica-a", "replica-b")]
        await asyncio.sleep(0.05)  # both waiting at the gate
        gate.set()
        await asyncio.gather(*tasks)
        with pytest.raises(RuntimeError, match="feed down"):
            await failing()
        async with aio.sole_writer(db.dsn, ns, "restock_plan") as mine:
            log.append(f"third: {'ran' if mine else 'skipped'}")
        return log

    log = asyncio.run(main())
    ran = [line for line in log[:2] if ": ran" in line]
    skipped = [line for line in log[:2] if line.endswith(": skipped")]
    assert len(ran) == 1 and len(skipped) == 1, log
    assert ran[0].endswith("tcp_user_timeout 17000")  # server keepalives: 2 + 5 * 3 s
    assert log[2] == "third: ran"  # the failure inside the block released the lock
    assert advisory_locks(db.conn) == 0
    events = [r.pglockkit["event"] for r in caplog.records if hasattr(r, "pglockkit")]
    assert sorted(events[:3]) == ["acquired", "released", "skipped"]
    assert events[3:] == ["acquired", "released", "acquired", "released"]


def test_bad_keepalives_are_refused_before_connecting_a_lock(db, ns, advisory_locks):
    async def main():
        with pytest.raises(ValueError, match="unknown keepalive"):
            async with aio.sole_writer(db.dsn, ns, "r", keepalives={"tcp_keepalives_nope": 1}):
                pytest.fail("ran with bad keepalives")

    asyncio.run(main())
    assert advisory_locks(db.conn) == 0


# --- leases ----------------------------------------------------------------------------------


def test_leases_tokens_stale_tokens_and_fence(db):
    async def main():
        async with await _aconnect(db) as conn, await _aconnect(db) as writer:
            token = await aio.acquire_lease(conn, "refresh", "a", 10)
            assert token == 1
            assert await aio.acquire_lease(conn, "refresh", "b", 10) is None
            assert await aio.renew_lease(conn, "refresh", "a", token, 10) is True
            assert await aio.renew_lease(conn, "refresh", "a", token + 5, 10) is False  # stale token
            async with writer.transaction():
                await aio.check_fence(writer, "refresh", token)
            assert await aio.release_lease(conn, "refresh", "a", token) is True
            assert await aio.release_lease(conn, "refresh", "a", token) is False
            assert await aio.acquire_lease(conn, "refresh", "b", 10) == 2
            with pytest.raises(pglockkit.StaleToken) as err:
                async with writer.transaction():
                    await aio.check_fence(writer, "refresh", token)
            assert err.value.sqlstate == "PK001"
            with pytest.raises(pglockkit.InvalidArgument):
                await aio.acquire_lease(conn, "", "a", 10)

    asyncio.run(main())


def test_async_lease_renews_in_a_task_and_releases_on_exit(db):
    async def main():
        async with aio.Lease(db.dsn, "renewed", ttl=0.6, holder="me") as lease:
            assert lease.acquired and lease.token == 1
            async with await _aconnect(db) as rival:
                for _ in range(3):
                    await asyncio.sleep(0.5)  # well past the ttl in total: only renewals keep it
                    assert await aio.acquire_lease(rival, "renewed", "rival", 10) is None
            assert not lease.lost.is_set()
            async with await _aconnect(db) as conn, conn.transaction():
                await lease.check_fence(conn)
        async with aio.Lease(db.dsn, "renewed", ttl=5, holder="next") as after:
            assert after.token == 2  # released on exit

    asyncio.run(main())


def test_async_lease_signals_loss_when_taken_over(db):
    lost = []

    async def main():
        async with aio.Lease(
            db.dsn, "stolen", ttl=5, holder="me", renew_every=0.2, on_lost=lost.append
        ) as lease:
            async with await _aconnect(db) as rival:  # freed behind the holder's back, and taken
                assert await aio.release_lease(rival, "stolen", "me", lease.token)
                assert await aio.acquire_lease(rival, "stolen", "rival", 10) == 2
            await asyncio.wait_for(lease.lost.wait(), 2)
            assert lost == [lease] and "changed hands" in lease.lost_reason
            with pytest.raises(pglockkit.StaleToken):
                async with await _aconnect(db) as conn, conn.transaction():
                    await lease.check_fence(conn)
        async with aio.Lease(db.dsn, "stolen", ttl=5, holder="third") as busy:
            assert not busy.acquired and busy.token is None
            with pytest.raises(RuntimeError, match="not acquired"):
                await busy.check_fence(None)

    asyncio.run(main())
    # The rival's lease was left alone by the loser's exit.
    assert db.conn.execute("SELECT holder FROM pglockkit.leases WHERE name = 'stolen'").fetchone() == (
        "rival",
    )


# --- queue -----------------------------------------------------------------------------------


def test_queue_round_trip_and_stale_claims(db):
    async def main():
        async with await _aconnect(db) as conn:
            first = await aio.enqueue(conn, "emails", {"to": "ana"}, dedup_key="ana", priority=5)
            assert await aio.enqueue(conn, "emails", {"to": "ana"}, dedup_key="ana") == first
            later = await aio.enqueue(conn, "emails", {"to": "later"}, delay=60)
            ids = await aio.enqueue_many(conn, "emails", [{"n": 1}, {"n": 2}, {"n": 3}])
            with pytest.raises(ValueError, match="run_at or delay"):
                await aio.enqueue(conn, "emails", {}, run_at=datetime.now(UTC), delay=1)

            jobs = await aio.claim(conn, "emails", "w1", lease=30, batch=10)
            assert [j.id for j in jobs] == [first, *ids]  # priority first; the delayed job waits
            assert isinstance(jobs[0], aio.Job) and jobs[0].payload == {"to": "ana"}
            ana, one, two, three = jobs
            assert await aio.extend(conn, ana, 60) is True
            assert await aio.complete(conn, ana) is True
            assert await aio.complete(conn, ana) is False  # already done
            assert await aio.fail(conn, one, "boom", retry_in=0) == "queued"
            assert await aio.release(conn, two) is True
            assert await aio.cancel(conn, three.id) is True
            assert await aio.complete(conn, three) is False  # cancelled: the claim is stale
            again = await aio.claim(conn, "emails", "w2", batch=10)
            assert sorted(j.id for j in again) == sorted([one.id, two.id])
            retried = next(j for j in again if j.id == one.id)
            assert retried.attempt == 2 and retried.token != one.token
            assert await aio.complete(conn, one) is False  # the old token is stale
            assert await aio.complete_many(conn, [*again, one]) == 2
            assert await aio.cancel(conn, later) is True
            assert await aio.cancel(conn, later) is False

    asyncio.run(main())
    rows = db.conn.execute("SELECT status, count(*) FROM pglockkit.jobs GROUP BY 1 ORDER BY 1").fetchall()
    assert rows == [("cancelled", 2), ("done", 3)]


def test_concurrent_async_claimers_never_share_a_job(db):
    pglockkit.queue.enqueue_many(db.conn, "q", [{"n": i} for i in range(60)])

    async def claimer(name):
        async with await _aconnect(db) as conn:
            got = []
            while jobs := await aio.claim(conn, "q", name, batch=3):
                got += jobs
                await aio.complete_many(conn, jobs)
            return got

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(claimer(f"w{i}") for i in range(4))), 30)

    results = asyncio.run(main())
    ids = [j.id for r in results for j in r]
    assert len(ids) == 60 and len(set(ids)) == 60
    assert db.conn.execute("SELECT count(*) FROM pglockkit.jobs WHERE status = 'done'").fetchone()[0] == 60


# --- runs ------------------------------------------------------------------------------------


def test_runs_start_finish_run_once_and_singleton(db):
    calls = []

    @aio.singleton(db.dsn, "nightly", slot="2026-01-01")
    async def nightly(x):
        calls.append(x)
        return x * 2

    async def main():
        async with await _aconnect(db) as conn, await _aconnect(db) as other:
            run_id = await aio.start_run(conn, "tick", "s1", "me")
            assert run_id is not None
            assert await aio.start_run(other, "tick", "s1", "other") is None  # running elsewhere
            assert await aio.finish_run(conn, run_id, True) is True
            assert await aio.finish_run(conn, run_id, True) is False
            with pytest.raises(pglockkit.UnknownRun):
                await aio.finish_run(conn, run_id + 1000, True)
        async with aio.run_once(db.dsn, "cron", "s1") as first:
            assert first is not None
            async with aio.run_once(db.dsn, "cron", "s1") as second:
                assert second is None  # running elsewhere
        with pytest.raises(RuntimeError):
            async with aio.run_once(db.dsn, "cron", "s2") as run:
                assert run is not None
                raise RuntimeError("disk full")
        assert await nightly(21) == 42
        assert await nightly(1) is None  # the slot already ran

    asyncio.run(main())
    assert calls == [21]
    rows = db.conn.execute(
        "SELECT job, slot, status, detail FROM pglockkit.runs ORDER BY job, slot"
    ).fetchall()
    statuses = {(job, slot): (status, detail) for job, slot, status, detail in rows}
    assert statuses[("cron", "s1")][0] == "succeeded"
    assert statuses[("cron", "s2")] == ("failed", "RuntimeError: disk full")
    assert statuses[("nightly", "2026-01-01")][0] == "succeeded"
    with pytest.raises(TypeError, match="coroutine function"):
        aio.singleton(db.dsn, "x")(lambda: None)


# --- retry -----------------------------------------------------------------------------------


def test_async_retry_waits_out_a_held_lock_with_jittered_backoff(db, ns):
    pauses = []

    async def recording_sleep(pause):
        pauses.append(pause)
        await asyncio.sleep(pause)

    async def main():
        async with await _aconnect(db) as holder, await _aconnect(db) as conn:
            tries = 0

            async def transaction():
                nonlocal tries
                tries += 1
                async with conn.transaction():
                    return await aio.xact_lock(conn, ns, "shared", timeout=0.1)

            async def hold_then_release():
                async with holder.transaction():
                    await aio.xact_lock(holder, ns, "shared")
                    held.set()
                    await asyncio.sleep(0.4)

            held = asyncio.Event()
            hold = asyncio.create_task(hold_then_release())
            await held.wait()
            key = await aio.retry(transaction, attempts=20, base=0.05, cap=0.2, sleep=recording_sleep)
            await hold
            return key, tries

    key, tries = asyncio.run(main())
    assert key == lock_key(namespace_id(ns), "shared")
    assert tries >= 2 and len(pauses) == tries - 1
    assert all(0 <= p <= min(0.2, 0.05 * 2**i) for i, p in enumerate(pauses))


def test_async_retry_gives_up_and_does_not_retry_other_errors(db, ns):
    async def main():
        async with await _aconnect(db) as holder, await _aconnect(db) as conn:
            async with holder.transaction():
                await aio.xact_lock(holder, ns, "shared")
                tries = []

                async def locked():
                    tries.append(1)
                    async with conn.transaction():
                        await aio.xact_lock(conn, ns, "shared", timeout=0.05)

                with pytest.raises(pglockkit.LockTimeout):
                    await aio.retry(locked, attempts=3, base=0.01)
                assert len(tries) == 3

                async def unknown():
                    tries.append(1)
                    async with conn.transaction():
                        await aio.xact_lock(conn, "nope", "r")

                tries.clear()
                with pytest.raises(pglockkit.UnknownNamespace):
                    await aio.retry(unknown, attempts=3)
                assert len(tries) == 1
        with pytest.raises(ValueError, match="attempts"):
            await aio.retry(unknown, attempts=0)

    asyncio.run(main())


# --- logging: one record format ----------------------------------------------------------------


def test_sync_and_async_log_the_same_records(db, ns, caplog):
    caplog.set_level(logging.INFO, logger="pglockkit.locks")
    with db.connect() as conn, conn.transaction():
        pglockkit.xact_lock(conn, ns, "same", timeout=1)
        pglockkit.try_xact_lock(conn, ns, "other")

    async def main():
        async with await _aconnect(db) as conn, conn.transaction():
            await aio.xact_lock(conn, ns, "same", timeout=1)
            await aio.try_xact_lock(conn, ns, "other")

    asyncio.run(main())
    records = [r.pglockkit for r in caplog.records if hasattr(r, "pglockkit")]
    assert len(records) == 4
    strip = [{k: v for k, v in r.items() if k != "wait_ms"} for r in records]
    assert strip[:2] == strip[2:]
    assert strip[0]["key"] == lock_key(namespace_id(ns), "same") and "wait_ms" in records[2]


def test_aio_connect_has_keepalives_and_no_prepared_statements(db):
    async def main():
        async with await aio.connect(db.dsn, application_name="aio-test") as conn:
            assert conn.prepare_threshold is None
            params = conn.info.get_parameters()
            assert params["keepalives_idle"] == "10" and params["application_name"] == "aio-test"
            await aio.set_server_keepalives(conn, {"tcp_keepalives_count": 1})
            cur = await conn.execute("SHOW tcp_user_timeout")
            return (await cur.fetchone())[0]

    assert asyncio.run(main()) == "15000"  # 10 + 5 * 1


def test_the_listings_read_what_their_sync_twins_read(db):
    """aio.resource_key, leases, jobs and runs: the same calls as the sync functions the CLI uses."""
    from pglockkit import leases as sync_leases
    from pglockkit import locks as sync_locks
    from pglockkit import queue as sync_queue
    from pglockkit import runs as sync_runs

    db.conn.execute("SELECT pglockkit.register_namespace('listing')")
    db.conn.execute("SELECT pglockkit.acquire_lease('l', 'h', '1 minute')")
    db.conn.execute("SELECT pglockkit.enqueue_job('q', '{\"a\": 1}')")
    db.conn.execute("SELECT pglockkit.start_run('nightly', 's1', 'pod')")

    async def read():
        async with await aio.connect(db.dsn, autocommit=True) as conn:
            return (
                await aio.resource_key(conn, "listing", "r"),
                await aio.leases(conn),
                await aio.jobs(conn, "q"),
                await aio.runs(conn, "nightly"),
            )

    key, leases, jobs, runs = asyncio.run(read())
    assert key == sync_locks.resource_key(db.conn, "listing", "r") == lock_key(namespace_id("listing"), "r")
    assert [row["name"] for row in leases] == [row["name"] for row in sync_leases.leases(db.conn)] == ["l"]
    assert jobs == sync_queue.jobs(db.conn, "q") and len(jobs) == 1
    assert [r["slot"] for r in runs] == [r["slot"] for r in sync_runs.runs(db.conn, "nightly")] == ["s1"]


# --- the sync twins given a coroutine function -------------------------------------------------


def test_sync_singleton_refuses_a_coroutine_function_instead_of_recording_it_succeeded(db):
    """``aio.singleton`` refuses a plain function; ``pglockkit.singleton`` took an ``async def``,
    called it inside run_once (which only made the coroutine), recorded the slot as succeeded and
    released it, and returned the coroutine, which then ran outside the slot: its failure was
    never recorded and the slot never runs again."""

    async def nightly():
        raise RuntimeError("supplier feed down")

    try:
        wrapped = pglockkit.singleton(db.dsn, "nightly", slot="2026-01-01")(nightly)
    except TypeError as exc:
        assert "aio.singleton" in str(exc)
    else:
        with pytest.raises(RuntimeError, match="feed down"):
            asyncio.run(wrapped())
    statuses = db.conn.execute("SELECT status FROM pglockkit.runs WHERE job = 'nightly'").fetchall()
    assert ("succeeded",) not in statuses, "a run that raised is recorded as succeeded"


def test_sync_retry_refuses_a_coroutine_function_instead_of_not_retrying_it(db, ns):
    """``pglockkit.retry(async_fn)`` returned the first coroutine unawaited: awaited by the
    caller, its LockTimeout was never retried."""
    tries = []

    async def main():
        async with await _aconnect(db) as holder, await _aconnect(db) as conn:

            async def transfer():
                tries.append(1)
                async with conn.transaction():
                    await aio.xact_lock(conn, ns, "acct:1", timeout=0.05)

            async with holder.transaction():
                await aio.xact_lock(holder, ns, "acct:1")
                try:
                    pending = pglockkit.retry(transfer, attempts=3, sleep=lambda s: None)
                except TypeError as exc:
                    assert "aio.retry" in str(exc)
                    return
                with pytest.raises(pglockkit.LockTimeout):
                    await pending
            pytest.fail(f"retry gave the coroutine back after {len(tries)} try; nothing was retried")

    asyncio.run(main())


def test_sync_lease_refuses_an_async_on_lost(db):
    """``aio.Lease`` awaits an ``async def`` on_lost; ``pglockkit.Lease`` called it from its
    renewal thread, got a coroutine, dropped it (RuntimeWarning: never awaited) and set ``lost``:
    the callback never ran. It is refused when the lease is made, naming ``aio.Lease``."""
    ran = []

    async def alert(lease):
        ran.append(lease.name)

    with pytest.raises(TypeError, match=r"pglockkit\.aio\.Lease"):
        pglockkit.Lease(db.dsn, "stolen", ttl=0.3, renew_every=0.5, on_lost=alert)
    assert pglockkit.acquire_lease(db.conn, "stolen", "rival", 10) == 1  # nothing was acquired
    assert ran == []


def test_aio_retry_refuses_a_plain_function_instead_of_running_it_and_failing(db):
    """``aio.retry`` given a plain function called it (a whole sync transaction, committed) and
    then raised "object NoneType can't be used in 'await' expression". It is refused before it
    runs, naming ``pglockkit.retry``; a partial of an ``async def`` is a coroutine function."""
    import functools

    ran = []

    def transfer():
        ran.append(1)

    async def atransfer(amount):
        ran.append(amount)
        return amount

    async def main():
        with pytest.raises(TypeError, match=r"use pglockkit\.retry"):
            await aio.retry(transfer)
        assert ran == []
        assert await aio.retry(functools.partial(atransfer, 7)) == 7

    asyncio.run(main())
    with pytest.raises(TypeError, match=r"pglockkit\.aio\.retry"):  # and a lambda returning a coroutine
        pglockkit.retry(lambda: atransfer(8))
    assert ran == [7]
