"""Which container and pod a run was: read by the engine, stored per run, exported, shown."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.export.prometheus import render
from memwatch.export.state import ExportState, run_attributes
from memwatch.identity import COLUMNS as PLACE_COLUMNS
from memwatch.identity import place_from_meta, stored_places
from memwatch.ring_records import typed_records
from memwatch.store import open_store
from memwatch_engine import Monitor
from memwatch_engine.identity import MAX_NAME, container_id, kubernetes
from memwatch_engine.ring_reader import RingReader

from probes import ScriptedProbe
from stored_runs import store_rings

ID = "3f2a9c81d0e4" + "a" * 52  # 64 hex digits
assert len(ID) == 64


@pytest.mark.parametrize("cgroup", [
    f"12:memory:/docker/{ID}\n11:cpu:/docker/{ID}\n",                                           # docker, cgroup v1
    f"0::/system.slice/docker-{ID}.scope\n",                                                   # docker, cgroup v2
    f"4:memory:/kubepods/burstable/pod1b2c3d4e-0000-1111-2222-333344445555/{ID}\n",             # containerd v1
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c_3d4e.slice/cri-containerd-{ID}.scope\n",
    f"0::/kubepods.slice/kubepods-pod9.slice/crio-conmon-{'b' * 64}.scope\n0::/kubepods.slice/crio-{ID}.scope\n",
    f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope/container\n",  # podman
])
def test_the_container_id_is_found_in_every_runtimes_cgroup_paths(cgroup: str) -> None:
    assert container_id(cgroup, "") == ID


def test_a_private_cgroup_namespace_falls_back_to_dockers_mounts() -> None:
    mountinfo = (f"612 590 254:1 /var/lib/docker/containers/{ID}/hostname /etc/hostname rw,relatime - ext4 "
                 "/dev/vda1 rw\n")
    assert container_id("0::/\n", mountinfo) == ID


@pytest.mark.parametrize("cgroup", ["0::/\n", "0::/user.slice/session-3.scope\n", f"0::/docker/{ID[:63]}g\n",
                                    "\x00" * 5000 + "\n:::::\n", "0::/" + "a" * 65 + "\n"])
def test_a_host_or_hostile_cgroup_gives_no_id(cgroup: str) -> None:
    assert container_id(cgroup, "") is None


def test_the_downward_api_names_are_read_and_overridden_and_bad_ones_left_out() -> None:
    env = {"POD_NAME": "vllm-0", "POD_NAMESPACE": "prod", "NODE_NAME": "gpu-7", "CONTAINER_NAME": "engine",
           "MEMWATCH_K8S_CONTAINER": "vllm", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert kubernetes(env, "ignored") == {"k8s_pod": "vllm-0", "k8s_namespace": "prod", "k8s_node": "gpu-7",
                                          "k8s_container": "vllm"}
    hostile = {"POD_NAME": "a\x1b[2Jb", "POD_NAMESPACE": "x" * (MAX_NAME + 1), "NODE_NAME": "ok.node-1",
               "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert kubernetes(hostile, "") == {"k8s_node": "ok.node-1"}
    # In a pod with no POD_NAME given, the hostname is the pod's name.
    assert kubernetes({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "vllm-7c9d") == {"k8s_pod": "vllm-7c9d"}
    assert kubernetes({}, "laptop") == {}
    # Outside a pod the generic names say nothing (many tools set CONTAINER_NAME); the overrides still do.
    assert kubernetes({"CONTAINER_NAME": "ci-job", "MEMWATCH_K8S_POD": "p1"}, "h") == {"k8s_pod": "p1"}


def test_the_sidecar_takes_only_plain_names_from_a_ring() -> None:
    meta = {"where": {"k8s_pod": "p", "k8s_namespace": ["x"], "container_id": "bad id", "other": "y"}}
    assert place_from_meta(meta) == {"k8s_pod": "p"}
    assert place_from_meta({"where": "pod"}) == {} == place_from_meta({})


POD = {"POD_NAME": "vllm-0", "POD_NAMESPACE": "prod", "NODE_NAME": "gpu-7", "CONTAINER_NAME": "engine",
       "KUBERNETES_SERVICE_HOST": "10.0.0.1"}


def _pod_run(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Monitor, RingReader]:
    for name, value in POD.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MEMWATCH_WHERE")
    monitor = Monitor(engine="script", model="tiny", probe=ScriptedProbe(), runtime_dir=runtime_dir, run_id="podrun")
    with monitor.phase("serve"):
        monitor.step("decode", num_seqs=1, num_tokens=1)
    return monitor, RingReader(monitor.ring_path)


def test_a_run_in_a_pod_is_stored_shown_by_runs_and_explain(
        runtime_dir: Path, db_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monitor, reader = _pod_run(runtime_dir, monkeypatch)
    reader.close()
    monitor.close()
    store_rings(runtime_dir, db_path)
    row = sqlite3.connect(db_path).execute(
        "SELECT k8s_namespace, k8s_pod, k8s_container, k8s_node FROM runs WHERE run_id = 'podrun'").fetchone()
    assert row == ("prod", "vllm-0", "engine", "gpu-7")
    runner = CliRunner()
    listed = runner.invoke(main, ["runs", "--db", str(db_path), "--json"])
    assert listed.exit_code == 0, listed.output
    where = json.loads(listed.output)[0]["where"]
    assert {k: where[k] for k in ("k8s_namespace", "k8s_pod", "k8s_container", "k8s_node")} == {
        "k8s_namespace": "prod", "k8s_pod": "vllm-0", "k8s_container": "engine", "k8s_node": "gpu-7"}
    text = runner.invoke(main, ["runs", "--db", str(db_path)]).output
    assert "in namespace prod, pod vllm-0, container engine, node gpu-7" in text
    explained = runner.invoke(main, ["explain", "podrun", "--db", str(db_path)])
    assert explained.exit_code == 0, explained.output
    assert "It ran in namespace prod, pod vllm-0, container engine, node gpu-7" in explained.output


def test_exported_series_carry_the_pod_as_otel_attributes_and_dcgm_style_labels(
        runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monitor, reader = _pod_run(runtime_dir, monkeypatch)
    attributes = run_attributes(reader.header)
    assert {k: attributes[k] for k in ("k8s.pod.name", "k8s.namespace.name", "k8s.container.name",
                                       "k8s.node.name")} == {"k8s.pod.name": "vllm-0", "k8s.namespace.name": "prod",
                                                             "k8s.container.name": "engine", "k8s.node.name": "gpu-7"}
    state = ExportState()
    drained = reader.drain(0, 100)
    state(reader.header, typed_records("podrun", 0, drained, reader.phase_names))
    text = render(state)
    line = next(line for line in text.splitlines() if line.startswith("memwatch_"))
    assert 'namespace="prod"' in line and 'pod="vllm-0"' in line and 'container="engine"' in line
    assert "k8s_pod_name" not in text
    reader.close()
    monitor.close()


def test_an_older_database_gains_the_place_columns(db_path: Path) -> None:
    open_store(db_path).conn.close()
    conn = sqlite3.connect(db_path)  # back to the schema before places: version 7
    for trigger in ("incidents_ended", "incidents_flagged", "incidents_forgotten"):  # version 9's
        conn.execute(f"DROP TRIGGER {trigger}")
    conn.execute("DROP TABLE incidents")
    for column in PLACE_COLUMNS:
        conn.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    conn.execute("INSERT INTO runs (run_id, status) VALUES ('old', 'ok')")
    conn.execute("PRAGMA user_version = 7")
    conn.commit()
    conn.close()
    assert stored_places(open_store(db_path, readonly=True)) == {}  # read-only: not migrated, nothing shown
    db = open_store(db_path)
    assert {row[1] for row in db.execute("PRAGMA table_info(runs)")} >= set(PLACE_COLUMNS)
    assert db.execute("PRAGMA user_version").fetchone()[0] >= 8
    assert stored_places(db) == {}  # the old run has no place
