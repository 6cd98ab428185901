"""Render the plain manifests in deploy/sidecar and deploy/daemonset from the Helm chart (``make manifests``).

The plain files are the chart's own rendering, so that ``kubectl apply -f`` and the container tests run exactly
what ``helm install`` would; ``tests/test_helm_chart.py`` renders again and compares.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHART = "deploy/helm/memwatch"
KUBE_VERSION = "1.30.0"
"""Pinned so the rendering does not change with the Helm binary's default (the chart checks it for native sidecars)."""

# (plain manifest, release name, values file): paths relative to the repository root.
MANIFESTS: list[tuple[str, str, str]] = [
    ("deploy/sidecar/vllm-with-memwatch.yaml", "vllm-qwen", "deploy/helm/examples/sidecar.yaml"),
    ("deploy/daemonset/memwatch-agent.yaml", "memwatch-agent", "deploy/helm/examples/agent.yaml"),
    ("deploy/daemonset/vllm-pod.yaml", "vllm-qwen", "deploy/helm/examples/engine.yaml"),
]


def render(helm: str, release: str, values: str) -> str:
    """One manifest as checked in: a header saying where it comes from, then ``helm template``'s output."""
    command = [helm, "template", release, CHART, "-f", values, "--kube-version", KUBE_VERSION]
    output = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True, timeout=60).stdout
    header = (f"# The Helm chart {CHART}, rendered by `make manifests`:\n"
              f"#   helm template {release} {CHART} -f {values} --kube-version {KUBE_VERSION}\n"
              "# Edit the chart or the values, not this file: tests/test_helm_chart.py renders and compares.\n")
    return header + output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--helm", default=".tools/helm/helm", help="the helm binary (make .tools/helm/helm)")
    helm = str((ROOT / parser.parse_args().helm).resolve())
    for path, release, values in MANIFESTS:
        (ROOT / path).write_text(render(helm, release, values))
        print(f"rendered {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
