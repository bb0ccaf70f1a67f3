"""The gate a worker process's pool connects through once the server refuses connections (for want
of slots, or down), ``pglockkit.worker.lane.ConnectGate``, on a clock of the test's (no server)."""

from __future__ import annotations

import logging

import psycopg

from pglockkit.worker.lane import GATE_POLL, GATE_REPORT_EVERY, ConnectGate, refused_for_slots

FULL = psycopg.OperationalError(
    'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  sorry, too many '
    "clients already"
)
RESERVED = psycopg.OperationalError(
    "connection failed: FATAL:  remaining connection slots are reserved for roles with the SUPERUSER"
    " attribute"
)

DOWN = psycopg.OperationalError(
    'connection failed: connection to server at "127.0.0.1", port 5432 failed: Connection refused'
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_refusal_for_want_of_slots_is_told_from_other_connect_failures():
    assert refused_for_slots(FULL) and refused_for_slots(RESERVED)
    assert not refused_for_slots(psycopg.OperationalError("connection refused"))
    assert not refused_for_slots(psycopg.OperationalError('FATAL:  database "x" does not exist'))


def test_every_lane_connects_at_once_until_the_server_refuses(caplog):
    gate = ConnectGate(cap=10, clock=Clock())
    assert [gate.turn() for _ in range(50)] == [0.0] * 50  # no refusal: nobody waits
    for _ in range(50):
        gate.connected()
    assert gate.turn() == 0.0 and not gate.refusing
    with caplog.at_level(logging.WARNING, logger="pglockkit.queue"):
        gate.connect_failed(DOWN)  # a server that is down is paced like a full one...
        gate.connect_failed(DOWN)
    assert gate.refusing and gate.closed and gate.turn() > 0
    [line] = [r.getMessage() for r in caplog.records]  # ...in one line, without the full one's hint
    assert "Connection refused" in line and "--connections" not in line


def test_a_full_server_s_line_says_what_to_lower(caplog):
    gate = ConnectGate(cap=10, clock=Clock())
    with caplog.at_level(logging.WARNING, logger="pglockkit.queue"):
        gate.connect_failed(FULL)
    [line] = [r.getMessage() for r in caplog.records]
    assert "too many clients already" in line and "lower --connections" in line


def test_after_a_refusal_one_lane_tries_at_a_time_and_each_refusal_closes_the_gate(caplog):
    clock = Clock()
    gate = ConnectGate(cap=10, clock=clock)
    with caplog.at_level(logging.WARNING, logger="pglockkit.queue"):
        for _ in range(30):  # 30 lanes were trying at once when the server filled up
            gate.connect_failed(FULL)
    assert len(caplog.records) == 1  # one line, not one a lane
    assert "too many clients already" in caplog.records[0].getMessage()
    assert gate.refusing
    wait = gate.turn()
    assert 0 < wait <= 10  # closed: every lane waits
    clock.now += wait
    assert gate.turn() == 0.0  # the gate opens for one lane...
    assert [gate.turn() for _ in range(20)] == [GATE_POLL] * 20  # ...the others wait for it
    gate.connect_failed(FULL)  # refused again: closed again, no new line
    assert gate.turn() > 0 and len(caplog.records) == 1
    clock.now += 10
    assert gate.turn() == 0.0
    gate.connected()  # accepted: the next lane tries at once, one at a time still
    assert gate.turn() == 0.0 and gate.turn() == GATE_POLL
    gate.connected()


def test_the_pause_after_refusals_grows_to_the_cap_and_no_further():
    clock = Clock()
    gate = ConnectGate(cap=2, clock=clock)
    for _ in range(40):
        assert gate.turn() == 0.0
        gate.connect_failed(FULL)
        wait = gate.turn()
        assert 0 < wait <= 2
        clock.now += wait


def test_the_gate_reports_once_a_minute_while_refused_and_opens_after_a_quiet_minute(caplog):
    clock = Clock()
    gate = ConnectGate(cap=10, clock=clock)
    with caplog.at_level(logging.INFO, logger="pglockkit.queue"):
        gate.connect_failed(FULL)
        for _ in range(12):  # a refusal every 10 s for two minutes
            clock.now += 10
            assert gate.turn() == 0.0
            gate.connect_failed(FULL)
        still = [r.getMessage() for r in caplog.records if "still refuses" in r.getMessage()]
        assert len(still) == 2, still  # at 60 s and 120 s
        clock.now += 10
        assert gate.turn() == 0.0
        gate.connected()
        clock.now += GATE_REPORT_EVERY + 1
        assert gate.turn() == 0.0 and gate.turn() == 0.0  # every lane on its own again
    assert not gate.refusing
    assert "accepts connections again" in caplog.records[-1].getMessage()
    assert gate.refused_total == 13
