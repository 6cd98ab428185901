"""GPU check of the engine adapters: a real model with a paged KV cache, nano-vllm's startup, a real OOM.

Run on a machine with an NVIDIA GPU, with memwatch installed in the same Python (about a minute;
at most 5):

    python scripts/gpu_check_engine.py

What it does, in a scratch directory:

1. starts a sidecar (``python -m memwatch serve``) on a private runtime directory and database;
2. runs an engine process instrumented the zero-code way (``MEMWATCH=1``; ``install()`` is called
   too, in case the ``.pth`` is not installed in this environment). The engine is a small real
   PyTorch decoder with a paged KV cache, packaged under nano-vllm's module paths
   (``nanovllm.engine.model_runner.ModelRunner``) so that the real nano-vllm adapter instruments it:
   model construction and ``load_model``, ``warmup_model`` (empty cache, reset peak, the largest
   prefill), ``allocate_kv_cache`` with nano-vllm's exact formula, then prefill and decode steps that
   write and read KV pages through block tables. It prints its own ``torch.cuda.mem_get_info`` and
   NVML per-process usage after the last step, then asks for more memory than is free: a real
   ``torch.OutOfMemoryError`` ends it;
3. checks the database: the ``kv_allocated`` event reproduces the block count with nano-vllm's
   formula; the last serving sample matches ``mem_get_info`` and NVML's usage of the engine process;
   the ledger's terms add up; the ``oom`` event and final samples arrived; the run ended as ``oom``.

Exit status: 0 all checks passed, 1 a check failed, 4 no CUDA GPU here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

MiB = 1 << 20
TOLERANCE = 16 * MiB
"""Readings taken microseconds apart by two APIs may differ by a little driver bookkeeping."""

from gpu_engine_program import ENGINE_FILES, ENGINE_MAIN  # noqa: E402  (beside this script)


def _no_gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    try:
        import memwatch_engine  # noqa: F401
    except ImportError:
        return "memwatch is not installed in this Python (run: pip install -e .)"
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
        return f"CUDA is not available (PyTorch {torch.__version__}, {build})"
    return None


def _write_engine(directory: Path) -> Path:
    for name, text in ENGINE_FILES.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    main = directory / "engine_main.py"
    main.write_text(textwrap.dedent(ENGINE_MAIN))
    return main


class Checks:
    def __init__(self) -> None:
        self.failed = 0

    def check(self, ok: bool, what: str, detail: str) -> None:
        self.failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {what}: {detail}", flush=True)


def _query(db: Path, sql: str, params: tuple = ()) -> list[tuple]:
    import sqlite3

    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def _wait(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except Exception:
            pass
        time.sleep(0.1)
    return False


def main() -> int:
    reason = _no_gpu_reason()
    if reason:
        print(f"gpu_check_engine: {reason}; run this check on a machine with an NVIDIA GPU", file=sys.stderr)
        return 4
    checks = Checks()
    with tempfile.TemporaryDirectory(prefix="memwatch-gpu-check-") as scratch:
        scratch_path = Path(scratch)
        runtime, db = scratch_path / "run", scratch_path / "memwatch.db"
        runtime.mkdir(mode=0o700)
        env = {**os.environ, "MEMWATCH_RUNTIME_DIR": str(runtime), "MEMWATCH_DB": str(db), "MEMWATCH_SPAWN": "0",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(scratch_path / "engine"),
                                                           os.environ.get("PYTHONPATH", "")]))}
        main_script = _write_engine(scratch_path / "engine")
        sidecar = subprocess.Popen([sys.executable, "-m", "memwatch", "serve"], env={**env, "MEMWATCH": "0"},
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            time.sleep(1.0)
            started = time.monotonic()
            engine = subprocess.run([sys.executable, str(main_script)], env={**env, "MEMWATCH": "1"},
                                    capture_output=True, text=True, timeout=240)
            print(f"engine exited with status {engine.returncode} after {time.monotonic() - started:.1f}s")
            reports = [line[7:] for line in engine.stdout.splitlines() if line.startswith("REPORT ")]
            detail = (reports or [engine.stderr[-2000:]])[-1][:300]
            checks.check(bool(reports), "engine reached the OOM request", detail)
            checks.check(engine.returncode != 0 and "OutOfMemoryError" in engine.stderr, "engine died of a real OOM",
                         engine.stderr.strip().splitlines()[-1] if engine.stderr.strip() else "no stderr")
            if not reports:
                return 1
            report = json.loads(reports[-1])
            checks.check(_wait(lambda: _query(db, "SELECT status FROM runs") == [("oom",)], 30),
                         "run stored and ended as oom", str(_query(db, "SELECT run_id, status FROM runs")))
            _check_database(checks, db, report)
        finally:
            sidecar.terminate()
            output, _ = sidecar.communicate(timeout=60)
            if "Traceback" in output:
                checks.check(False, "sidecar ran cleanly", output[-2000:])
    print(f"{'all checks passed' if not checks.failed else f'{checks.failed} check(s) failed'}")
    return 0 if not checks.failed else 1


def _check_database(checks: Checks, db: Path, report: dict) -> None:
    from memwatch.ledger import Ledger
    from memwatch.store import open_store
    from memwatch.store.queries import events, get_run, samples

    store = open_store(db, readonly=True)
    run = get_run(store, "latest")
    run_events = events(store, run.run_id, rank=0)
    run_samples = list(samples(store, run.run_id, rank=0))
    kinds = [event.kind for event in run_events]
    [sizing] = [event.data for event in run_events if event.kind == "kv_allocated"]
    formula = int(sizing["total_bytes"] * sizing["gpu_memory_utilization"] - sizing["used_bytes"]
                  - sizing["peak_bytes"] + sizing["current_bytes"]) // sizing["block_bytes"]
    checks.check(formula == sizing["num_blocks"], "kv_allocated reproduces nano-vllm's block count",
                 f"formula {formula}, engine {sizing['num_blocks']} blocks of {sizing['block_bytes']:,} bytes")
    checks.check(sizing["total_bytes"] == report["total_bytes"], "device total matches mem_get_info",
                 f"{sizing['total_bytes']:,} vs {report['total_bytes']:,}")
    phases = [event.data.get("phase") for event in run_events if event.kind == "phase_start"]
    checks.check(phases[:4] == ["load", "warmup", "kv_alloc", "serve"], "startup phases in nano-vllm's order",
                 str(phases))
    steps = [sample for sample in run_samples if sample.step_kind]
    checks.check(len(steps) == 33 and steps[0].step_kind == "prefill", "33 steps (1 prefill, 32 decode)",
                 f"{len(steps)} steps")
    last = steps[-1]
    used_now = report["total_bytes"] - report["free_bytes"]
    checks.check(abs(last.driver_used_bytes - used_now) <= TOLERANCE, "last sample's driver used vs mem_get_info",
                 f"{last.driver_used_bytes:,} vs {used_now:,}")
    checks.check(last.reserved_bytes == report["reserved_bytes"], "last sample's reserved vs memory_reserved()",
                 f"{last.reserved_bytes:,} vs {report['reserved_bytes']:,}")
    nvml = report.get("nvml_process_bytes")
    checks.check(nvml is not None and last.reserved_bytes <= nvml <= last.driver_used_bytes + TOLERANCE,
                 "NVML per-process usage between the allocator's reserve and the driver's used",
                 f"reserved {last.reserved_bytes:,} <= nvml {nvml if nvml is None else f'{nvml:,}'} <= used "
                 f"{last.driver_used_bytes:,} ({report.get('nvml_error', 'ok')})")
    ledger = Ledger()
    terms = None
    by_time = sorted([(e.ts_ns, 0, e) for e in run_events] + [(s.ts_ns, 1, s) for s in run_samples],
                     key=lambda item: (item[0], item[1]))
    for _, is_sample, record in by_time:
        if is_sample:
            if record is last:
                terms = ledger.on_sample(record)
            else:
                ledger.on_sample(record)
        else:
            ledger.on_event(record)
    expected_kv = sizing["num_blocks"] * sizing["block_bytes"]
    checks.check(terms is not None and terms.kv_bytes == expected_kv and terms.non_torch_bytes is not None
                 and terms.non_torch_bytes == last.driver_used_bytes - last.reserved_bytes,
                 "ledger terms at the last step", f"{terms}")
    [oom] = [event.data for event in run_events if event.kind == "oom"] or [{}]
    checks.check(oom.get("requested_bytes", 0) >= report["oom_request_bytes"], "oom event with the request size",
                 json.dumps(oom)[:400])
    checks.check("largest_free_block_bytes" in oom and "segments" in oom, "oom event carries the allocator summary",
                 f"segments {oom.get('segments')}, largest free block {oom.get('largest_free_block_bytes')}")
    checks.check(kinds[-1] in ("oom", "phase_end") and run_samples[-1].ts_ns >= last.ts_ns,
                 "final samples arrived after the last step", f"last event kinds {kinds[-3:]}")


if __name__ == "__main__":
    sys.exit(main())
