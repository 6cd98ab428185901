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
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from helm_chart import VALUE_SETS, documents, template
from pod_security import violations

from memwatch.cli.serve import command as serve

from processes import memwatch_env, query, wait_for

ROOT = Path(__file__).parent.parent
PLAIN = ["deploy/sidecar/vllm-with-memwatch.yaml", "deploy/daemonset/memwatch-agent.yaml",
         "deploy/daemonset/vllm-pod.yaml"]
KUBERNETES = "1.30.0"
"""The oldest version the manifests are checked against: native sidecars are on by default from 1.29."""
MONITORING = "monitoring.coreos.com/v1"
"""Prometheus Operator's kinds: not in Kubernetes' schemas; their fields are checked by the tests below."""
WORKLOADS = {"Deployment", "DaemonSet", "Pod"}


def _sets() -> dict[str, str]:
    """Every set of objects checked: each plain manifest, and the chart rendered with each value set."""
    found = {path: (ROOT / path).read_text() for path in PLAIN}
    found.update({f"chart:{name}": template(release, args) for name, (release, args) in VALUE_SETS.items()})
    return found


SETS = _sets()


def _resources() -> list[tuple[str, dict]]:
    return [(f"{name}:{doc['kind']}/{doc['metadata']['name']}", doc) for name, text in SETS.items()
            for doc in documents(text)]


def _pod_spec(resource: dict) -> dict:
    spec = resource.get("spec", {})
    return spec.get("template", {}).get("spec", spec)


def _pod_labels(resource: dict) -> dict:
    if resource["kind"] == "Pod":
        return resource["metadata"].get("labels", {})
    return resource["spec"]["template"]["metadata"].get("labels", {})


def _containers(resource: dict) -> list[dict]:
    spec = _pod_spec(resource)
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _workloads(text: str) -> list[dict]:
    return [doc for doc in documents(text) if doc["kind"] in WORKLOADS]


def _named(resource: dict, name: str) -> list[dict]:
    return [c for c in _containers(resource) if c["name"] == name]


def _option(args: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")), None)


def _bytes(quantity: str) -> float:
    """A Kubernetes quantity (2Gi, 500M, 1.5G) in bytes."""
    number, unit = re.fullmatch(r"([0-9.]+)([KMGTP]i?|k)?", quantity).groups()
    scale = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
             "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, None: 1}
    return float(number) * scale[unit]


RESOURCES = _resources()
IDS = [name for name, _ in RESOURCES]


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
    for container in _named(resource, "memwatch"):
        assert "memwatch" in container["image"] and "vllm" not in container["image"]
        args = container["args"]
        assert args[0] == "serve"
        serve.make_context("serve", list(args[1:]))  # click raises on an unknown option or a bad value
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        health_port = int(_option(args, "--health").split(":")[-1])
        assert {p["name"]: p["containerPort"] for p in container["ports"]}["health"] == health_port
        assert container["livenessProbe"]["httpGet"]["port"] in (health_port, "health")


@pytest.mark.parametrize(("name", "resource"), RESOURCES, ids=IDS)
def test_no_memwatch_readiness_probe_gates_an_engine(name: str, resource: dict) -> None:
    # A native sidecar's readinessProbe (or an ordinary container's beside the engine) is the pod's readiness:
    # a locked database would take vLLM out of its Service. Liveness restarts memwatch alone.
    if _named(resource, "vllm"):
        for container in _named(resource, "memwatch"):
            assert "readinessProbe" not in container, name
            assert container["startupProbe"]["httpGet"]["path"] == "/readyz"


@pytest.mark.parametrize(("name", "resource"), RESOURCES, ids=IDS)
def test_engine_args_follow_the_images_entrypoint(name: str, resource: dict) -> None:
    # vLLM's image has ENTRYPOINT ["vllm", "serve"]; Kubernetes appends args: they must start with the model.
    for container in _named(resource, "vllm"):
        assert "vllm" in container["image"] and "memwatch" in container["image"]
        assert "command" not in container
        assert container["args"][0] not in ("vllm", "serve"), container["args"]
        assert container["args"][:3] == ["Qwen/Qwen2.5-0.5B-Instruct", "--gpu-memory-utilization", "0.85"]


@pytest.mark.parametrize(("name", "resource"), RESOURCES, ids=IDS)
def test_engines_get_the_downward_api_names_memwatch_reads(name: str, resource: dict) -> None:
    for container in _named(resource, "vllm"):
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
    (container,) = _named(resource, "memwatch")
    capabilities = container["securityContext"]["capabilities"]
    assert capabilities.get("drop") == ["ALL"] and not capabilities.get("add"), capabilities
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    group = int(_option(container["args"], "--runtime-group"))
    assert group in _pod_spec(resource)["securityContext"]["supplementalGroups"]


def test_engine_pods_for_the_agent_carry_its_group() -> None:
    (agent,) = _workloads(SETS["deploy/daemonset/memwatch-agent.yaml"])
    (memwatch,) = _named(agent, "memwatch")
    group = int(_option(memwatch["args"], "--runtime-group"))
    env = {e["name"]: e.get("value", "") for e in memwatch.get("env", [])}
    trusted = {0, *(int(a.split("=")[1]) for a in memwatch["args"] if a.startswith("--trust-uid=")),
               *(int(u) for u in env.get("MEMWATCH_TRUST_UIDS", "").split(",") if u)}
    (engine,) = _workloads(SETS["deploy/daemonset/vllm-pod.yaml"])
    spec = _pod_spec(engine)
    assert group in spec["securityContext"]["supplementalGroups"]
    assert spec["securityContext"].get("runAsUser", 0) in trusted


@pytest.mark.parametrize("name", list(SETS))
def test_storage_holds_the_bound_the_manifest_states(name: str) -> None:
    # An emptyDir past its sizeLimit gets the pod evicted, engine included: the database's bound under the
    # retention passed to memwatch is stated in the manifest, and the limit holds it.
    text = SETS[name]
    for workload in _workloads(text):
        for container in _named(workload, "memwatch"):
            stated = re.search(r"^# - Database bound: (\S+) under (.*)$", text, re.M)
            assert stated, f"{name}: no database bound stated"
            bound = _bytes(stated.group(1))
            for option in ("--keep-full", "--keep-evidence", "--keep-rollups", "--max-db-size"):
                value = _option(container["args"], option)
                assert (value is None) == (f"{option}=" not in stated.group(2)), (option, stated.group(2))
            if (size := _option(container["args"], "--max-db-size")) is not None:
                from memwatch.units import parse_bytes

                assert 0 < parse_bytes(size) <= bound, (size, bound)  # the cap is what makes it a bound
            else:
                assert _option(container["args"], "--keep-rollups") not in (None, "forever"), name
            mounts = {m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/var/lib/memwatch"}
            for volume in _pod_spec(workload)["volumes"]:
                if volume["name"] in mounts and "emptyDir" in volume:
                    assert _bytes(volume["emptyDir"]["sizeLimit"]) >= bound, name


@pytest.mark.parametrize("name", list(SETS))
def test_pods_mount_no_service_account_token(name: str) -> None:
    for doc in documents(SETS[name]):
        if doc["kind"] == "ServiceAccount":
            assert doc["automountServiceAccountToken"] is False
        if doc["kind"] in WORKLOADS:
            assert _pod_spec(doc)["automountServiceAccountToken"] is False, name


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
    for workload in _workloads(text):
        ports = {p["name"]: p["containerPort"] for c in _named(workload, "memwatch") for p in c["ports"]}
        if not ports:
            continue  # an engine pod for the agent: memwatch listens elsewhere
        labels = _pod_labels(workload)
        (policy,) = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        rules = {port["port"]: rule for rule in policy["spec"]["ingress"] for port in rule["ports"]}
        assert ports["health"] not in rules and "health" not in rules  # the kubelet's probes come from the node
        if "metrics" in ports:
            assert rules[ports["metrics"]]["from"][0]["namespaceSelector"]["matchLabels"]
        for engine in _named(workload, "vllm"):
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
            (workload,) = [w for w in _workloads(SETS[name])
                           if service["spec"]["selector"].items() <= _pod_labels(w).items()]
            target = {p["targetPort"] for p in service["spec"]["ports"] if p["name"] == "metrics"}
            assert target <= {p["containerPort"] for c in _named(workload, "memwatch") for p in c["ports"]}
        else:
            assert monitor["kind"] == "PodMonitor"
            (workload,) = [w for w in _workloads(SETS[name]) if selector.items() <= _pod_labels(w).items()]
            names = {p["name"] for c in _named(workload, "memwatch") for p in c["ports"]}
            endpoints = monitor["spec"]["podMetricsEndpoints"]
        assert [e["port"] for e in endpoints] == ["metrics"] and "metrics" in names
        assert all(e["honorLabels"] is True for e in endpoints)


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


def _level(resource: dict, name: str) -> str:
    """The Pod Security level the chart says this workload's namespace needs (what namespace.create labels)."""
    if resource["kind"] == "DaemonSet" or any("hostPath" in v for v in _pod_spec(resource).get("volumes", [])):
        return "privileged"
    engine_uid = next((c.get("securityContext", {}).get("runAsUser") for c in _named(resource, "vllm")), None)
    return "restricted" if engine_uid else "baseline"


@pytest.mark.parametrize(("name", "resource"), RESOURCES, ids=IDS)
def test_pod_security_restricted_for_every_container_the_chart_owns(name: str, resource: dict) -> None:
    # The Pod Security Standards' fields, checked as admission would: memwatch's own container meets "restricted"
    # in the sidecar shape; so does vLLM's wherever it runs as a non-root uid. The exceptions, each named: an
    # engine left as its image's root (runAsNonRoot alone, so "baseline"), the engine pod's hostPath rings
    # directory (its one exception), and the agent (root on two hostPaths: "privileged").
    if resource["kind"] not in WORKLOADS:
        return
    spec = _pod_spec(resource)
    level = _level(resource, name)
    found = violations(spec, "restricted")
    if resource["kind"] == "DaemonSet":
        assert sorted(found) == ["memwatch.securityContext.runAsNonRoot", "memwatch.securityContext.runAsUser 0",
                                 "volume db: hostPath", "volume runtime: hostPath"], found
        (memwatch,) = _named(resource, "memwatch")
        assert "hostPath" not in str([v for v in spec["volumes"] if v["name"] not in ("db", "runtime")])
        assert violations({"containers": [memwatch]}, "baseline") == []
        return
    if resource["kind"] == "Pod":  # mode: engine
        assert found == ["volume memwatch-rings: hostPath"], found
        # The uid is the pod's alone: a container-level one would override a pod run as another uid.
        (vllm,) = _named(resource, "vllm")
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
        for workload in _workloads("---\n".join(yaml.safe_dump(d) for d in docs)):
            assert violations(_pod_spec(workload), level) == [], (args, level)


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
    for container in _named(resource, "memwatch"):
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
        (volume,) = [v for v in _pod_spec(resource)["volumes"] if v["name"] == tmp["name"]]
        assert "emptyDir" in volume, volume
        if tmp["name"] == "memwatch-tmp":  # the chart's own (a set may mount one of its own instead)
            assert _bytes(volume["emptyDir"]["sizeLimit"]) == 64 * 2**20


def test_extra_volumes_reach_the_containers_and_replace_the_charts_own_mount() -> None:
    (deployment,) = _workloads(SETS["chart:sidecar-bundles-volumes"])
    spec = _pod_spec(deployment)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["db"] == {"name": "db", "persistentVolumeClaim": {"claimName": "memwatch-db"}}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert "memwatch-db" not in volumes  # the claim holds the database: no emptyDir left unused
    (memwatch,) = _named(deployment, "memwatch")
    assert {m["mountPath"]: m["name"] for m in memwatch["volumeMounts"]} == {
        "/run/memwatch": "memwatch-run", "/var/lib/memwatch": "db", "/tmp": "memwatch-tmp"}
    (vllm,) = _named(deployment, "vllm")
    assert {m["mountPath"]: m["name"] for m in vllm["volumeMounts"]} == {"/run/memwatch": "memwatch-run",
                                                                           "/dev/shm": "dshm"}
    (agent,) = _workloads(SETS["chart:agent-bundles-otlp-volumes"])
    (memwatch,) = _named(agent, "memwatch")
    assert {m["mountPath"]: m["name"] for m in memwatch["volumeMounts"]} == {
        "/run/memwatch": "runtime", "/var/lib/memwatch": "db", "/tmp": "scratch"}
    assert sorted(v["name"] for v in _pod_spec(agent)["volumes"]) == ["db", "runtime", "scratch"]
    engine = _workloads(template("e", ["--set", "mode=engine", "--set-json",
                                       'extraVolumes=[{"name":"dshm","emptyDir":{"medium":"Memory"}}]', "--set-json",
                                       'engine.extraVolumeMounts=[{"name":"dshm","mountPath":"/dev/shm"}]']))[0]
    assert [m["mountPath"] for m in _named(engine, "vllm")[0]["volumeMounts"]] == ["/run/memwatch/rings", "/dev/shm"]
    assert [v["name"] for v in _pod_spec(engine)["volumes"]] == ["memwatch-rings", "dshm"]


@pytest.mark.parametrize("name", list(SETS))
def test_the_agent_is_node_critical_and_the_engines_are_not(name: str) -> None:
    # A node agent is scheduled before, and evicted after, ordinary pods (dcgm-exporter's chart does the same);
    # priorityClassName stays the operator's for engine pods ("" by default; one set names "high").
    for workload in _workloads(SETS[name]):
        expected = "system-node-critical" if workload["kind"] == "DaemonSet" else (
            "high" if name == "chart:sidecar-monitors-otlp" else None)
        assert _pod_spec(workload).get("priorityClassName") == expected, name


@pytest.mark.parametrize("name", list(SETS))
def test_egress_is_bounded_to_dns_and_the_store_when_bundles_are_shipped(name: str) -> None:
    docs = documents(SETS[name])
    egress = [d for d in docs if d["kind"] == "NetworkPolicy" and "Egress" in d["spec"]["policyTypes"]]
    for workload in _workloads(SETS[name]):
        for container in _named(workload, "memwatch"):
            to = {e["name"]: e.get("value") for e in container.get("env", [])}.get("MEMWATCH_BUNDLE_TO")
            labels = _pod_labels(workload).items()
            mine = [p for p in egress if p["spec"]["podSelector"]["matchLabels"].items() <= labels]
            policy_on = "networkPolicy.enabled=false" not in " ".join(
                VALUE_SETS.get(name.removeprefix("chart:"), ("", []))[1])
            assert len(mine) == (1 if to and policy_on else 0), name
            for policy in mine:
                ports = [p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]]
                otlp = _option(container["args"], "--otlp")
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
