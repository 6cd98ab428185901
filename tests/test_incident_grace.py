"""Shipping uses what is left of the grace period, and a slow link ships a large bundle eventually.

A real sidecar whose store (moto's S3, behind a slowing proxy) is down until SIGTERM, then answers each connection
15 s late: with ``--grace-period 40`` the last upload waits for it (the old fixed 10 s never did), and the sidecar
still exits inside the period; with ``--grace-period 12`` it gives up in time and keeps the bundle for the next
start. A 7 MB bundle over a link held to 200 kB/s takes 35 s, more than a request's usual 30 s bound: its try is
given time by its size, and it ships.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from slow_store import SlowProxy
from test_incident_ship import make_bundle

from processes import SidecarProcess, wait_for
from ship_s3 import S3Server, free_port


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    server = S3Server(free_port()).start()
    bucket = f"bundles-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(Bucket=bucket)
    port = free_port()
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")  # the sidecar reaches it through the proxy
    proxies: list[SlowProxy] = []
    try:
        yield server, bucket, port, proxies
    finally:
        for proxy in proxies:
            proxy.stop()
        server.stop()


def _sidecar(tmp_path: Path, bucket: str, *args: str, size: int = 2000) -> tuple[SidecarProcess, Path]:
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    bundle = make_bundle(runtime / "bundles", run="run-late", verdict="crashed", size=size)
    (runtime / "bundles").chmod(0o700)
    return SidecarProcess(runtime, tmp_path / "memwatch.db", "--bundle-to", f"s3://{bucket}/incidents", *args), bundle


@pytest.mark.parametrize(("grace", "ships"), [(40, True), (12, False)])
def test_the_last_uploads_get_what_is_left_of_the_grace_period(tmp_path: Path, store, grace: int,  # type: ignore[no-untyped-def]
                                                               ships: bool) -> None:
    server, bucket, port, proxies = store
    sidecar, bundle = _sidecar(tmp_path, bucket, "--grace-period", str(grace))
    with sidecar:
        time.sleep(1.5)  # tried at once and after 1 s: nothing listens
        proxies.append(SlowProxy(port, server.port, delay_s=15.0).start())
        began = time.monotonic()
        out = sidecar.stop(timeout=grace + 30)
        took = time.monotonic() - began
    assert took < grace, (took, out)
    left = float(out.split("shipping what is spooled within ")[1].split(" s")[0])
    # The period less the exit's 6 s, counted from the loop's last round: at most its idle wait (1 s) before the
    # signal, and a moment more on a loaded machine.
    assert grace - 6 - 1.5 < left <= grace - 6, out
    keys = server.keys(bucket)
    if ships:
        assert keys == [f"incidents/{bundle.name}"] and took >= 15, (took, out)
        assert not bundle.exists()
    else:
        assert keys == [] and bundle.exists(), out
        assert "1 incident bundle(s) not shipped yet" in out, out


def test_a_large_bundle_over_a_slow_link_ships_eventually(tmp_path: Path, store) -> None:  # type: ignore[no-untyped-def]
    server, bucket, port, proxies = store
    proxies.append(SlowProxy(port, server.port, bytes_per_s=200_000).start())
    sidecar, bundle = _sidecar(tmp_path, bucket, size=7_000_000)
    size = bundle.stat().st_size
    began = time.monotonic()
    with sidecar:
        wait_for(lambda: server.keys(bucket), timeout=120, what="the large bundle over the slow link")
        took = time.monotonic() - began
        out = sidecar.stop()
    assert server.keys(bucket) == [f"incidents/{bundle.name}"]
    assert took > size / 200_000 * 0.9, took  # it did go at the link's pace: longer than one usual 30 s request
    assert "cannot ship bundles" not in out, out  # the first try, given its time, was enough
