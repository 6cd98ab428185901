"""The chart's bundle destination: ``bundles.to`` becomes the memwatch container's MEMWATCH_BUNDLE_TO in both shapes,
before the user's own ``memwatch.env``; off (no variable) by default; the agent example ships to its hostPath."""

from __future__ import annotations

import pytest
from helm_chart import ROOT, documents, template


def memwatch_env(text: str) -> list[dict] | None:
    for doc in documents(text):
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("initContainers", []) + spec.get("containers", []):
            if container["name"] == "memwatch":
                return container.get("env")
    raise AssertionError("no memwatch container rendered")


AGENT_GRACE = [{"name": "MEMWATCH_GRACE_PERIOD", "value": "60"}]
"""Told to stop with its pod, the agent ships within its grace period (agent.terminationGracePeriodSeconds)."""


@pytest.mark.parametrize(("shape", "first"), [([], []), (["--set", "mode=agent"], AGENT_GRACE),
                                              (["--set", "memwatch.nativeSidecar=false"], [])])
def test_bundles_to_sets_the_environment_variable(shape, first):
    rendered = template("r", [*shape, "--set", "bundles.to=s3://incidents/prod",
                              "--set-json", 'memwatch.env=[{"name":"AWS_REGION","value":"eu-west-1"}]'])
    assert memwatch_env(rendered) == [*first, {"name": "MEMWATCH_BUNDLE_TO", "value": "s3://incidents/prod"},
                                      {"name": "AWS_REGION", "value": "eu-west-1"}]


@pytest.mark.parametrize(("shape", "env"), [([], None), (["--set", "mode=agent"], AGENT_GRACE)])
def test_off_by_default(shape, env):
    assert memwatch_env(template("r", shape)) == env  # no MEMWATCH_BUNDLE_TO


def test_the_agent_example_and_its_rendering_ship_to_the_nodes_folder():
    rendered = template("memwatch-agent", ["-f", str(ROOT / "deploy/helm/examples/agent.yaml")])
    expected = [*AGENT_GRACE, {"name": "MEMWATCH_BUNDLE_TO", "value": "file:///var/lib/memwatch/incidents"}]
    assert memwatch_env(rendered) == expected
    assert memwatch_env((ROOT / "deploy/daemonset/memwatch-agent.yaml").read_text()) == expected
