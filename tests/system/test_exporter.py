"""sql/postgres_exporter.yaml with the real Prometheus postgres_exporter (Debian's
``prometheus-postgres-exporter``): start it against a test database as a pg_monitor-only role,
plant holders, waiters, a leak and a queue, scrape ``/metrics`` and check the series."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

ROOT = Path(__file__).resolve().parents[2]
QUERIES = ROOT / "sql" / "postgres_exporter.yaml"
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _exporter_binary() -> str:
    found = shutil.which("prometheus-postgres-exporter") or shutil.which("postgres_exporter")
    assert found, "not installed: apt-get install prometheus-postgres-exporter (scripts/test does)"
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """The Prometheus text format as {(name, labels): value}."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"unparsable metrics line: {line!r}"
        labels = frozenset((k, _unescape(v)) for k, v in LABEL.findall(m["labels"] or ""))
        samples[(m["name"], labels)] = float(m["value"])
    return samples


def _unescape(value: str) -> str:
    """A label value as the text format escapes it (backslash, double quote, newline)."""
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m[1], m[1]), value)


class Exporter:
    def __init__(self, dsn: str, workdir: Path):
        self.port = _free_port()
        self.log = workdir / "exporter.log"
        params = conninfo_to_dict(dsn)
        url = "postgresql://{user}@{host}:{port}/{dbname}?sslmode=disable".format(**params)
        env = {**os.environ, "DATA_SOURCE_NAME": url}
        self.proc = subprocess.Popen(
            [
                _exporter_binary(),
                f"--extend.query-path={QUERIES}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--disable-default-metrics",
                "--disable-settings-metrics",
                "--no-collector.database",
                "--no-collector.bgwriter",
                "--log.level=warn",
            ],
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )

    def scrape(self) -> dict[tuple[str, frozenset], float]:
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as resp:
                    return parse_metrics(resp.read().decode())
            except OSError:
                assert self.proc.poll() is None, f"exporter exited:\n{self.log.read_text()}"
                assert time.monotonic() < deadline, f"exporter did not answer:\n{self.log.read_text()}"
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def exporter(server, db, tmp_path) -> Iterator[Exporter]:
    """The exporter, connected as a role that has pg_monitor and nothing else."""
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute("DROP ROLE IF EXISTS metrics_reader")
        admin.execute("CREATE ROLE metrics_reader LOGIN IN ROLE pg_monitor")
    params = conninfo_to_dict(db.dsn)
    params["user"] = "metrics_reader"
    exp = Exporter(" ".join(f"{k}={v}" for k, v in params.items()), tmp_path)
    yield exp
    exp.stop()


def value(samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    # The exporter may add labels of its own (server=...); match on ours.
    matches = [v for (n, ls), v in samples.items() if n == name and key[1] <= ls]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} series in {sorted(n for n, _ in samples)}"
    return matches[0]


def test_exporter_loads_every_query_and_scrapes_without_error(exporter):
    samples = exporter.scrape()
    names = {n for n, _ in samples}
    assert value(samples, "pg_up") == 1
    loaded = [v for (n, _), v in samples.items() if n == "pg_exporter_user_queries_load_error"]
    assert loaded == [0.0], exporter.log.read_text()
    assert value(samples, "pg_exporter_last_scrape_error") == 0, exporter.log.read_text()
    for query in (
        "namespace",
        "lock_waits",
        "idle_lock_holders",
        "lock_holds",
        "leases",
        "table",
        "xmin_horizon",
    ):
        assert any(n.startswith(f"pglockkit_{query}_") for n in names), query
    # Registered namespaces have series even when nothing is held: alerts need no absent().
    assert value(samples, "pglockkit_namespace_locks_held", namespace="pglockkit") == 0
    assert value(samples, "pglockkit_table_total_bytes", table_name="jobs") > 0


def test_exporter_shows_holders_waiters_leaks_and_queues(db, exporter):
    db.conn.execute("SELECT pglockkit.register_namespace('billing')")
    db.conn.execute("SELECT pglockkit.enqueue_job('mail', '{}'::jsonb) FROM generate_series(1, 3)")
    db.conn.execute("SELECT pglockkit.enqueue_job('mail', '{}'::jsonb, run_at => now() + interval '1 hour')")
    db.conn.execute("SELECT pglockkit.claim_job('mail', 'w1', interval '5 minutes', 1)")
    db.conn.execute("SELECT pglockkit.acquire_lease('refresh', 'me', interval '1 minute')")
    db.conn.execute("SELECT pglockkit.enqueue_job('held', '{}'::jsonb)")
    db.conn.execute("SELECT pglockkit.pause_queue('held')")
    with db.connect() as holder, db.connect() as waiter:
        holder.execute("SELECT pglockkit.try_lock('billing', 'invoice:1')")  # held, then idle: a leak
        db.conn.execute("SELECT pglockkit.sample()")  # its hold time starts here
        thread = threading.Thread(
            target=lambda: waiter.execute("SELECT pglockkit.xact_lock('billing', 'invoice:1', '30 s')"),
            daemon=True,
        )
        thread.start()
        deadline = time.monotonic() + 5
        while not db.conn.execute("SELECT count(*) FROM pglockkit.lock_waits").fetchone()[0]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(1.1)
        db.conn.execute("SELECT pglockkit.sample()")
        samples = exporter.scrape()
        assert value(samples, "pglockkit_namespace_locks_held", namespace="billing") == 1
        assert value(samples, "pglockkit_namespace_waiters", namespace="billing") == 1
        assert value(samples, "pglockkit_namespace_sessions", namespace="billing") == 2
        assert value(samples, "pglockkit_namespace_longest_wait_seconds", namespace="billing") >= 1
        assert value(samples, "pglockkit_lock_waits_waiting") == 1
        assert value(samples, "pglockkit_lock_waits_root_blockers") == 1
        assert value(samples, "pglockkit_lock_waits_max_sessions_behind_root") == 1
        assert value(samples, "pglockkit_idle_lock_holders_locks", namespace="billing") == 1
        assert value(samples, "pglockkit_idle_lock_holders_longest_idle_seconds", namespace="billing") >= 1
        assert value(samples, "pglockkit_lock_holds_locks", namespace="billing") == 1
        assert value(samples, "pglockkit_lock_holds_longest_held_seconds", namespace="billing") >= 1
        assert 0 <= value(samples, "pglockkit_sampling_seconds_since_last") < 60
        assert value(samples, "pglockkit_queue_ready", queue="mail") == 2
        assert value(samples, "pglockkit_queue_scheduled", queue="mail") == 1
        assert value(samples, "pglockkit_queue_running", queue="mail") == 1
        assert value(samples, "pglockkit_queue_lag_seconds", queue="mail") >= 1
        assert value(samples, "pglockkit_queue_paused", queue="mail") == 0
        assert value(samples, "pglockkit_queue_paused", queue="held") == 1
        assert value(samples, "pglockkit_leases_live") == 1
        assert value(samples, "pg_exporter_last_scrape_error") == 0
        holder.execute("SELECT pglockkit.unlock('billing', 'invoice:1')")
        thread.join(5)
    # Once the holder lets go and the waiter commits, the gauges fall back to zero.
    db.conn.execute("SELECT pglockkit.sample()")
    samples = exporter.scrape()
    assert value(samples, "pglockkit_lock_holds_locks", namespace="billing") == 0
    assert value(samples, "pglockkit_namespace_locks_held", namespace="billing") == 0
    assert value(samples, "pglockkit_namespace_waiters", namespace="billing") == 0
    assert value(samples, "pglockkit_lock_waits_waiting") == 0
    assert value(samples, "pglockkit_idle_lock_holders_locks", namespace="billing") == 0


def test_a_hostile_queue_name_is_one_label_value_and_forges_no_series(db, exporter):
    """Any pglockkit_user may name a queue: a name with a quote, a backslash, a newline and text
    that reads as a sample of its own is one label value of one series per metric, escaped by
    the exporter as the text format says, and no other series appears."""
    name = 'mail"} pglockkit_forged 1\n# HELP x\\'
    db.conn.execute("SELECT pglockkit.enqueue_job(%s, '{}'::jsonb)", (name,))
    samples = exporter.scrape()
    assert value(samples, "pglockkit_queue_ready", queue=name) == 1
    assert not [n for n, _ in samples if "forged" in n]
    assert value(samples, "pg_exporter_last_scrape_error") == 0
