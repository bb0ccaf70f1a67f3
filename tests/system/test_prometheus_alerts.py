"""sql/prometheus_alerts.yaml: the rules load in Prometheus's own checker, fire (and stay quiet)
as tests/system/prometheus_alerts_test.yaml expects under ``promtool test rules`` (Debian's
``prometheus`` package), and read only metrics and labels that sql/postgres_exporter.yaml
exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "sql" / "prometheus_alerts.yaml"
RULE_TESTS = ROOT / "tests" / "system" / "prometheus_alerts_test.yaml"
EXPORTER = ROOT / "sql" / "postgres_exporter.yaml"


def _promtool() -> str:
    found = shutil.which("promtool")
    assert found, "not installed: apt-get install prometheus (scripts/test does)"
    return found


def _exported() -> dict[str, set[str]]:
    """{metric name: its labels} from the exporter's queries: one gauge per GAUGE column, named
    <query>_<column>, labelled by the query's LABEL columns."""
    metrics: dict[str, set[str]] = {}
    text = EXPORTER.read_text()
    for query, body in re.findall(r"^(\w+):\n((?:[ #].*\n|\n)*)", text, re.M):
        columns = re.findall(r'^    - (\w+):\n        usage: "(\w+)"', body, re.M)
        labels = {c for c, usage in columns if usage == "LABEL"}
        for column, usage in columns:
            if usage == "GAUGE":
                metrics[f"{query}_{column}"] = labels
    return metrics


def _rules() -> dict[str, str]:
    """{alert name: its text (expr, labels, annotations)}."""
    parts = re.split(r"^      - alert: ", RULES.read_text(), flags=re.M)[1:]
    return {part.split("\n", 1)[0].strip(): part for part in parts}


def test_the_exporter_parse_finds_the_documented_metrics():
    metrics = _exported()
    assert metrics["pglockkit_namespace_waiters"] == {"namespace"}
    assert metrics["pglockkit_queue_dead"] == {"queue"}
    assert metrics["pglockkit_lock_waits_waiting"] == set()
    assert "pglockkit_namespace_namespace" not in metrics


def test_rules_read_only_exported_metrics_and_their_labels():
    metrics = _exported()
    rules = _rules()
    assert len(rules) >= 9
    for name, text in rules.items():
        expr = re.search(r"^        expr: (.*)$", text, re.M)[1]
        used = set(re.findall(r"\bpglockkit_\w+", expr))
        assert used, name
        assert used <= metrics.keys(), f"{name}: {used - metrics.keys()} not exported"
        labels = set().union(*(metrics[m] for m in used))
        templated = set(re.findall(r"\$labels\.(\w+)", text))
        assert templated <= labels, f"{name}: {templated - labels} are not labels of {used}"


def test_every_rule_has_a_case_that_fires_and_one_that_must_not():
    tests = RULE_TESTS.read_text()
    for name in _rules():
        cases = re.findall(rf"alertname: {name}\n\s+exp_alerts:( \[\])?", tests)
        assert "" in cases, f"{name}: no case where it fires"
        assert " []" in cases, f"{name}: no case where it must not fire"


def test_promtool_checks_the_rules():
    out = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in out.stdout


def test_promtool_unit_tests_of_the_rules_pass():
    out = subprocess.run(
        [_promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_fails_a_rule_that_would_fire_too_early(tmp_path):
    """The unit tests can fail: with PglockkitLockWaiters firing at once, the case where reports'
    waiters come and go (and the 5-minute case of billing) must break."""
    (tmp_path / "sql").mkdir()
    (tmp_path / "tests" / "system").mkdir(parents=True)
    rules = RULES.read_text()
    eager = rules.replace(
        "expr: pglockkit_namespace_waiters > 0\n        for: 5m",
        "expr: pglockkit_namespace_waiters > 0\n        for: 0m",
    )
    assert eager != rules
    (tmp_path / "sql" / RULES.name).write_text(eager)
    (tmp_path / RULE_TESTS.relative_to(ROOT)).write_text(RULE_TESTS.read_text())
    out = subprocess.run(
        [_promtool(), "test", "rules", str(tmp_path / RULE_TESTS.relative_to(ROOT))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "alertname: PglockkitLockWaiters, time: 5m" in out.stdout + out.stderr
    assert 'namespace="reports"' in out.stdout + out.stderr


def test_the_monitoring_page_lists_every_alert():
    page = (ROOT / "docs" / "monitoring.md").read_text()
    assert "sql/prometheus_alerts.yaml" in page
    for name in _rules():
        assert f"`{name}`" in page, name
