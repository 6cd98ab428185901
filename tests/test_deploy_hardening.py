"""The chart as an operator's review reads it, on every rendering (tests/rendered.py): Pod Security "restricted"
for every container it owns (the Pod Security Standards' fields, tests/pod_security.py) with each exception named, a
small /tmp for memwatch's read-only root, extra volumes, the agent's priority class, egress bounded when bundles are
shipped, and docs that say what the code does."""

from __future__ import annotations

import re
import tomllib

import pytest
import yaml
from helm_chart import VALUE_SETS, documents, template
from pod_security import violations
from rendered import (
    IDS,
    RESOURCES,
    ROOT,
    SETS,
    WORKLOADS,
    arg_value,
    named,
    pod_labels,
    pod_spec,
    quantity_bytes,
    workloads,
)


def _level(resource: dict, name: str) -> str:
    """The Pod Security level the chart says this workload's namespace needs (what namespace.create labels)."""
    if resource["kind"] == "DaemonSet" or any("hostPath" in v for v in pod_spec(resource).get("volumes", [])):
        return "privileged"
    engine_uid = next((c.get("securityContext", {}).get("runAsUser") for c in named(resource, "vllm")), None)
    return "restricted" if engine_uid else "baseline"


@pytest.mark.parametrize(("name", "resource"), RESOURCES, ids=IDS)
def test_pod_security_restricted_for_every_container_the_chart_owns(name: str, resource: dict) -> None:
    # The Pod Security Standards' fields, checked as admission would: memwatch's own container meets "restricted"
    # in the sidecar shape; so does vLLM's wherever it runs as a non-root uid. The exceptions, each named: an
    # engine left as its image's root (runAsNonRoot alone, so "baseline"), the engine pod's hostPath rings
    # directory (its one exception), and the agent (root on two hostPaths: "privileged").
    if resource["kind"] not in WORKLOADS:
        return
    spec = pod_spec(resource)
    level = _level(resource, name)
    found = violations(spec, "restricted")
    if resource["kind"] == "DaemonSet":
        assert sorted(found) == ["memwatch.securityContext.runAsNonRoot", "memwatch.securityContext.runAsUser 0",
                                 "volume db: hostPath", "volume runtime: hostPath"], found
        (memwatch,) = named(resource, "memwatch")
        assert "hostPath" not in str([v for v in spec["volumes"] if v["name"] not in ("db", "runtime")])
        assert violations({"containers": [memwatch]}, "baseline") == []
        return
    if resource["kind"] == "Pod":  # mode: engine
        assert found == ["volume memwatch-rings: hostPath"], found
        # The uid is the pod's alone: a container-level one would override a pod run as another uid.
        (vllm,) = named(resource, "vllm")
        assert "runAsUser" not in vllm["securityContext"] and "runAsGroup" not in vllm["securityContext"]
        assert violations({**spec, "volumes": []}, "restricted") == []  # all but the hostPath
        return
    expected = [] if level == "restricted" else ["vllm.securityContext.runAsNonRoot"]
    assert found == expected, found
    assert violations(spec, "baseline") == []


def test_the_created_namespace_is_labelled_with_the_level_its_pods_meet() -> None:
    for args, level in ((["--set", "engine.runAsUser=1000"], "restricted"), ([], "baseline"),
                        (["--set", "mode=engine", "--set", "engine.runAsUser=1000"], "privileged")):
        docs = documents(template("r", ["--set", "namespace.name=llm", "--set", "namespace.create=true", *args]))
        (namespace,) = [d for d in docs if d["kind"] == "Namespace"]
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == level, args
        for workload in workloads("---\n".join(yaml.safe_dump(d) for d in docs)):
            assert violations(pod_spec(workload), level) == [], (args, level)


def test_the_pod_security_checks_refuse_what_the_standards_refuse() -> None:
    # The checker itself, on pods the standards name: each field alone is refused at its level.
    good = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}],
            "volumes": [{"name": "v", "emptyDir": {}}]}
    assert violations(good, "restricted") == []
    bad = {
        "spec.hostPID": {**good, "hostPID": True},
        "c.securityContext.privileged": {**good, "containers": [{"name": "c",
                                                                 "securityContext": {"privileged": True}}]},
        "volume h: hostPath": {**good, "volumes": [{"name": "h", "hostPath": {"path": "/"}}]},
        "c.ports.hostPort": {**good, "containers": [{**good["containers"][0], "ports": [{"hostPort": 80}]}]},
        "spec.securityContext.seccompProfile Unconfined": {**good, "securityContext": {
            "runAsNonRoot": True, "seccompProfile": {"type": "Unconfined"}}},
    }
    for field, spec in bad.items():
        assert field in violations(spec, "baseline"), field
    restricted_only = {
        "c.securityContext.runAsNonRoot": {**good, "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}},
        "c.securityContext.seccompProfile": {**good, "securityContext": {"runAsNonRoot": True}},
        "c.securityContext.allowPrivilegeEscalation": {**good, "containers": [{"name": "c", "securityContext": {
            "capabilities": {"drop": ["ALL"]}}}]},
        "c.securityContext.capabilities.drop ALL": {**good, "containers": [{"name": "c", "securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["NET_RAW"]}}}]},
        "volume g: gitRepo": {**good, "volumes": [{"name": "g", "gitRepo": {"repository": "x"}}]},
    }
    for field, spec in restricted_only.items():
        assert violations(spec, "baseline") == [] and field in violations(spec, "restricted"), field


@pytest.mark.parametrize(("name", "resource"), RESOURCES, ids=IDS)
def test_memwatchs_read_only_root_has_a_small_tmp(name: str, resource: dict) -> None:
    # Python's tempfile and the bundles' scratch need a writable /tmp: an emptyDir, bounded.
    for container in named(resource, "memwatch"):
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
        (volume,) = [v for v in pod_spec(resource)["volumes"] if v["name"] == tmp["name"]]
        assert "emptyDir" in volume, volume
        if tmp["name"] == "memwatch-tmp":  # the chart's own (a set may mount one of its own instead)
            assert quantity_bytes(volume["emptyDir"]["sizeLimit"]) == 64 * 2**20


def test_extra_volumes_reach_the_containers_and_replace_the_charts_own_mount() -> None:
    (deployment,) = workloads(SETS["chart:sidecar-bundles-volumes"])
    spec = pod_spec(deployment)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["db"] == {"name": "db", "persistentVolumeClaim": {"claimName": "memwatch-db"}}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert "memwatch-db" not in volumes  # the claim holds the database: no emptyDir left unused
    (memwatch,) = named(deployment, "memwatch")
    assert {m["mountPath"]: m["name"] for m in memwatch["volumeMounts"]} == {
        "/run/memwatch": "memwatch-run", "/var/lib/memwatch": "db", "/tmp": "memwatch-tmp"}
    (vllm,) = named(deployment, "vllm")
    assert {m["mountPath"]: m["name"] for m in vllm["volumeMounts"]} == {"/run/memwatch": "memwatch-run",
                                                                           "/dev/shm": "dshm"}
    (agent,) = workloads(SETS["chart:agent-bundles-otlp-volumes"])
    (memwatch,) = named(agent, "memwatch")
    assert {m["mountPath"]: m["name"] for m in memwatch["volumeMounts"]} == {
        "/run/memwatch": "runtime", "/var/lib/memwatch": "db", "/tmp": "scratch"}
    assert sorted(v["name"] for v in pod_spec(agent)["volumes"]) == ["db", "runtime", "scratch"]
    engine = workloads(template("e", ["--set", "mode=engine", "--set-json",
                                       'extraVolumes=[{"name":"dshm","emptyDir":{"medium":"Memory"}}]', "--set-json",
                                       'engine.extraVolumeMounts=[{"name":"dshm","mountPath":"/dev/shm"}]']))[0]
    assert [m["mountPath"] for m in named(engine, "vllm")[0]["volumeMounts"]] == ["/run/memwatch/rings", "/dev/shm"]
    assert [v["name"] for v in pod_spec(engine)["volumes"]] == ["memwatch-rings", "dshm"]


@pytest.mark.parametrize("name", list(SETS))
def test_the_agent_is_node_critical_and_the_engines_are_not(name: str) -> None:
    # A node agent is scheduled before, and evicted after, ordinary pods (dcgm-exporter's chart does the same);
    # priorityClassName stays the operator's for engine pods ("" by default; one set names "high").
    for workload in workloads(SETS[name]):
        expected = "system-node-critical" if workload["kind"] == "DaemonSet" else (
            "high" if name == "chart:sidecar-monitors-otlp" else None)
        assert pod_spec(workload).get("priorityClassName") == expected, name


@pytest.mark.parametrize("name", list(SETS))
def test_the_agent_ships_within_its_pods_grace_period_and_a_sidecar_keeps_the_default(name: str) -> None:
    # The agent is told to stop when its pod is: its shutdown may use the pod's whole grace period. A native
    # sidecar is told after the engine stopped, with less of it left, so it keeps the 30 s default.
    for workload in workloads(SETS[name]):
        for container in named(workload, "memwatch"):
            grace = {e["name"]: e.get("value") for e in container.get("env", [])}.get("MEMWATCH_GRACE_PERIOD")
            if workload["kind"] == "DaemonSet":
                assert grace == str(pod_spec(workload)["terminationGracePeriodSeconds"]), name
            else:
                assert grace is None, name


@pytest.mark.parametrize("name", list(SETS))
def test_egress_is_bounded_to_dns_and_the_store_when_bundles_are_shipped(name: str) -> None:
    docs = documents(SETS[name])
    egress = [d for d in docs if d["kind"] == "NetworkPolicy" and "Egress" in d["spec"]["policyTypes"]]
    for workload in workloads(SETS[name]):
        for container in named(workload, "memwatch"):
            to = {e["name"]: e.get("value") for e in container.get("env", [])}.get("MEMWATCH_BUNDLE_TO")
            labels = pod_labels(workload).items()
            mine = [p for p in egress if p["spec"]["podSelector"]["matchLabels"].items() <= labels]
            policy_on = "networkPolicy.enabled=false" not in " ".join(
                VALUE_SETS.get(name.removeprefix("chart:"), ("", []))[1])
            assert len(mine) == (1 if to and policy_on else 0), name
            for policy in mine:
                ports = [p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]]
                otlp = arg_value(container["args"], "--otlp")
                store = [443] if to.startswith(("s3://", "gs://", "az://")) else []
                assert ports == [53, 53, *store, *([int(otlp.rsplit(":", 1)[1])] if otlp else [])], (name, ports)


def test_the_docs_state_the_python_pyproject_requires_and_that_bundles_exist() -> None:
    required = re.fullmatch(r">=(3\.\d+)", tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "requires-python"]).group(1)
    for path in ("Dockerfile", "README.md", "deploy/README.md", "deploy/engine.Dockerfile"):
        text = (ROOT / path).read_text()
        assert set(re.findall(r"Python (3\.\d+)\+", text)) <= {required}, path
    assert "Python 3.11+" in (ROOT / "Dockerfile").read_text()
    for path in ("deploy/README.md", "deploy/helm/memwatch/values.yaml"):
        text = (ROOT / path).read_text()
        assert "no incident bundles" not in text and "does not make them yet" not in text, path
        assert "bundles.to" in text or "bundles:" in text, path
