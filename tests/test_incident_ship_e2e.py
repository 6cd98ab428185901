"""Built and shipped by a real sidecar: ``memwatch serve --bundle-to s3://…`` with ``memwatch sim`` engines writing real
rings, moto's S3 on loopback and a real OTLP receiver.

The pod-shutdown path is timed whole — SIGTERM, last drain and commit, the bundle's build, its upload — against
Kubernetes' default grace period of 30 s; the shipped bundles are then listed and read back by URL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from otlp_receiver import OtlpReceiver, attributes
from processes import SidecarProcess, memwatch_env, query, wait_for
from ship_s3 import S3Server, free_port


@pytest.fixture
def s3(monkeypatch):
    server = S3Server(free_port()).start()
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    server.bucket = f"bundles-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(Bucket=server.bucket)
    yield server
    server.stop()


def _sim(runtime_dir, db_path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "memwatch", "sim", "--scenario", *args],
                            env=memwatch_env(runtime_dir, db_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _memwatch(db_path, runtime_dir, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "memwatch", *args], env=memwatch_env(runtime_dir, db_path),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_sigterm_builds_and_ships_within_the_grace_period(s3, runtime_dir, db_path, tmp_path):
    termination = tmp_path / "termination-log"
    termination.write_text("")
    dest = f"s3://{s3.bucket}/prod"
    with OtlpReceiver() as receiver:
        with SidecarProcess(runtime_dir, db_path, "--bundle-to", dest, "--termination-log", str(termination),
                            "--otlp", receiver.endpoint) as sidecar:
            engine = _sim(runtime_dir, db_path, "clean_chat", "--speed", "1")
            try:
                wait_for(lambda: query(db_path, "SELECT 1 FROM samples WHERE phase = 'serve' LIMIT 1 OFFSET 30"),
                         timeout=60, what="the engine to serve")
                started = time.monotonic()
                output = sidecar.stop(timeout=30)
                took = time.monotonic() - started
            finally:
                engine.send_signal(signal.SIGKILL)
                engine.wait(10)
        [key] = s3.keys(s3.bucket)
        # The last export happens in the sidecar's stop: the record has arrived by the time it exits.
        [record] = [r for r in receiver.log_records() if r.event_name == "memwatch.incident"]
    [(run_id,)] = query(db_path, "SELECT run_id FROM runs")
    uri = f"{dest}/{key.removeprefix('prod/')}"
    assert key.startswith("prod/memwatch-incident-") and key.endswith(f"-{run_id}.tar.gz")
    assert attributes(record.attributes)["memwatch.incident.uri"] == uri
    # A healthy run whose sidecar stopped with the pod while the engine still ran: explain's verdict running (what
    # the bundle holds is so far), built for the shutdown.
    assert attributes(record.attributes)["memwatch.incident.verdict"] == "running"
    assert attributes(record.attributes)["memwatch.incident.trigger"] == "shutdown"
    assert termination.read_text() == f"memwatch incident: running (shutdown) {uri}\n"
    assert os.listdir(runtime_dir / "bundles") == [] and os.listdir(runtime_dir / "incidents") == []
    assert took < 30, output  # Kubernetes' default terminationGracePeriodSeconds
    print(f"SIGTERM to exit, bundle built and uploaded: {took:.2f} s")

    # Read anywhere: listed under the prefix and read by URL like the database it came from.
    [listed] = [json.loads(line) for line in _memwatch(db_path, runtime_dir, "incidents", dest, "--json").splitlines()]
    assert listed["verdict"] == "running" and listed["trigger"] == "shutdown" and listed["run_id"] == run_id
    assert json.loads(_memwatch(db_path, runtime_dir, "runs", "--db", uri, "--json"))[0]["run_id"] == run_id


def test_an_out_of_memory_run_is_shipped_while_the_sidecar_runs(s3, runtime_dir, db_path):
    dest = f"s3://{s3.bucket}"
    with SidecarProcess(runtime_dir, db_path, "--bundle-to", dest) as sidecar:
        engine = _sim(runtime_dir, db_path, "long_prefill")
        assert engine.wait(120) == 0
        [key] = wait_for(lambda: s3.keys(s3.bucket), timeout=60, what="the OOM's bundle in the store")
        wait_for(lambda: not os.listdir(runtime_dir / "bundles"), timeout=10, what="the spool to empty")
        output = sidecar.stop()
    assert f"incident bundle shipped to {dest}/{key} (oom, oom)" in output, output
    assert s3.keys(s3.bucket) == [key]  # stopping ships nothing twice


def test_a_bundle_built_while_the_store_is_down_ships_after_a_restart_once(runtime_dir, db_path, monkeypatch):
    server = S3Server(free_port())  # its port, with nothing listening yet: the store is down
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    bucket = f"bundles-{uuid.uuid4().hex[:12]}"
    dest = f"s3://{bucket}/incidents"
    spool = runtime_dir / "bundles"
    try:
        with SidecarProcess(runtime_dir, db_path, "--bundle-to", dest) as first:
            engine = _sim(runtime_dir, db_path, "long_prefill")
            assert engine.wait(120) == 0
            [name] = wait_for(lambda: os.listdir(spool), timeout=60, what="the OOM's bundle in the spool")
            out = first.stop()
        assert os.listdir(spool) == [name] and "1 incident bundle(s) not shipped yet" in out, out
        server.start()
        server.client().create_bucket(Bucket=bucket)
        with SidecarProcess(runtime_dir, db_path, "--bundle-to", dest) as second:
            wait_for(lambda: not os.listdir(spool), timeout=30, what="the upload after the restart")
            out = second.stop()
        assert server.keys(bucket) == [f"incidents/{name}"], out
        assert f"incident bundle shipped to {dest}/{name} (oom, oom)" in out, out
    finally:
        server.stop()
