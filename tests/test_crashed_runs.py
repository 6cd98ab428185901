"""Post-mortems of runs that did not end cleanly, or never sized a KV cache: say so first, then what is known.

The engines are real processes killed with SIGKILL; their rings are stored by the real collector,
which marks a run whose writer vanished ``crashed``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from click.testing import CliRunner

from memwatch.cli import main
from memwatch.records import Sample
from memwatch.ring_records import read_ring

from processes import memwatch_env, wait_for
from stored_runs import store_rings

MiB, GiB = 1 << 20, 1 << 30
WEIGHTS = 512 * MiB        # multiples of the allocator's 2 MiB segments: allocated and reserved are exact
ACTIVATION = 64 * MiB
CONTEXT = 512 * MiB        # the virtual GPU's CUDA context

# A plain PyTorch-style loop under Monitor on a virtual GPU: weights, then steps that allocate an
# activation and free it. No KV cache is ever sized. argv: runtime dir, steps before "serving", close?
TORCH_LOOP = textwrap.dedent(f"""
    import sys, time
    from memwatch_engine import Monitor
    from memwatch.sim.gpu import VirtualGPU
    gpu = VirtualGPU(8 << 30, context_bytes={CONTEXT})
    monitor = Monitor(engine="torch", model="toy-mlp", probe=gpu, runtime_dir=sys.argv[1], spawn_sidecar=False,
                      run_id="toyloop")
    with monitor.phase("load"):
        weights = gpu.malloc({WEIGHTS})
    monitor.weights_loaded()
    with monitor.phase("serve"):
        for step in range(1_000_000):
            with monitor.stepping("prefill", num_seqs=1, num_tokens=128):
                gpu.free(gpu.malloc({ACTIVATION}))
            if step == int(sys.argv[2]):
                print("serving", flush=True)
                if sys.argv[3] == "close":
                    break
                time.sleep(30)
    monitor.close()
""")


def _killed(args: list[str], runtime_dir: Path, db_path: Path, ready: int) -> list[Sample]:
    """Start an engine process, SIGKILL it once its ring holds ``ready`` samples; the samples it wrote."""
    engine = subprocess.Popen(args, env=memwatch_env(runtime_dir, db_path), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        def written() -> list[Sample]:
            rings = list(runtime_dir.glob("*-r0.ring"))
            return [r for r in read_ring(rings[0]) if isinstance(r, Sample)] if rings else []
        wait_for(lambda: len(written()) >= ready, timeout=60, what="the engine to record samples")
    finally:
        engine.send_signal(signal.SIGKILL)
        engine.wait(10)
    return written()


def _cli(db_path: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, [*args, "--db", str(db_path)])
    return result.exit_code, result.output


def test_a_killed_simulated_engine_is_explained_as_crashed(runtime_dir: Path, db_path: Path) -> None:
    # What a user does: memwatch sim --scenario clean_chat --speed 2, then kill -9.
    written = _killed([sys.executable, "-m", "memwatch", "sim", "--scenario", "clean_chat", "--speed", "2"],
                      runtime_dir, db_path, ready=30)
    store_rings(runtime_dir, db_path)
    last = written[-1]

    code, out = _cli(db_path, "explain", "latest", "--json")
    assert code == 0, out
    explanation = json.loads(out)
    assert (explanation["outcome"], explanation["status"]) == ("crashed", "crashed")
    first = explanation["sentences"][0]
    assert first.startswith("the run crashed")
    assert f"step {last.step:,}" in first
    readings = explanation["readings"][0]
    assert (readings["last_step"], readings["last_ts_ns"]) == (last.step, last.ts_ns)
    # The last window's readings, from the samples the engine wrote: free memory at the end.
    assert readings["last"]["driver_free_bytes"] == last.driver_free_bytes
    # Said once: the rank's own account gives its last window (not a second one from the raw readings).
    windows = [sentence for sentence in explanation["sentences"] if "free memory went from" in sentence
               or sentence.startswith("rank 0's last")]
    assert len(windows) == 1 and windows[0].startswith("From step "), windows
    # Killed, not out of memory: no failing allocation to speak of.
    assert not any("failing allocation" in sentence for sentence in explanation["sentences"])

    code, out = _cli(db_path, "explain", "latest")
    assert out.splitlines()[0].endswith(": crashed")
    code, out = _cli(db_path, "check", "latest")
    assert code == 1, out
    assert out.splitlines()[1].startswith("the run crashed")
    assert out.splitlines()[-1].startswith("check failed: the run crashed;")


def test_a_killed_monitor_loop_without_kv_sizing_reports_what_is_known(runtime_dir: Path, db_path: Path) -> None:
    written = _killed([sys.executable, "-c", TORCH_LOOP, str(runtime_dir), "500", "sleep"],
                      runtime_dir, db_path, ready=500)
    store_rings(runtime_dir, db_path)
    serving = [s for s in written if s.phase == "serve"]
    assert len(serving) >= 500

    code, out = _cli(db_path, "explain", "latest", "--json")
    explanation = json.loads(out)
    assert (explanation["outcome"], explanation["unsized_ranks"]) == ("crashed", [0])
    readings = explanation["readings"][0]
    # Each step's peak is the weights plus one activation; the cache keeps the activation's segment.
    assert readings["max_peak_bytes"] == WEIGHTS + ACTIVATION
    assert readings["max_reserved_bytes"] == WEIGHTS + ACTIVATION
    assert readings["max_driver_used_bytes"] == CONTEXT + WEIGHTS + ACTIVATION
    assert readings["last"]["non_torch_bytes"] == CONTEXT
    assert readings["samples"] == len(written)
    text = " ".join(explanation["sentences"])
    assert "no KV sizing was recorded" in text and "cannot be known" in text
    assert "no samples" not in text

    code, out = _cli(db_path, "check", "latest")
    assert code == 1  # crashed
    assert "the ledger held" not in out
    assert "never sized a KV cache" in out and "allocator peak 576.0 MiB" in out


def test_a_finished_monitor_loop_passes_check_without_claiming_a_ledger(runtime_dir: Path, db_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", TORCH_LOOP, str(runtime_dir), "20", "close"],
                          env=memwatch_env(runtime_dir, db_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    store_rings(runtime_dir, db_path)
    code, out = _cli(db_path, "check", "latest")
    assert code == 0, out
    assert "the ledger held" not in out
    assert "no flags on what could be checked; rank(s) 0 never sized a KV cache" in out
    code, out = _cli(db_path, "explain", "latest")
    assert out.splitlines()[0].endswith(": ok")
    assert "no KV sizing was recorded" in out


def test_memwatch_sim_returns_once_a_simulated_crash_is_stored_as_crashed(runtime_dir: Path, db_path: Path) -> None:
    """``memwatch sim --scenario non_torch_leak``, then at once ``memwatch explain latest``: what the command's
    own help suggests. The crash leaves its ring open; the command waits until the sidecar has ended the rank."""
    from processes import SidecarProcess, query

    with SidecarProcess(runtime_dir, db_path):
        sim = subprocess.run([sys.executable, "-m", "memwatch", "sim", "--scenario", "non_torch_leak", "--json"],
                             env=memwatch_env(runtime_dir, db_path), capture_output=True, text=True, timeout=120)
        assert sim.returncode == 0, sim.stderr
        result = json.loads(sim.stdout)
        assert result["stored"] is True, result["store_note"]
        assert query(db_path, "SELECT status FROM runs WHERE run_id = ?", (result["run_id"],)) == [("crashed",)]
        code, out = _cli(db_path, "explain", "latest")
        assert code == 0 and out.splitlines()[0] == f"run {result['run_id']}: crashed", out
