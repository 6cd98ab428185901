"""Incident bundles in the deployment as shipped: the Helm chart rendered with ``bundles.to``, its agent and sidecar
shapes run in podman with every security setting as rendered (tests/podman/transforms.py changes none of them).

An engine is killed (SIGKILL: its run ends ``crashed``) and its one bundle is found where ``bundles.to`` says: the
agent's in the node's folder (``file://`` on its hostPath), the sidecar's in an S3 bucket (moto, listening on the
pod network's gateway address). A bundle is built in memwatch's state
directory, never in ``$TMPDIR``: the agent's /tmp (the chart's emptyDir) is left empty, and the sidecar runs with
its /tmp mounted read-only, so no temporary file could be made at all. Each shipped bundle is then read inside the
memwatch container itself (read-only root; the sidecar's with that read-only /tmp too), by ``memwatch runs`` and
``memwatch explain`` with the bundle as ``--db``.
"""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from helm_chart import ROOT, documents, template
from podman.fixtures import Setup, engine_spec, query, set_env
from podman.node import Node
from podman.pods import Played, wait_for
from podman.runtime import Podman, timed, timings
from podman.transforms import Doc, containers, playable, pod_spec, role

from ship_s3 import S3Server, free_port

pytestmark = pytest.mark.timeout(600)
EXAMPLES = ROOT / "deploy/helm/examples"
ENGINE_ENV = {"STANDIN_STEPS": "1000000", "STANDIN_PAUSE": "0.005", "STANDIN_WAIT": "1"}
SETTLE = 5.0
"""Seconds a bundle's shipping is given to show a second object for the same crash (a rebuild, a second upload):
the sidecar's worker and shipper take well under a second a round."""
NETWORK = "podman-default-kube-network"
"""The bridge ``podman kube play`` puts pods on; its gateway is the host as ``host.containers.internal``."""


def rendered(release: str, *args: str) -> list[Doc]:
    return documents(template(release, list(args)))


def memwatch_spec(doc: Doc) -> Doc:
    return next(c for c in containers(doc) if role(c) == "memwatch")


def read_only_tmp(doc: Doc) -> Doc:
    """memwatch's /tmp (the chart's emptyDir) mounted read-only: no temporary file can be made anywhere in it,
    as where a pod's /tmp is left off."""
    for mount in memwatch_spec(doc)["volumeMounts"]:
        if mount["mountPath"] == "/tmp":
            mount["readOnly"] = True
    return doc


def manifest_of(bundle: bytes) -> dict:
    """The bundle's ``manifest.json`` (its first member), as the shipped bytes hold it."""
    with tarfile.open(fileobj=io.BytesIO(bundle), mode="r:gz") as tar:
        first = tar.next()
        assert first is not None and first.name == "manifest.json", first
        handle = tar.extractfile(first)
        assert handle is not None
        return json.loads(handle.read())


def crash(played: Played, db: Path) -> str:
    """The engine killed with SIGKILL once it has stored 200 steps; the id of its run, once stored ``crashed``."""
    wait_for(lambda: query(db, "SELECT 1 FROM samples WHERE step_kind = 'decode' LIMIT 1 OFFSET 199"), 90,
             "200 decode samples stored", pause=0.5)
    played.podman.run("kill", "--signal", "KILL", played.one("engine"), timeout=30)
    [(run_id,)] = wait_for(lambda: query(db, "SELECT run_id FROM runs WHERE status = 'crashed'"), 30,
                           "the killed engine's run to end crashed", pause=0.2)
    return str(run_id)


def shipped_once(names: Callable[[], list[str]], run_id: str) -> str:
    """The one bundle shipped for the crash, by name: none other within ``SETTLE`` seconds after it."""
    start = time.monotonic()
    first = wait_for(names, 60, "the crashed run's bundle shipped", pause=0.2)
    timings["bundle shipped after crashed"] = round(time.monotonic() - start, 2)
    time.sleep(SETTLE)
    assert names() == first and len(first) == 1, (first, names())
    assert first[0].endswith(f"-{run_id}.tar.gz"), first
    return first[0]


def assert_bundle_of(run_id: str, bundle: bytes, db: Path, name: str) -> None:
    """The shipped bytes are the crash's bundle: its manifest names the run the database stored crashed, and the
    database's ``incidents`` row for that run names the same bundle, built once."""
    manifest = manifest_of(bundle)
    assert (manifest["run_id"], manifest["trigger"]) == (run_id, "crashed"), manifest
    assert query(db, "SELECT run_id, trigger, state, bundle FROM incidents") == [(run_id, "crashed", "built", name)]


def assert_reads_inside(played: Played, container: str, db_arg: str, run_id: str) -> None:
    """``memwatch runs`` and ``explain latest`` on the bundle, run in the memwatch container (read-only root)."""
    runs = played.podman.run("exec", container, "memwatch", "runs", "--db", db_arg, check=False, timeout=60)
    assert runs.returncode == 0, runs
    assert run_id[:12] in runs.stdout and "crashed" in runs.stdout, runs.stdout
    explained = played.podman.run("exec", container, "memwatch", "explain", "latest", "--db", db_arg, check=False,
                                  timeout=60)
    assert explained.returncode == 0, explained
    assert run_id[:12] in explained.stdout and "crashed" in explained.stdout, explained.stdout


def test_the_agent_ships_a_killed_engines_bundle_to_its_nodes_folder(built: Setup) -> None:
    agent = rendered("memwatch-agent", "-f", str(EXAMPLES / "agent.yaml"))  # bundles.to: file:///var/lib/...
    engine = rendered("vllm-qwen", "-f", str(EXAMPLES / "engine.yaml"))
    with tempfile.TemporaryDirectory(prefix="memwatch-bundles-agent-") as root:
        node = Node(built, Path(root), agent=agent, engine=engine)
        try:
            engines = node.engines({1000: "engine-killed"}, **ENGINE_ENV)
            run_id = crash(engines, node.db)
            folder = node.root / "var/lib/memwatch/incidents"
            name = shipped_once(lambda: sorted(p.name for p in folder.glob("memwatch-incident-*")), run_id)
            assert_bundle_of(run_id, (folder / name).read_bytes(), node.db, name)
            memwatch = node.agent.one("memwatch")
            assert_reads_inside(node.agent, memwatch, f"/var/lib/memwatch/incidents/{name}", run_id)
            assert_reads_inside(node.agent, memwatch, f"file:///var/lib/memwatch/incidents/{name}", run_id)
            state = node.root / "var/run/memwatch/state"
            assert sorted(p.name for p in (state / "incidents").iterdir()) == []  # no scratch left behind
            assert sorted(p.name for p in (state / "bundles").iterdir()) == []  # the spool handed it over
            tmp = node.root / "emptydir" / agent_name(agent) / "memwatch-tmp"
            assert tmp.is_dir() and list(tmp.iterdir()) == []  # the chart's /tmp: nothing was written there
        finally:
            print(node.agent.logs(node.agent.one("memwatch")))  # shown when the test fails
            node.close()


def agent_name(docs: list[Doc]) -> str:
    return next(doc["metadata"]["name"] for doc in docs if doc["kind"] == "DaemonSet")


def gateway(podman: Podman) -> str:
    """The host's address on the network kube play puts pods on (made here as kube play makes it when missing).
    An address, not ``host.containers.internal``: moto takes a dotted host name's first label for a bucket."""
    if podman.run("network", "exists", NETWORK, check=False, timeout=30).returncode != 0:
        podman.run("network", "create", NETWORK, timeout=30)
    [network] = json.loads(podman.run("network", "inspect", NETWORK, timeout=30).stdout)
    return str(network["subnets"][0]["gateway"])


def test_the_sidecar_ships_a_killed_engines_bundle_to_s3_with_no_writable_tmp(built: Setup) -> None:
    bucket, port = f"incidents-{uuid.uuid4().hex[:8]}", free_port()
    server = S3Server(port, gateway(built.podman))  # listening once the pod's bridge is up
    env = [{"name": k, "value": v} for k, v in server.env().items()]
    docs = rendered("vllm-qwen", "-f", str(EXAMPLES / "sidecar.yaml"), "--set", f"bundles.to=s3://{bucket}/prod",
                    "--set-json", f"memwatch.env={json.dumps(env)}")
    for doc in docs:
        if doc["kind"] == "Deployment":
            set_env(engine_spec(doc), **ENGINE_ENV)
            read_only_tmp(doc)
    with tempfile.TemporaryDirectory(prefix="memwatch-bundles-sidecar-") as root:
        playable_docs, _ = playable(docs, built.by_role, Path(root))
        played = Played(built.podman, playable_docs, Path(root), "bundles-sidecar")
        try:
            memwatch = played.one("memwatch")
            refused = played.podman.run("exec", memwatch, "touch", "/tmp/probe", check=False)
            assert refused.returncode != 0 and "Read-only file system" in refused.stderr, refused
            server.start()
            server.client().create_bucket(Bucket=bucket)
            deployment = next(doc for doc in playable_docs if doc["kind"] == "Deployment")
            volumes = {v["name"]: Path(v["hostPath"]["path"]) for v in pod_spec(deployment)["volumes"]}
            db = volumes["memwatch-db"] / "memwatch.db"
            with timed("sidecar crash to bundle"):
                run_id = crash(played, db)
                keys = shipped_once(lambda: [k.rsplit("/", 1)[1] for k in server.keys(bucket)], run_id)
            assert server.keys(bucket) == [f"prod/{keys}"]
            body = server.client().get_object(Bucket=bucket, Key=f"prod/{keys}")["Body"].read()
            assert_bundle_of(run_id, body, db, keys)
            assert_reads_inside(played, memwatch, f"s3://{bucket}/prod/{keys}", run_id)
            assert list(volumes["memwatch-tmp"].iterdir()) == []
        finally:
            print(played.logs(played.one("memwatch")))  # shown when the test fails
            played.down()
            server.stop()
