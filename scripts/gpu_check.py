#!/usr/bin/env python3
"""GPU check: a real PyTorch workload through the plugin, the ring and a real sidecar.

What it verifies on a machine with an NVIDIA GPU (about a minute):

1. every stored sample satisfies ``allocated ≤ reserved ≤ driver used`` (the allocator's view nests in
   the driver's);
2. the KV block count the workload sized with nano-vllm's formula is re-derived exactly from the
   readings recorded in the ``kv_allocated`` event;
3. NVML's per-process bytes for this process are at least the allocator's reserved bytes;
4. ``memwatch attach PID --once --json`` against this CUDA process returns its ledger from the ring.

Run: .venv/bin/python scripts/gpu_check.py   (exit 0: all passed, 1: a check failed, 4: no GPU)
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

UTILIZATION = 0.25          # leave most of the card alone
BLOCK_BYTES = 2 << 20       # 2 MiB KV blocks
HIDDEN, LAYERS = 8192, 8    # ~1 GiB of bf16 weights
SERVE_STEPS = 200


def check(name: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    return ok


def workload(monitor, torch) -> tuple[int, dict]:
    """nano-vllm's startup order on a stack of linear layers, then serving steps; returns KV blocks."""
    with monitor.phase("load"):
        layers = [torch.nn.Linear(HIDDEN, HIDDEN, bias=False, device="cuda", dtype=torch.bfloat16)
                  for _ in range(LAYERS)]
        model = torch.nn.Sequential(*layers)
        torch.cuda.synchronize()
        monitor.weights_loaded()
    with monitor.phase("warmup"), torch.no_grad():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model(torch.randn(16384, HIDDEN, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    with monitor.phase("kv_alloc"):
        free, total = torch.cuda.mem_get_info()
        used = total - free
        stats = torch.cuda.memory_stats()
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        num_blocks = int(total * UTILIZATION - used - peak + current) // BLOCK_BYTES
        monitor.kv_allocated(num_blocks, BLOCK_BYTES, total_bytes=total, used_bytes=used, peak_bytes=peak,
                             current_bytes=current, gpu_memory_utilization=UTILIZATION, block_size=256)
        kv_cache = torch.empty(num_blocks * BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    attach_output: dict = {}
    with monitor.phase("serve"), torch.no_grad():
        for step in range(SERVE_STEPS):
            tokens = 256 if step % 10 else 8192
            model(torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16))
            torch.cuda.synchronize()
            monitor.step("prefill" if tokens > 256 else "decode", num_seqs=tokens // 256 or 1, num_tokens=tokens,
                         kv_blocks_used=step % num_blocks, kv_blocks_total=num_blocks)
            if step == SERVE_STEPS // 2:
                attach_output = attach_once()
    del kv_cache
    return num_blocks, attach_output


def nvml_process_bytes(nvml) -> tuple[int, str]:
    """NVML's bytes for this process. In a container NVML speaks host pids: when our pid is not listed
    and exactly one process is, that one is this process (nothing else runs on a lent GPU)."""
    own = nvml.process_used_bytes(os.getpid())
    if own >= 0:
        return own, "NVML ok"
    from memwatch.nvml import Nvml

    with Nvml() as session:
        listed = session.device(torch_device_index()).processes or []
    if len(listed) == 1 and listed[0].used_bytes is not None:
        return listed[0].used_bytes, f"NVML lists host pid {listed[0].pid}, taken as this process"
    return own, f"pid {os.getpid()} not among NVML's {[p.pid for p in listed]}"


def torch_device_index() -> int:
    import torch

    return torch.cuda.current_device()


def attach_once() -> dict:
    result = subprocess.run([sys.executable, "-m", "memwatch", "attach", str(os.getpid()), "--once", "--json"],
                            capture_output=True, text=True, timeout=60)
    print(f"      attach --once --json exit {result.returncode}: {result.stdout.strip()[:2000]}"
          f"{result.stderr.strip()}", flush=True)
    return json.loads(result.stdout) if result.returncode == 0 else {}


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device visible to PyTorch {torch.__version__}; run this on a GPU machine")
        return 4
    from memwatch_engine import Monitor
    from memwatch_engine.probes.nvml import NvmlProbe

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  CUDA {torch.version.cuda}")
    tmp = Path(tempfile.mkdtemp(prefix="memwatch-gpu-check-"))
    runtime, db = tmp / "run", tmp / "memwatch.db"
    runtime.mkdir(mode=0o700)
    os.environ.update(MEMWATCH_RUNTIME_DIR=str(runtime), MEMWATCH_DB=str(db), MEMWATCH_SPAWN="0")
    sidecar = subprocess.Popen([sys.executable, "-m", "memwatch", "serve"], stderr=subprocess.PIPE, text=True)
    time.sleep(2)
    monitor = Monitor(engine="gpu_check", model=f"{LAYERS}x Linear({HIDDEN})")
    probe_reason = monitor.probe.unavailable_reason()
    num_blocks, attached = workload(monitor, torch)
    nvml = NvmlProbe(torch.cuda.current_device())
    process_bytes, nvml_note = nvml_process_bytes(nvml)
    reserved_now = torch.cuda.memory_reserved()
    run_id = monitor.run_id
    monitor.close()
    sidecar.send_signal(signal.SIGTERM)
    _, log = sidecar.communicate(timeout=60)
    print(f"      sidecar: {log.strip().splitlines()[-1] if log.strip() else 'no output'}")

    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = conn.execute("SELECT allocated_bytes, reserved_bytes, driver_used_bytes FROM samples WHERE run_id = ?",
                        (run_id,)).fetchall()
    bad = [r for r in rows if None in r or not r[0] <= r[1] <= r[2]]
    sizing = json.loads(conn.execute("SELECT data FROM events WHERE run_id = ? AND kind = 'kv_allocated'",
                                     (run_id,)).fetchone()[0])
    s = sizing
    derived = int(s["total_bytes"] * s["gpu_memory_utilization"] - s["used_bytes"] - s["peak_bytes"]
                  + s["current_bytes"]) // s["block_bytes"]
    status = conn.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    ok = [
        check("probe", probe_reason is None, probe_reason or "CUDA probe reading the allocator and the driver"),
        check("samples stored", len(rows) >= SERVE_STEPS, f"{len(rows)} samples of run {run_id}, status {status}"),
        check("allocated <= reserved <= driver used", rows and not bad,
              f"{len(rows) - len(bad)}/{len(rows)} samples; first violation: {bad[:1]}"),
        check("KV formula from recorded readings", derived == s["num_blocks"] == num_blocks,
              f"derived {derived}, recorded {s['num_blocks']}, engine {num_blocks}"),
        check("NVML per-process >= reserved", process_bytes >= reserved_now,
              f"NVML {process_bytes:,} bytes for pid {os.getpid()}, reserved {reserved_now:,} "
              f"({nvml.unavailable_reason() or nvml_note})"),
        check("attach --once --json", attached.get("source") == "ring" and bool(attached.get("ranks")),
              f"source {attached.get('source')}, ranks {len(attached.get('ranks', []))}"),
    ]
    print("ALL PASSED" if all(ok) else "SOME CHECKS FAILED")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
