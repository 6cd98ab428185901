"""docs/deployment.md's PromQL joins, run by promtool on series where an engine claims another team's pod: the join
on ``k8s_pod_uid`` gives the names kube-state-metrics has for that UID, and the second query finds the forgery."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from prometheus_server import binary

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "deployment.md"

# Run r1's engine lives in team-a/attacker-0 (UID uid-a) and claims team-b/victim-0; run r2 is victim-0 itself.
COMMON = 'host="gpu-7", rank="0", container="vllm"'
FORGED = f'{COMMON}, run_id="r1", namespace="team-b", pod="victim-0", k8s_pod_uid="uid-a", container_id="aaaa"'
HONEST = f'{COMMON}, run_id="r2", namespace="team-b", pod="victim-0", k8s_pod_uid="uid-b", container_id="bbbb"'
SERIES = [
    (f"memwatch_headroom_bytes{{{FORGED}}}", "100"), (f"memwatch_headroom_bytes{{{HONEST}}}", "200"),
    (f"memwatch_samples_total{{{FORGED}}}", "5"), (f"memwatch_samples_total{{{HONEST}}}", "7"),
    ('kube_pod_info{namespace="team-a", pod="attacker-0", uid="uid-a", node="gpu-7"}', "1"),
    ('kube_pod_info{namespace="team-b", pod="victim-0", uid="uid-b", node="gpu-7"}', "1"),
    ('kube_pod_container_info{namespace="team-a", pod="attacker-0", uid="uid-a", container="engine", '
     'container_id="containerd://aaaa"}', "1"),
    ('kube_pod_container_info{namespace="team-b", pod="victim-0", uid="uid-b", container="vllm", '
     'container_id="containerd://bbbb"}', "1"),
]


def _queries() -> list[str]:
    """The doc's ```promql block, one query per paragraph, comments left out."""
    (block,) = re.findall(r"```promql\n(.*?)```", DOC.read_text(), re.S)
    paragraphs = [[line for line in part.splitlines() if not line.lstrip().startswith("#")]
                  for part in block.split("\n\n")]
    return [" ".join(line.strip() for line in lines) for lines in paragraphs if lines]


def _labels(**values: str) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(values.items())) + "}"


def test_the_docs_joins_name_the_pod_a_neighbour_cannot_forge(tmp_path: Path) -> None:
    joined, forged, named = _queries()
    base = {"host": "gpu-7", "rank": "0", "container": "vllm"}
    r1 = {**base, "run_id": "r1", "k8s_pod_uid": "uid-a", "container_id": "aaaa"}
    r2 = {**base, "run_id": "r2", "k8s_pod_uid": "uid-b", "container_id": "bbbb"}
    cases = [
        # The UID's names replace the claimed ones: r1 is attacker-0's, whatever it said.
        (joined, [(_labels(**r1, namespace="team-a", pod="attacker-0"), 100),
                  (_labels(**r2, namespace="team-b", pod="victim-0"), 200)]),
        # Only the series whose claim disagrees with its UID.
        (forged, [("memwatch_samples_total" + _labels(**r1, namespace="team-b", pod="victim-0"), 5)]),
        # The container's name from its id: r1's container is "engine", not the "vllm" it claimed.
        (named, [(_labels(**{**r1, "container": "engine"}, namespace="team-b", pod="victim-0"), 100),
                 (_labels(**r2, namespace="team-b", pod="victim-0"), 200)]),
    ]
    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": series, "values": f"{value}x5"} for series, value in SERIES],
        "promql_expr_test": [{"expr": expr, "eval_time": "2m",
                              "exp_samples": [{"labels": labels, "value": value} for labels, value in expected]}
                             for expr, expected in cases],
    }]}
    path = tmp_path / "joins.test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    done = subprocess.run([binary("promtool"), "test", "rules", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
