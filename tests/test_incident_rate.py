"""At most ``--bundles-per-hour`` bundles per engine uid, at a real sidecar.

One engine process of the test's uid writes 40 short runs, one after the other, each ending in ``error``: each
run's ending owes a bundle (written ahead in ``incidents``), but the uid's token bucket holds 10 (the default: a
burst of 10, then one more each 3600 / 10 = 360 s). The 40 endings come within seconds, far less than the 360 s
that would earn an 11th token, so exactly 10 bundles are built, for the 10 runs that ended first, and 30 are
dropped. Each refusal is seen: its row says ``dropped`` and why, its run has a ``bundle_dropped`` event, the log
has a line naming the uid, and ``/metrics`` counts 30 dropped.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

from incident_sidecars import bundles_in, end_runs_in_error

from processes import SidecarProcess, query, wait_for
from ship_s3 import free_port

RUNS = 40
PER_HOUR = 10
REFILL_S = 3600 / PER_HOUR
"""How long the bucket takes to earn one more token."""


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith("memwatch_bundles_")}


def test_forty_error_runs_of_one_uid_get_the_buckets_ten_bundles(tmp_path: Path) -> None:
    runtime, db_path, shipped = tmp_path / "rt", tmp_path / "memwatch.db", tmp_path / "shipped"
    runtime.mkdir(mode=0o700)
    runs = [f"err-{i:02d}" for i in range(RUNS)]
    port = free_port()
    with SidecarProcess(runtime, db_path, "--bundle-to", str(shipped), "--prometheus", str(port),
                        "--poll-interval", "0.1") as sidecar:
        end_runs_in_error(runtime, db_path, runs)
        wait_for(lambda: query(db_path, "SELECT count(*) FROM incidents WHERE state IN ('built', 'dropped')")
                 [0][0] == RUNS, timeout=120, what="every bundle owed settled")
        wait_for(lambda: len(bundles_in(shipped)) >= PER_HOUR, timeout=60, what="the bundles shipped")
        seen = wait_for(lambda: (m := _metrics(port)).get("memwatch_bundles_shipped_total") == PER_HOUR and m,
                        what="the metrics")
        out = sidecar.stop()

    decided = query(db_path, "SELECT run_id, trigger, state, note FROM incidents ORDER BY decided_ns, run_id")
    assert [(run_id, trigger) for run_id, trigger, _, _ in decided] == [(run_id, "error") for run_id in runs]
    [(first, last)] = query(db_path, "SELECT min(decided_ns), max(decided_ns) FROM incidents")
    assert (last - first) / 1e9 < REFILL_S  # no token earned back while the 40 runs ended: 10 and no more
    built = [run_id for run_id, _, state, _ in decided if state == "built"]
    assert built == runs[:PER_HOUR]  # the first ten to end, each its own run
    why = f"over the limit of {PER_HOUR} bundles an hour for uid {os.getuid()}"
    assert [(run_id, state, note) for run_id, _, state, note in decided if state != "built"] == [
        (run_id, "dropped", why) for run_id in runs[PER_HOUR:]]

    names = bundles_in(shipped)
    assert len(names) == PER_HOUR and sorted(name.rsplit("-err-", 1)[1] for name in names) == [
        f"{run_id[4:]}.tar.gz" for run_id in built]
    events = query(db_path, "SELECT run_id, data FROM events WHERE kind = 'bundle_dropped' ORDER BY run_id")
    assert [(run_id, json.loads(data)) for run_id, data in events] == [
        (run_id, {"trigger": "error", "why": why}) for run_id in runs[PER_HOUR:]]
    assert out.count(f"the error incident bundle is dropped: {why}") == RUNS - PER_HOUR, out
    assert (seen["memwatch_bundles_built_total"], seen["memwatch_bundles_dropped_total"],
            seen["memwatch_bundles_failed_total"]) == (PER_HOUR, RUNS - PER_HOUR, 0), seen
