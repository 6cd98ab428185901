"""The spool is bounded: over its cap in bundles or bytes the oldest bundles go first, each told and recorded.

In process on real files for the arithmetic; then a real sidecar whose store is down, capped at one bundle, and
two engines that crash one after the other: the first run's bundle is dropped for the second's, its row says
``dropped`` and its run has a ``bundle_dropped`` event.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from incident_sidecars import PodSidecar, crash_an_engine, namespaces_or_skip
from test_incident_ship import make_bundle

from memwatch.incident.spool import Spool
from memwatch_engine.dirfd import private_dir

from processes import query, wait_for
from ship_s3 import free_port


def _bundles(folder: Path, sizes: list[int]) -> list[Path]:
    """Bundles of the given payload sizes, dated a second apart (oldest first)."""
    made = []
    for i, size in enumerate(sizes):
        path = make_bundle(folder, run=f"run{i}", size=size)
        os.utime(path, ns=(1_000_000_000 * (i + 1),) * 2)
        made.append(path)
    return made


def test_over_its_count_the_oldest_bundles_are_dropped_first(tmp_path: Path) -> None:
    state = private_dir(tmp_path / "state")
    spool = Spool(state, tmp_path / "state", cap_count=3, cap_bytes=1 << 30)
    told: list[tuple[str, int, str]] = []
    spool.on_drop = lambda name, size, why: told.append((name, size, why))
    paths = _bundles(tmp_path / "built", [1000] * 5)
    sizes = {p.name: p.stat().st_size for p in paths}
    for path in paths:
        spool.enqueue(path)
    assert spool.pending() == [p.name for p in paths[2:]]  # 5 in, a cap of 3: the two oldest went
    assert [(name, size) for name, size, _ in told] == [(p.name, sizes[p.name]) for p in paths[:2]]
    assert told[0][2] == "the spool holds 4 bundles, over its cap of 3"
    assert spool.dropped == 2
    spool.close()
    os.close(state)


def test_over_its_bytes_the_oldest_bundles_are_dropped_until_it_fits(tmp_path: Path) -> None:
    state = private_dir(tmp_path / "state")
    paths = _bundles(tmp_path / "built", [3000, 3000, 3000, 6000])
    sizes = [p.stat().st_size for p in paths]  # random payloads: gzip keeps each a little over its payload
    cap = sizes[2] + sizes[3]  # room for the last two only
    spool = Spool(state, tmp_path / "state", cap_count=100, cap_bytes=cap)
    for path in paths:
        spool.enqueue(path)
    assert spool.pending() == [paths[2].name, paths[3].name]
    assert sum(size for _, size in spool.sizes()) == cap
    # A newest bundle larger than the whole cap still stays: it is the one worth shipping.
    [big] = _bundles(tmp_path / "big", [cap + 1000])
    os.utime(big, ns=(10**10, 10**10))
    spool.enqueue(big)
    assert spool.pending() == [big.name]
    spool.close()
    os.close(state)


def test_a_sidecar_over_its_spool_cap_drops_the_oldest_bundle_and_records_it(tmp_path: Path) -> None:
    namespaces_or_skip()
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    db_path = tmp_path / "memwatch.db"
    down = "s3://bundles/incidents"  # nothing answers on the port: every bundle waits in the spool
    with PodSidecar(runtime, db_path, "--bundle-to", down, "--spool-max-bundles", "1", writable=(tmp_path,),
                    env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ALLOW_HTTP": "true",
                         "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "us-east-1",
                         "AWS_EC2_METADATA_DISABLED": "true"}) as sidecar:
        first = crash_an_engine(runtime, db_path)
        wait_for(lambda: query(db_path, "SELECT 1 FROM incidents WHERE state = 'built'"), timeout=60,
                 what="the first bundle")
        second = crash_an_engine(runtime, db_path)
        wait_for(lambda: query(db_path, "SELECT 1 FROM incidents WHERE state = 'dropped'"), timeout=60,
                 what="the first bundle dropped")
        spooled = os.listdir(runtime / "bundles")
        out = sidecar.stop()
    rows = dict(query(db_path, "SELECT run_id, state FROM incidents"))
    assert rows == {first: "dropped", second: "built"}, out
    assert len(spooled) == 1 and spooled[0].endswith(f"-{second}.tar.gz")
    [(data,)] = query(db_path, "SELECT data FROM events WHERE kind = 'bundle_dropped' AND run_id = ?", (first,))
    assert json.loads(data)["why"] == "the spool holds 2 bundles, over its cap of 1"
    assert "bundle_dropped memwatch-incident-" in out, out
