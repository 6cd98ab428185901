"""The image and the Kubernetes manifests: valid against Kubernetes' schemas (bundled: no cluster, no
network), and every memwatch option they pass is one ``memwatch serve`` accepts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from memwatch.cli.serve import command as serve

from processes import memwatch_env, query, wait_for

ROOT = Path(__file__).parent.parent
MANIFESTS = sorted((ROOT / "deploy").rglob("*.yaml"))
KUBERNETES = "1.30.0"
"""The oldest version the manifests are checked against: native sidecars are on by default from 1.29."""


def _resources() -> list[tuple[str, dict]]:
    found = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((f"{path.relative_to(ROOT)}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return found


def _containers(resource: dict) -> list[dict]:
    spec = resource.get("spec", {})
    spec = spec.get("template", {}).get("spec", spec)
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def test_both_shapes_and_the_engine_pod_are_there() -> None:
    names = {name.split(":")[1] for name, _ in _resources()}
    assert {"Deployment/vllm-qwen", "DaemonSet/memwatch-agent", "Pod/vllm-qwen"} <= names


@pytest.mark.parametrize("version", [KUBERNETES, kubernetes_validate.latest_version()])
@pytest.mark.parametrize(("name", "resource"), _resources(), ids=[name for name, _ in _resources()])
def test_every_manifest_is_valid_kubernetes_strictly(name: str, resource: dict, version: str) -> None:
    kubernetes_validate.validate(resource, version, strict=True)  # raises on an unknown or misspelt field


@pytest.mark.parametrize(("name", "resource"), _resources(), ids=[name for name, _ in _resources()])
def test_every_memwatch_container_passes_options_serve_accepts_and_has_probes(name: str, resource: dict) -> None:
    for container in _containers(resource):
        if not container["image"].startswith("memwatch:"):
            continue
        args = container["args"]
        assert args[0] == "serve"
        serve.make_context("serve", list(args[1:]))  # click raises on an unknown option or a bad value
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        health_port = next(a.split(":")[-1] for a in args if a.startswith("--health="))
        assert {p["name"]: p["containerPort"] for p in container["ports"]}["health"] == int(health_port)


def test_engines_get_the_downward_api_names_memwatch_reads() -> None:
    for name, resource in _resources():
        for container in _containers(resource):
            if not container["image"].startswith("vllm-memwatch:"):
                continue
            env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
            assert env["MEMWATCH"] == "1" and env["MEMWATCH_SPAWN"] == "0", name
            assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
            assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
            assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


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
