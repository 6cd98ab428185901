"""An out-of-memory in a real process: the observer's ``oom`` event and last samples reach the database.

The process is a plain PyTorch loop (``Monitor`` + ``capture_oom``) on ``fake_cuda``'s device, whose
allocator fails the way PyTorch's does: it calls the observers registered through
``torch._C._cuda_attach_out_of_memory_observer`` with ``(device, alloc_size, device_total,
device_free)`` and raises ``torch.OutOfMemoryError``. Nothing catches it: the process dies with a
traceback and a non-zero status, and the sidecar still stores what the observer wrote.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

from mirrors.zero_code import MIRRORS

from memwatch_engine import Monitor
from memwatch_engine.adapters.oom import OomObserver, capture_oom
from memwatch_engine.probes.base import Probe

from processes import SidecarProcess, memwatch_env, query, wait_for

MiB = 1 << 20
LOOP = """
import fake_cuda
from memwatch_engine import Monitor
from memwatch_engine.adapters.oom import capture_oom
from memwatch_engine.probes.cuda import CudaProbe

monitor = Monitor(engine="torch", model="loop", probe=CudaProbe(0))
assert capture_oom(monitor)
held = []
with monitor.phase("serve"):
    for step in range(10):
        with monitor.stepping("prefill", num_tokens=1024):
            held.append(fake_cuda.empty(20 * 2**20 + 1))
"""


def _run_loop(runtime_dir: Path, db_path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = memwatch_env(runtime_dir, db_path, PYTHONPATH=str(MIRRORS), FAKE_CUDA_TOTAL_BYTES=str(160 * MiB),
                       FAKE_CUDA_CONTEXT_BYTES=str(64 * MiB), **extra)
    return subprocess.run([sys.executable, "-c", LOOP], env=env, capture_output=True, text=True, timeout=60)


def test_oom_event_and_last_samples_survive_the_process(runtime_dir: Path, db_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        sidecar.pause()  # it reads the ring only once the process is dead: a post-mortem drain
        done = _run_loop(runtime_dir, db_path, MEMWATCH_OOM_SNAPSHOT="1")
        sidecar.resume()
        assert done.returncode == 1 and "torch.OutOfMemoryError: CUDA out of memory" in done.stderr
        wait_for(lambda: query(db_path, "SELECT status FROM runs") == [("oom",)], what="the run to end as oom")
        # The exit hook closes the ring, so the run can end before the snapshot's import (in its own thread) has.
        imported = wait_for(lambda: query(db_path, "SELECT step, data FROM events WHERE kind = 'snapshot_oom'"),
                            what="the sidecar to import the snapshot")

    # Each request of 20 MiB + 1 byte is rounded to 512 bytes (20,972,032) in a segment rounded to 2 MiB
    # (22 MiB = 23,068,672): 64 MiB context + 4 segments = 152 MiB of 160 used, 8 MiB free, so the fifth
    # request's 22 MiB segment fails after one retry that had no cache to release.
    size, segment = 20 * MiB + 512, 22 * MiB
    [(data,)] = query(db_path, "SELECT data FROM events WHERE kind = 'oom'")
    event = json.loads(data)
    snapshot = Path(event.pop("snapshot_path"))
    assert event == {
        "requested_bytes": segment, "allocated_bytes": 4 * size, "peak_bytes": 4 * size,
        "reserved_bytes": 4 * segment, "driver_used_bytes": 64 * MiB + 4 * segment, "driver_free_bytes": 8 * MiB,
        "device": 0, "device_limit_bytes": 160 * MiB, "device_free_bytes": 8 * MiB,
        "segments": 4, "inactive_split_bytes": 4 * (segment - size), "alloc_retries": 1, "num_ooms": 1,
        "largest_free_block_bytes": segment - size,
    }
    assert snapshot.parent == db_path.parent and snapshot.name.startswith("oom-") and snapshot.suffix == ".pickle"
    assert len(pickle.loads(snapshot.read_bytes())["segments"]) == 4

    steps = query(db_path, "SELECT step, allocated_bytes FROM samples WHERE step_kind = 'prefill' ORDER BY step")
    assert steps == [(n, n * size) for n in (1, 2, 3, 4)]
    last = query(db_path, "SELECT step, allocated_bytes, driver_free_bytes FROM sample_rows"
                          " ORDER BY ts_ns DESC, seq DESC LIMIT 1")
    assert last == [(4, 4 * size, 8 * MiB)]
    assert query(db_path, "SELECT kind FROM flags WHERE kind = 'oom'") == [("oom",)]

    # The sidecar imported the snapshot the OOM wrote: the four live requests with the loop's frame, the
    # failed 22 MiB segment with the 8 MiB CUDA still had, at the step of the oom event.
    [(step, data)] = imported
    oom = json.loads(data)
    assert (step, oom["requested_bytes"], oom["device_free_bytes"]) == (4, segment, 8 * MiB)
    rows = query(db_path, "SELECT data FROM events WHERE kind = 'snapshot_allocation'")
    allocations = [json.loads(data) for (data,) in rows]
    assert [a["size_bytes"] for a in allocations] == [size] * 4
    line = LOOP.splitlines().index("            held.append(fake_cuda.empty(20 * 2**20 + 1))") + 1
    assert all(("<string>", line) in [(f["filename"], f["line"]) for f in a["frames"]] for a in allocations)


def test_without_snapshot_switch_no_file_is_written(runtime_dir: Path, db_path: Path) -> None:
    done = _run_loop(runtime_dir, db_path)
    assert done.returncode == 1
    assert not list(db_path.parent.glob("oom-*.pickle"))


def test_observer_never_raises_into_the_allocator(runtime_dir: Path, caplog: object) -> None:
    class BrokenProbe(Probe):
        def allocator_summary(self) -> dict[str, int]:
            raise RuntimeError("allocator state unreadable")

    monitor = Monitor(probe=BrokenProbe(), runtime_dir=runtime_dir, spawn_sidecar=False)
    observer = OomObserver(torch=None)
    observer.monitor = monitor
    observer(0, 2 * MiB, 80 * MiB, 0)
    observer(0, 2 * MiB, 80 * MiB, 0)  # turned off after the first failure: no second warning
    warnings = [r.getMessage() for r in caplog.records if "out-of-memory" in r.getMessage()]  # type: ignore[attr-defined]
    assert warnings == ["memwatch: could not record an out-of-memory: RuntimeError: allocator state unreadable"]


def test_no_observer_without_a_cuda_device(runtime_dir: Path) -> None:
    monitor = Monitor(runtime_dir=runtime_dir, spawn_sidecar=False)  # real CPU-only torch: probe unavailable
    assert monitor.probe.unavailable_reason() is not None
    assert capture_oom(monitor) is False
