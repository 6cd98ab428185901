"""A real Prometheus scrapes a real ``memwatch serve --prometheus`` while a simulated leak runs to its OOM.

Every expression of the Grafana dashboard and of the alert rules is then evaluated by that
Prometheus, at a moment of the run, and must return data; the leak's alert must reach ``pending`` or
``firing`` in ``ALERTS``; and once the run is over (and its series have lingered), they go stale.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from processes import SidecarProcess, memwatch_env, wait_for
from prometheus_server import PrometheusServer, free_port

DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
LINGER_SECONDS = 6

GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$host": ".*", "$run": ".*", "$rank": ".*"}


def dashboard_expressions() -> list[str]:
    """Every PromQL expression of the dashboard (panels, annotations, variables), as Grafana would send it."""
    dashboard = json.loads((DASHBOARDS / "memwatch.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    for variable in dashboard["templating"]["list"]:
        match = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"])
        assert match, variable["query"]
        exprs.append(match.group(1))  # label_values(selector, label) reads the selector's series
    resolved = []
    for expr in exprs:
        for name, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(name, value)
        assert "$" not in expr, expr
        resolved.append(expr)
    return resolved


def _active(prometheus: PrometheusServer, alert: str) -> list[dict]:
    return prometheus.query(f'ALERTS{{alertname="{alert}", alertstate=~"pending|firing"}}')


def test_prometheus_scrapes_the_sidecar_and_every_dashboard_and_rule_expression_has_data(
        runtime_dir: Path, db_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMWATCH_EXPORT_LINGER", str(LINGER_SECONDS))
    port = free_port()
    with SidecarProcess(runtime_dir, db_path, "--prometheus", str(port)) as sidecar, \
            PrometheusServer(tmp_path, [f"127.0.0.1:{port}"], [DASHBOARDS / "memwatch-alerts.yml"]) as prometheus:
        wait_for(lambda: prometheus.query('up{job="memwatch"} == 1'), timeout=30, what="prometheus to scrape memwatch")
        sim = subprocess.Popen([sys.executable, "-m", "memwatch", "sim", "--scenario", "non_torch_leak",
                                "--speed", "3", "--json"], env=memwatch_env(runtime_dir, db_path),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            flagged = wait_for(lambda: prometheus.query('memwatch_flags_total{kind="non_torch_drift"} > 0'),
                               timeout=60, what="the drift flag to be scraped")
            run_id = flagged[0]["metric"]["run_id"]
            alert = wait_for(lambda: _active(prometheus, "MemwatchNonTorchDrift"), timeout=20,
                             what="the drift alert to go pending or firing")
            assert alert[0]["metric"]["run_id"] == run_id and alert[0]["metric"]["severity"] == "warning"
            moment = time.time()  # the run is live, drifting, and flagged within the last minute
            out, err = sim.communicate(timeout=60)
        finally:
            if sim.poll() is None:
                sim.kill()
                sim.wait(timeout=10)
        assert sim.returncode == 0, err
        assert json.loads(out)["status"] == "crashed"  # the leaking cudaMalloc fails outside PyTorch: no oom event
        # The run's last values linger for a while: the risk and the vanished margin reach the alerts too.
        for name in ("MemwatchOomRisk", "MemwatchOomMarginLow"):
            wait_for(lambda name=name: _active(prometheus, name), timeout=LINGER_SECONDS + 10, what=f"{name}")

        empty = [expr for expr in dashboard_expressions() if not prometheus.query(expr, at=moment)]
        assert empty == [], "dashboard expressions without data"

        rules = [rule for group in prometheus.api("rules")["groups"] for rule in group["rules"]]
        assert len(rules) == 11 and all(rule["health"] == "ok" for rule in rules), rules
        for rule in rules:
            # The quantity each alert compares (its threshold cut off) exists for this run.
            quantity = re.fullmatch(r"(.*?)\s*[<>]=?\s*[0-9.e+]+", rule["query"]).group(1)
            assert prometheus.query(quantity, at=moment), rule["name"]
        drift = next(rule for rule in rules if rule["name"] == "MemwatchNonTorchDrift")
        assert [r["metric"]["run_id"] for r in prometheus.query(drift["query"], at=moment)] == [run_id]

        # Bounded cardinality: once the linger is over the run's series are gone from the scrape (stale).
        wait_for(lambda: not prometheus.query(f'memwatch_samples_total{{run_id="{run_id}"}}'),
                 timeout=LINGER_SECONDS + 15, what="the ended run's series to go stale")
        assert prometheus.query(f'memwatch_samples_total{{run_id="{run_id}"}}', at=moment)
        output = sidecar.stop()
    assert sidecar.proc.returncode == 0, output
    assert f"exporting to Prometheus on http://127.0.0.1:{port}/metrics" in output
