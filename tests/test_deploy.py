"""The image and the Kubernetes objects: the plain manifests in deploy/ and the Helm chart rendered with several
value sets. Valid against Kubernetes' schemas (bundled: no cluster, no network), every memwatch option they pass
is one ``memwatch serve`` accepts, and what an operator would hit on a cluster is checked on the objects: engine
args after vLLM's ENTRYPOINT, an agent that needs no capability, no readinessProbe gating the engine, storage
within its limit, NetworkPolicy, monitors and service account."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
from helm_chart import VALUE_SETS, documents
from rendered import (
    IDS,
    RESOURCES,
    SETS,
    WORKLOADS,
    arg_value,
    named,
    pod_labels,
    pod_spec,
    quantity_bytes,
    workloads,
)

from memwatch.cli.serve import command as serve

from processes import memwatch_env, query, wait_for

ROOT = Path(__file__).parent.parent
KUBERNETES = "1.30.0"
"""The oldest version the manifests are checked against: native sidecars are on by default from 1.29."""
MONITORING = "monitoring.coreos.com/v1"
"""Prometheus Operator's kinds: not in Kubernetes' schemas; their fields are checked by the tests below."""
OPERATOR_DURATION = r"(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)"
"""monitoring.coreos.com/v1's Duration (the operator's CRDs validate interval and scrapeTimeout with it)."""




def test_both_shapes_and_the_engine_pod_are_there() -> None:
    names = {name.split(":", 1)[1] for name, _ in RESOURCES if not name.startswith("chart:")}
    assert {"Deployment/vllm-qwen", "DaemonSet/memwatch-agent", "Pod/vllm-qwen"} <= names


@pytest.mark.parametrize("version", [KUBERNETES, kubernetes_validate.latest_version()])
@pytest.mark.parametrize(("name", "resource"), RESOURCES, ids=IDS)
def test_every_object_is_valid_kubernetes_strictly(name: str, resource: dict, version: str) -> None:
    if resource["apiVersion"] == MONITORING:
        return  # a CRD's kind: test_monitors_scrape_the_metrics_port_and_keep_the_engine_labels checks it
    kubernetes_validate.validate(resource, version, strict=True)  # raises on an unknown or misspelt field


@pytest.mark.parametrize(("name", "resource"), RESOURCES, ids=IDS)
def test_memwatch_containers_pass_options_serve_accepts_and_have_probes(name: str, resource: dict) -> None:
    for container in named(resource, "memwatch"):
        assert "memwatch" in container["image"] and "vllm" not in container["image"]
        args = container["args"]
        assert args[0] == "serve"
        serve.make_context("serve", list(args[1:]))  # click raises on an unknown option or a bad value
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        health_port = int(arg_value(args, "--health").split(":")[-1])
        assert {p["name"]: p["containerPort"] for p in container["ports"]}["health"] == health_port
        assert container["livenessProbe"]["httpGet"]["port"] in (health_port, "health")


@pytest.mark.parametrize(("name", "resource"), RESOURCES, ids=IDS)
def test_no_memwatch_readiness_probe_gates_an_engine(name: str, resource: dict) -> None:
    # A native sidecar's readinessProbe (or an ordinary container's beside the engine) is the pod's readiness:
    # a locked database would take vLLM out of its Service. Liveness restarts memwatch alone.
    if named(resource, "vllm"):
        for container in named(resource, "memwatch"):
            assert "readinessProbe" not in container, name
            assert container["startupProbe"]["httpGet"]["path"] == "/readyz"


@pytest.mark.parametrize(("name", "resource"), RESOURCES, ids=IDS)
def test_engine_args_follow_the_images_entrypoint(name: str, resource: dict) -> None:
    # vLLM's image has ENTRYPOINT ["vllm", "serve"]; Kubernetes appends args: they must start with the model.
    for container in named(resource, "vllm"):
        assert "vllm" in container["image"] and "memwatch" in container["image"]
        assert "command" not in container
        assert container["args"][0] not in ("vllm", "serve"), container["args"]
        assert container["args"][:3] == ["Qwen/Qwen2.5-0.5B-Instruct", "--gpu-memory-utilization", "0.85"]


@pytest.mark.parametrize(("name", "resource"), RESOURCES, ids=IDS)
def test_engines_get_the_downward_api_names_memwatch_reads(name: str, resource: dict) -> None:
    for container in named(resource, "vllm"):
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
        assert env["MEMWATCH"] == "1" and env["MEMWATCH_SPAWN"] == "0", name
        assert env["MEMWATCH_RUNTIME_DIR"] == "/run/memwatch/rings"
        assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


@pytest.mark.parametrize(("name", "resource"), RESOURCES, ids=IDS)
def test_the_agent_needs_no_capability_and_is_in_its_runtime_group(name: str, resource: dict) -> None:
    # Without FSETID, chmod by a non-member drops the setgid bit (1770, refused for ever); as a member of the
    # group root needs no capability to make its own directory 3770 and read the rings through the group.
    if resource["kind"] != "DaemonSet":
        return
    (container,) = named(resource, "memwatch")
    capabilities = container["securityContext"]["capabilities"]
    assert capabilities.get("drop") == ["ALL"] and not capabilities.get("add"), capabilities
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    group = int(arg_value(container["args"], "--runtime-group"))
    assert group in pod_spec(resource)["securityContext"]["supplementalGroups"]


def test_engine_pods_for_the_agent_carry_its_group() -> None:
    (agent,) = workloads(SETS["deploy/daemonset/memwatch-agent.yaml"])
    (memwatch,) = named(agent, "memwatch")
    group = int(arg_value(memwatch["args"], "--runtime-group"))
    env = {e["name"]: e.get("value", "") for e in memwatch.get("env", [])}
    trusted = {0, *(int(a.split("=")[1]) for a in memwatch["args"] if a.startswith("--trust-uid=")),
               *(int(u) for u in env.get("MEMWATCH_TRUST_UIDS", "").split(",") if u)}
    (engine,) = workloads(SETS["deploy/daemonset/vllm-pod.yaml"])
    spec = pod_spec(engine)
    assert group in spec["securityContext"]["supplementalGroups"]
    assert spec["securityContext"].get("runAsUser", 0) in trusted


@pytest.mark.parametrize("name", list(SETS))
def test_storage_holds_the_bound_the_manifest_states(name: str) -> None:
    # An emptyDir past its sizeLimit gets the pod evicted, engine included: the database's bound under the
    # retention passed to memwatch is stated in the manifest, and the limit holds it.
    text = SETS[name]
    for workload in workloads(text):
        for container in named(workload, "memwatch"):
            stated = re.search(r"^# - Database bound: (\S+) under (.*)$", text, re.M)
            assert stated, f"{name}: no database bound stated"
            bound = quantity_bytes(stated.group(1))
            for option in ("--keep-full", "--keep-evidence", "--keep-rollups", "--max-db-size"):
                value = arg_value(container["args"], option)
                assert (value is None) == (f"{option}=" not in stated.group(2)), (option, stated.group(2))
            if (size := arg_value(container["args"], "--max-db-size")) is not None:
                from memwatch.units import parse_bytes

                assert 0 < parse_bytes(size) <= bound, (size, bound)  # the cap is what makes it a bound
            else:
                assert arg_value(container["args"], "--keep-rollups") not in (None, "forever"), name
            mounts = {m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/var/lib/memwatch"}
            for volume in pod_spec(workload)["volumes"]:
                if volume["name"] in mounts and "emptyDir" in volume:
                    assert quantity_bytes(volume["emptyDir"]["sizeLimit"]) >= bound, name


@pytest.mark.parametrize("name", list(SETS))
def test_pods_mount_no_service_account_token(name: str) -> None:
    for doc in documents(SETS[name]):
        if doc["kind"] == "ServiceAccount":
            assert doc["automountServiceAccountToken"] is False
        if doc["kind"] in WORKLOADS:
            assert pod_spec(doc)["automountServiceAccountToken"] is False, name


@pytest.mark.parametrize("name", list(SETS))
def test_a_hostpath_namespace_gets_the_pod_security_level_it_needs(name: str) -> None:
    docs = documents(SETS[name])
    levels = {d["metadata"]["name"]: d["metadata"]["labels"].get("pod-security.kubernetes.io/enforce")
              for d in docs if d["kind"] == "Namespace"}
    for doc in docs:
        # The plain agent manifest creates its namespace; the chart does with namespace.create (otherwise the
        # namespace is the operator's, labelled as deploy/README.md says).
        if doc["kind"] == "DaemonSet" and (levels or not name.startswith("chart:")):
            assert levels[doc["metadata"]["namespace"]] == "privileged", name


@pytest.mark.parametrize("name", list(SETS))
def test_network_policy_admits_metrics_from_monitoring_and_no_pod_to_health(name: str) -> None:
    text = SETS[name]
    policies = [d for d in documents(text) if d["kind"] == "NetworkPolicy" and "Ingress" in d["spec"]["policyTypes"]]
    if "networkPolicy.enabled=false" in " ".join(VALUE_SETS.get(name.removeprefix("chart:"), ("", []))[1]):
        assert not policies
        return
    for workload in workloads(text):
        ports = {p["name"]: p["containerPort"] for c in named(workload, "memwatch") for p in c["ports"]}
        if not ports:
            continue  # an engine pod for the agent: memwatch listens elsewhere
        labels = pod_labels(workload)
        (policy,) = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        rules = {port["port"]: rule for rule in policy["spec"]["ingress"] for port in rule["ports"]}
        assert ports["health"] not in rules and "health" not in rules  # the kubelet's probes come from the node
        if "metrics" in ports:
            assert rules[ports["metrics"]]["from"][0]["namespaceSelector"]["matchLabels"]
        for engine in named(workload, "vllm"):
            assert {p["containerPort"] for p in engine["ports"]} <= set(rules)


@pytest.mark.parametrize("name", list(SETS))
def test_monitors_scrape_the_metrics_port_and_keep_the_engine_labels(name: str) -> None:
    docs = documents(SETS[name])
    services = [d for d in docs if d["kind"] == "Service"]
    for monitor in [d for d in docs if d["apiVersion"] == MONITORING]:
        selector = monitor["spec"]["selector"]["matchLabels"]
        if monitor["kind"] == "ServiceMonitor":
            (service,) = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
            names = {p["name"] for p in service["spec"]["ports"]}
            endpoints = monitor["spec"]["endpoints"]
            (workload,) = [w for w in workloads(SETS[name])
                           if service["spec"]["selector"].items() <= pod_labels(w).items()]
            target = {p["targetPort"] for p in service["spec"]["ports"] if p["name"] == "metrics"}
            assert target <= {p["containerPort"] for c in named(workload, "memwatch") for p in c["ports"]}
        else:
            assert monitor["kind"] == "PodMonitor"
            (workload,) = [w for w in workloads(SETS[name]) if selector.items() <= pod_labels(w).items()]
            names = {p["name"] for c in named(workload, "memwatch") for p in c["ports"]}
            endpoints = monitor["spec"]["podMetricsEndpoints"]
        assert [e["port"] for e in endpoints] == ["metrics"] and "metrics" in names
        assert all(e["honorLabels"] is True for e in endpoints)
        for endpoint in endpoints:  # what the operator's CRD admits: its Duration pattern, RelabelConfig lists
            for field in ("interval", "scrapeTimeout"):
                assert field not in endpoint or re.fullmatch(OPERATOR_DURATION, endpoint[field]), endpoint
            for field in ("relabelings", "metricRelabelings"):
                assert all(isinstance(r, dict) and r.get("action") for r in endpoint.get(field, [])), endpoint


def test_the_images_command_parses_and_what_it_copies_exists() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", dockerfile, re.M).group(1))
    serve.make_context("serve", cmd[1:])
    assert re.search(r"^USER 10001:10001$", dockerfile, re.M)  # non-root by default
    assert not [line for line in dockerfile.splitlines() if "pip" in line and "torch" in line]
    for dockerfile_path in (ROOT / "Dockerfile", ROOT / "deploy" / "engine.Dockerfile"):
        for line in dockerfile_path.read_text().splitlines():
            if line.startswith("COPY ") and "--from" not in line:
                for source in line.split()[1:-1]:
                    assert (ROOT / source).exists(), f"{dockerfile_path.name}: {source}"


def test_the_sidecar_needs_no_torch(runtime_dir: Path, db_path: Path, tmp_path: Path) -> None:
    # What the image leaves out: the sidecar stores an engine's ring with torch impossible to import.
    blocker = tmp_path / "no_torch"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    sidecar = subprocess.Popen([sys.executable, "-m", "memwatch", "serve", "--poll-interval", "0.1"],
                               env=memwatch_env(runtime_dir, db_path, PYTHONPATH=str(blocker)),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from probes import ScriptedProbe; "
                  "from memwatch_engine import Monitor; m = Monitor(engine='e', probe=ScriptedProbe(), run_id='nt'); "
                  "[m.step('decode', num_seqs=1) for _ in range(5)]; m.close()")
        subprocess.run([sys.executable, "-c", script], check=True, timeout=60, env=memwatch_env(runtime_dir, db_path))
        wait_for(lambda: query(db_path, "SELECT status FROM runs WHERE run_id = 'nt'") == [("ok",)] or
                 sidecar.poll() is not None, what="the run stored")
        assert query(db_path, "SELECT count(*) FROM samples WHERE run_id = 'nt' AND step_kind = 'decode'") == [(5,)]
    finally:
        sidecar.terminate()
        output, _ = sidecar.communicate(timeout=30)
    assert sidecar.returncode == 0, output
