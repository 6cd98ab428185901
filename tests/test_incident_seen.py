"""What happens to bundles is seen: ``/metrics`` counts them and the spool, ``/readyz`` names one that waits too long.

A real sidecar with ``--prometheus`` and ``--health``, its store down: a bundle left in its spool 20 minutes ago
(older than the 300 s bound) is named by ``/readyz`` (still ready: a store that is down must not fail a pod's
startup), the spool's bytes and count are that file's, each failed upload is counted; once the store answers,
the bundle is shipped and counted, and the spool is empty. The exposition passes ``promtool check metrics``.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from test_incident_ship import make_bundle

from processes import SidecarProcess, wait_for
from prometheus_server import binary
from ship_s3 import S3Server, free_port


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except urllib.error.URLError:  # not listening yet
        return 0, ""


def _series(text: str) -> dict[str, float]:
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith("memwatch_bundles_")}


def test_metrics_and_readyz_show_a_bundle_waiting_then_shipped(tmp_path: Path, monkeypatch) -> None:
    server = S3Server(free_port())
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    bucket = f"bundles-{uuid.uuid4().hex[:12]}"
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    (runtime / "bundles").mkdir(mode=0o700)
    bundle = make_bundle(runtime / "bundles", run="run-late", verdict="crashed", size=5000)
    written = time.time() - 1200
    os.utime(bundle, (written, written))
    size = bundle.stat().st_size
    metrics, health = free_port(), free_port()
    try:
        with SidecarProcess(runtime, tmp_path / "memwatch.db", "--bundle-to", f"s3://{bucket}/incidents",
                            "--prometheus", str(metrics), "--health", str(health)) as sidecar:
            _, said = wait_for(lambda: (r := _get(health, "/readyz"))[0] == 200 and r, what="/readyz")
            waited = int(said.split("has waited ")[1].split(" s")[0])
            assert said.startswith("ready; 0 rings being stored; ") and f"bundle {bundle.name} has waited " in said
            assert 1200 <= waited < 1300, said
            seen = wait_for(lambda: (s := _series(_get(metrics, "/metrics")[1])).get(
                "memwatch_bundles_failed_total", 0) >= 1 and s, what="a failed upload counted")
            assert seen["memwatch_bundles_spooled"] == 1
            assert seen["memwatch_bundles_spooled_size_bytes"] == size
            assert seen["memwatch_bundles_shipped_total"] == seen["memwatch_bundles_built_total"] == 0
            assert seen["memwatch_bundles_dropped_total"] == 0

            server.start()
            server.client().create_bucket(Bucket=bucket)
            seen = wait_for(lambda: (s := _series(_get(metrics, "/metrics")[1])).get(
                "memwatch_bundles_shipped_total") == 1 and s, timeout=30, what="the upload counted")
            assert seen["memwatch_bundles_spooled"] == seen["memwatch_bundles_spooled_size_bytes"] == 0
            assert _get(health, "/readyz")[1].strip() == "ready; 0 rings being stored"
            text = _get(metrics, "/metrics")[1]
            sidecar.stop()
        checked = subprocess.run([binary("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                                 timeout=60)
        assert checked.returncode == 0 and not (checked.stdout + checked.stderr).strip(), checked
        for name in ("built", "shipped", "failed", "dropped"):
            assert f"# TYPE memwatch_bundles_{name}_total counter" in text
    finally:
        server.stop()
