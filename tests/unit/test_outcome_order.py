"""The order in which a worker's group records its outcomes: the order in which the queue
functions lock key rows (queue, then key, bytewise), so that two groups never wait for each other
in a cycle (tests/sql/test_worker.py has the deadlock this prevents, on a real server)."""

from __future__ import annotations

from datetime import UTC, datetime

from pglockkit import _calls
from pglockkit._calls import Job
from pglockkit.worker.lane import give_back_calls, key_order, outcome_calls


def _job(id_: int, key: str | None, queue: str = "q") -> Job:
    return Job(id_, queue, {}, 1, 5, 100 + id_, datetime.now(UTC), key)


def _described(calls):
    out = []
    for call in calls:
        if "_lock_jobs" in call.query:
            out.append(("lock", tuple(call.params[0])))
        elif "complete_jobs" in call.query:
            out.append(("complete", tuple(call.params[0])))
        else:
            assert "fail_job" in call.query
            out.append(("fail", call.params[0]))
    return out


def test_outcomes_go_in_key_order_with_completions_run_together():
    done = [_job(1, "c"), _job(2, None), _job(3, "a"), _job(4, "c")]
    failed = [(_job(5, "b"), "boom"), (_job(6, None), "boom"), (_job(7, "a"), "boom")]
    calls, completions = outcome_calls(done, failed)
    assert _described(calls) == [
        ("lock", (1, 2, 3, 4, 5, 6, 7)),  # every job row first (the server locks them in id order)
        ("complete", (2, 3)),  # the keyless completion rides with the first run
        ("fail", 7),  # key a, after its completion
        ("fail", 5),  # key b
        ("complete", (1, 4)),  # key c
        ("fail", 6),  # keyless: locks no key row
    ]
    assert completions == [1, 4]


def test_keys_order_bytewise_as_the_server_locks_them():
    # Code points, as COLLATE "C" orders UTF-8: upper case before lower, 'é' after 'z'.
    jobs = [_job(1, "é"), _job(2, "a"), _job(3, "Z"), _job(4, "b", queue="p"), _job(5, None, queue="z")]
    assert [j.id for j in sorted(jobs, key=key_order)] == [5, 4, 3, 2, 1]
    calls, _ = outcome_calls([], [(j, "x") for j in jobs])
    assert _described(calls[:1]) == [("lock", (1, 2, 3, 4, 5))]
    assert [c.params[0] for c in calls[1:]] == [4, 3, 2, 1, 5]


def test_a_group_without_failures_is_one_statement():
    done = [_job(1, "b"), _job(2, None), _job(3, "a")]
    calls, completions = outcome_calls(done, [])
    assert _described(calls) == [("complete", (2, 3, 1))] and completions == [0]  # it locks its rows
    assert outcome_calls([], []) == ([], [])
    calls, completions = outcome_calls([], [(_job(4, "a"), "boom")])
    assert _described(calls) == [("fail", 4)] and completions == []  # one row: nothing to order


def test_unstarted_jobs_go_back_in_key_order():
    # release_job locks the job's key row until the give-back's one transaction ends, like an
    # outcome: the same order keeps a stopping worker from deadlocking with a recording group.
    jobs = [_job(1, "c"), _job(2, "a"), _job(3, None), _job(4, "b"), _job(5, "a", queue="p")]
    calls = give_back_calls(jobs)
    assert _described(calls[:1]) == [("lock", (1, 2, 3, 4, 5))]  # the job rows first, as outcomes
    assert all("release_job" in c.query for c in calls[1:])
    assert [(c.params[0], c.params[1]) for c in calls[1:]] == [
        (3, 103),
        (5, 105),
        (2, 102),
        (4, 104),
        (1, 101),
    ]
    assert give_back_calls([]) == []
    assert [c.query for c in give_back_calls(jobs[:1])] == [_calls.release(jobs[0]).query]
