"""Failover to a real streaming standby (``pg_basebackup -R``), started by the test, on PostgreSQL 15
and 18: what the kit's fencing tokens promise when the standby is promoted.

A promotion carries the sequences on from the last value that was WAL-logged (about 32 ahead of the
last one handed out) and reached the standby. With asynchronous replication, whatever the old
primary handed out past that, and never replicated, is handed out again. Tokens carry the
server's timeline, which grows at every promotion, so they cannot repeat."""

from __future__ import annotations

import psycopg
import pytest
from replication import Node
from scenarios import PROMOTED_EPOCH

import pglockkit

HANDED_OUT = 120  # well past a sequence's logged block (32 values), as in the report (222)


def _acquired(conn: psycopg.Connection, name: str, holder: str, ttl: str = "1 hour") -> int:
    token = conn.execute(
        "SELECT pglockkit.acquire_lease(%s, %s, %s::interval)", (name, holder, ttl)
    ).fetchone()[0]
    assert token is not None
    return token


def _churn(conn: psycopg.Connection, name: str, times: int) -> list[int]:
    """``times`` acquisitions of lease ``name``, each released but the last; their tokens."""
    tokens = []
    for i in range(times):
        tokens.append(_acquired(conn, name, f"holder-{i}"))
        if i < times - 1:
            assert conn.execute(
                "SELECT pglockkit.release_lease(%s, %s, %s)", (name, f"holder-{i}", tokens[-1])
            ).fetchone()[0]
    return tokens


def _claims(conn: psycopg.Connection, queue: str, n: int) -> list[tuple[int, int]]:
    """``n`` claims of one job each; (id, token) of each."""
    return [
        conn.execute(
            "SELECT id, token FROM pglockkit.claim_job(%s, 'w', interval '1 hour', 1)", (queue,)
        ).fetchone()
        for _ in range(n)
    ]


def test_tokens_handed_out_before_an_async_failover_are_never_handed_out_again(server, tmp_path):
    """The report's run, on a real standby: the standby stops; the primary hands out lease and
    claim tokens past a sequence's logged block; the primary is SIGKILLed and the standby
    promoted. Before the fix the promoted server handed the same tokens out again: an old holder
    passed ``check_fence`` with the new holder's token, and a stale ``complete_job`` completed a
    job that a new worker had reclaimed with the same token. Now every token after the promotion
    is above every token before it; the old holders' fence, renewal and completion are refused;
    the new holders' are accepted."""
    primary = Node.primary(server.bindir, tmp_path)
    standby = None
    try:
        pglockkit.install(primary.dsn())
        with primary.connect() as conn:
            conn.execute(
                "SELECT pglockkit.enqueue_jobs('q', array_fill('{}'::jsonb, ARRAY[%s]))", (2 * HANDED_OUT,)
            )
            conn.execute("CREATE TABLE fenced (token bigint)")
        standby = primary.standby(tmp_path)
        primary.wait_caught_up(standby)
        standby.stop()  # asynchronous replication that falls behind: nothing below reaches it

        with primary.connect() as conn:
            before_leases = _churn(conn, "fence", HANDED_OUT)  # the last one stays held: the old holder
            before_claims = _claims(conn, "q", HANDED_OUT)
        old_holder, old_token = f"holder-{HANDED_OUT - 1}", before_leases[-1]
        old_job, old_claim = before_claims[-1]
        primary.kill()
        standby.start()
        standby.promote()

        with standby.connect() as conn:
            # Enough acquisitions and claims to pass every token the old primary handed out.
            after_leases = _churn(conn, "fence", HANDED_OUT + 40)
            after_claims = _claims(conn, "q", HANDED_OUT + 40)
            new_token = after_leases[-1]
            assert min(after_leases) > max(before_leases), (before_leases[-3:], after_leases[:3])
            # Timeline 1's tokens are the sequence's values; timeline 2's carry epoch 1 above them.
            assert max(before_leases) < PROMOTED_EPOCH <= min(after_leases)
            assert {t >> 47 for _, t in after_claims} == {PROMOTED_EPOCH >> 47}
            assert not set(after_leases) & set(before_leases)
            assert not {t for _, t in after_claims} & {t for _, t in before_claims}
            assert min(t for _, t in after_claims) > max(t for _, t in before_claims)

            # The old holder's fence and renewal: refused. The new holder's: accepted.
            with pytest.raises(psycopg.Error) as stale, conn.transaction():
                conn.execute("SELECT pglockkit.check_fence('fence', %s)", (old_token,))
                conn.execute("INSERT INTO fenced VALUES (%s)", (old_token,))
            assert stale.value.sqlstate == "PK001", stale.value
            renewed = conn.execute(
                "SELECT pglockkit.renew_lease('fence', %s, %s, '1 hour')", (old_holder, old_token)
            ).fetchone()[0]
            assert renewed is False
            with conn.transaction():
                conn.execute("SELECT pglockkit.check_fence('fence', %s)", (new_token,))
                conn.execute("INSERT INTO fenced VALUES (%s)", (new_token,))
            assert conn.execute("SELECT array_agg(token) FROM fenced").fetchone()[0] == [new_token]

            # The stale worker's completion of a job a new worker reclaimed: refused.
            new_claim = dict(after_claims)[old_job]
            assert (
                conn.execute("SELECT pglockkit.complete_job(%s, %s)", (old_job, old_claim)).fetchone()[0]
                is False
            )
            assert (
                conn.execute("SELECT pglockkit.complete_job(%s, %s)", (old_job, new_claim)).fetchone()[0]
                is True
            )
    finally:
        for node in (primary, standby):
            if node is not None:
                node.stop("immediate")
