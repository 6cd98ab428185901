"""``memwatch serve --bundle-to`` end to end: a real sidecar, moto's S3 on loopback, a real OTLP receiver.

A bundle waiting in the spool (a sidecar before it was stopped while the store was down) is shipped by the next
sidecar once the store answers, exactly once, announced as a ``memwatch.incident`` log record and in the
termination message; a sidecar stopped while the store is down still exits within its budget and keeps the bundle.
"""

from __future__ import annotations

import os
import time
import uuid

from test_incident_ship import make_bundle

from memwatch.incident.ship import SHUTDOWN_BUDGET_S

from otlp_receiver import OtlpReceiver, attributes
from processes import SidecarProcess, wait_for
from ship_s3 import S3Server, free_port


def test_spooled_bundle_survives_a_stop_while_the_store_is_down_and_ships_once_after(tmp_path, monkeypatch):
    server = S3Server(free_port())
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    bucket = f"bundles-{uuid.uuid4().hex[:12]}"
    runtime_dir, db_path = tmp_path / "rt", tmp_path / "memwatch.db"
    runtime_dir.mkdir(mode=0o700)
    spool_dir = runtime_dir / "bundles"  # a private runtime directory is the sidecar's state directory
    spool_dir.mkdir(mode=0o700)
    bundle = make_bundle(spool_dir, run="run-oom", verdict="oom")
    termination = tmp_path / "termination-log"
    termination.write_text("")
    dest = f"s3://{bucket}/incidents"
    args = ("--bundle-to", dest, "--termination-log", str(termination))
    try:
        with SidecarProcess(runtime_dir, db_path, *args) as first:
            time.sleep(1.5)  # it tries at once and after 1 s: connection refused both times
            t0 = time.monotonic()
            out = first.stop()
            stopped_in = time.monotonic() - t0
        assert "cannot ship bundles to" in out and "nothing is lost" in out, out
        assert stopped_in < SHUTDOWN_BUDGET_S + 5, out  # the last try is refused at once; the budget is the bound
        assert "1 incident bundle(s) not shipped yet" in out, out
        assert os.listdir(spool_dir) == [bundle.name] and termination.read_text() == ""

        server.start()
        server.client().create_bucket(Bucket=bucket)
        with OtlpReceiver() as receiver, SidecarProcess(runtime_dir, db_path, *args, "--otlp",
                                                         receiver.endpoint) as second:
            wait_for(lambda: not os.listdir(spool_dir), timeout=20, what="the upload at the restart")
            incidents = wait_for(lambda: [r for r in receiver.log_records() if r.event_name == "memwatch.incident"],
                                 timeout=20, what="the memwatch.incident log record")
            out = second.stop()
        assert server.keys(bucket) == [f"incidents/{bundle.name}"]
        uri = f"{dest}/{bundle.name}"
        assert len(incidents) == 1
        assert attributes(incidents[0].attributes) == {
            "run_id": "run-oom", "memwatch.incident.uri": uri, "memwatch.incident.verdict": "oom",
            "memwatch.incident.trigger": "oom",
            "memwatch.incident.bytes": (spool_bytes := len(server.client().get_object(
                Bucket=bucket, Key=f"incidents/{bundle.name}")["Body"].read()))}
        assert spool_bytes > 2000
        assert termination.read_text() == f"memwatch incident: oom (oom) {uri}\n"
        assert f"incident bundle shipped to {uri} (oom, oom)" in out, out
    finally:
        server.stop()


def test_serve_refuses_a_bad_bundle_url_at_once(tmp_path):
    import subprocess
    import sys

    from processes import memwatch_env

    out = subprocess.run([sys.executable, "-m", "memwatch", "serve", "--bundle-to", "ftp://host/x"],
                         env=memwatch_env(tmp_path / "rt", tmp_path / "db"), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "unsupported URL scheme 'ftp'" in out.stderr, out


def test_serve_without_obstore_stops_at_start_with_one_line(tmp_path):
    import subprocess
    import sys

    from processes import memwatch_env

    code = "import sys; sys.modules['obstore'] = None; from memwatch.cli import main; main()"
    out = subprocess.run([sys.executable, "-c", code, "serve", "--bundle-to", "s3://bucket/incidents"],
                         env=memwatch_env(tmp_path / "rt", tmp_path / "db"), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 4, out
    assert out.stderr.strip() == ("error: install memwatch[bundles] (pip install 'memwatch[bundles]') to read or "
                                  "write bundles by URL"), out
