"""``dashboards/``: the alert rules pass promtool and their unit tests; the dashboard covers the ledger.

The rules' unit tests (``tests/promtool/memwatch-alerts.test.yml``) fire each alert on a synthetic
series and keep it silent on a clean run; ``test_export_prometheus.py`` evaluates the same files
against a real Prometheus scraping a real sidecar.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from memwatch.flags import FLAG_KINDS, RESERVE_OVERSTATED

from prometheus_server import binary

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "dashboards" / "memwatch-alerts.yml"
RULE_TESTS = ROOT / "tests" / "promtool" / "memwatch-alerts.test.yml"
DASHBOARD = ROOT / "dashboards" / "memwatch.json"

CHECK_TERMS = ("budget_bytes", "non_torch_bytes", "weights_bytes", "torch_other_bytes", "kv_bytes",
               "activation_reserve_bytes", "headroom_bytes", "cache_slack_bytes", "reclaimable_cache_bytes",
               "pinned_cache_bytes", "torch_kept_bytes", "residual_bytes", "oom_margin_bytes")
"""Every ledger term ``memwatch check`` prints."""

INFO_ONLY_KINDS = {RESERVE_OVERSTATED}
"""Flag kinds no detector raises above ``info`` (a generous warmup reserve is advice, not a fault)."""


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("promtool"), *args], capture_output=True, text=True, timeout=60)


def test_promtool_checks_the_rules() -> None:
    result = _promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 11 rules found" in result.stdout


def test_promtool_unit_tests_fire_each_alert_and_stay_silent_on_a_clean_run() -> None:
    result = _promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = re.findall(r"^\s+- alert: (\w+)$", RULES.read_text(), flags=re.M)
    tests = RULE_TESTS.read_text()
    for alert in alerts:
        cases = re.findall(rf"- alertname: {alert}\n\s+eval_time: \w+\n\s+exp_alerts:(.*)", tests)
        assert sorted(case.strip() == "[]" for case in cases) == [False, True], alert  # one silent, one firing


POD_LABELS = ("namespace", "pod", "container", "node", "k8s_pod_uid", "container_id")
"""The engine's pod as it claims it (dcgm-exporter's names) and as the node agent reads it from the writer's cgroup."""


def test_every_alert_keeps_the_engines_pod_labels() -> None:
    # An aggregation that names only host, run_id and rank drops them: an alert that cannot say which pod it is.
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    assert len(rules) == 11
    for rule in rules:
        kept = re.fullmatch(r"\w+ by \(([^)]*)\) \(.*\) [<>] [0-9]+", rule["expr"])
        assert kept, rule["expr"]
        labels = [label.strip() for label in kept.group(1).split(",")]
        assert labels == ["host", "run_id", "rank", *POD_LABELS], rule["alert"]
    # promtool's unit tests (above) fire each alert on a series with these labels and expect every one of them
    # on the alert: count the cases that check them, one per alert but MemwatchOom (an engine outside a pod).
    tests = RULE_TESTS.read_text()
    assert tests.count("k8s_pod_uid: 7c9e6679-7425-40de-944b-e07fc1f90ae7\n") == 10
    assert tests.count("summary: \"run bad rank 0 on node1 (pod llm/vllm-0):") == 10


def test_one_alert_per_flag_kind_of_warning_or_worse_and_one_for_the_oom_margin() -> None:
    rules = RULES.read_text()
    kinds = re.findall(r'memwatch_flags_total\{kind="(\w+)", severity=~"warning\|critical"\}', rules)
    assert sorted(kinds) == sorted(set(FLAG_KINDS) - INFO_ONLY_KINDS)
    assert "memwatch_oom_margin_bytes" in rules


def test_the_dashboard_imports_with_a_datasource_input_and_shows_every_ledger_term_row_by_row() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert [(i["name"], i["type"], i["pluginId"]) for i in dashboard["__inputs"]] == [
        ("DS_PROMETHEUS", "datasource", "prometheus")]
    grafana = next(r for r in dashboard["__requires"] if r["id"] == "grafana")
    assert int(grafana["version"].split(".")[0]) >= 10
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in panel["targets"])
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["host", "run", "rank"]
    first = panels[0]  # the invariant: the ledger stacked against total × utilization, one panel per rank
    assert first["repeat"] == "rank" and first["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    first_exprs = " ".join(t["expr"] for t in first["targets"])
    for term in ("non_torch", "weights", "torch_other", "kv", "activation_reserve", "headroom", "budget"):
        assert f"memwatch_{term}_bytes" in first_exprs, term
    # Then, row by row: drift (non-PyTorch and PyTorch kept across steps, residual), fragmentation (cache slack),
    # KV and preemptions, OOM margin.
    rows = [p["title"].lower() for p in dashboard["panels"] if p["type"] == "row"]
    order = ("the ledger", "drift", "fragmentation", "kv", "oom margin")
    assert [next(i for i, title in enumerate(rows) if title.startswith(row)) for row in order] == list(range(5)), rows
    after = {row: _row_panels(dashboard, row) for row in ("drift", "fragmentation", "kv", "oom margin")}
    assert [t["expr"].split("{")[0] for p in after["drift"] for t in p["targets"]] == [
        "memwatch_non_torch_bytes", "memwatch_torch_kept_bytes", "memwatch_residual_bytes"]
    assert "memwatch_cache_slack_bytes" in [t["expr"].split("{")[0] for t in after["fragmentation"][0]["targets"]]
    kv = " ".join(t["expr"] for p in after["kv"] for t in p["targets"])
    assert "memwatch_kv_blocks_used" in kv and "memwatch_preemptions_total" in kv
    assert after["oom margin"][0]["targets"][0]["expr"].startswith("memwatch_oom_margin_bytes{")
    text = DASHBOARD.read_text()
    for term in CHECK_TERMS:
        assert f"memwatch_{term}" in text, f"ledger term {term} is not on the dashboard"
    assert dashboard["annotations"]["list"][-1]["expr"].count("memwatch_flags_total") == 1


def _row_panels(dashboard: dict, row: str) -> list[dict]:
    """The panels under the row whose title starts with ``row`` (up to the next row)."""
    panels, inside = [], False
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            inside = panel["title"].lower().startswith(row)
        elif inside:
            panels.append(panel)
    return panels


def test_the_readmes_scrape_example_keeps_the_pod_labels_on_the_charts_port() -> None:
    # Without honor_labels the engine pod's namespace/pod/container become exported_*, and the alerts' labels with
    # them; the port is the one the chart's memwatch listens on.
    readme = (ROOT / "dashboards" / "README.md").read_text()
    config = yaml.safe_load(re.search(r"```yaml\n(global:.*?)```", readme, re.S).group(1))
    (job,) = config["scrape_configs"]
    assert job["honor_labels"] is True
    chart_port = yaml.safe_load((ROOT / "deploy" / "helm" / "memwatch" / "values.yaml").read_text())[
        "exporters"]["prometheus"]["port"]
    ports = {int(target.rsplit(":", 1)[1]) for target in job["static_configs"][0]["targets"]}
    assert ports == {chart_port} == {9400}
    assert config["rule_files"] == ["/path/to/dashboards/memwatch-alerts.yml"]
