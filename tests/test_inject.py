"""`memwatch attach --inject`: recording turned on inside running Python processes through gdb.

The targets are real interpreters started without memwatch: a plain PyTorch loop on ``fake_cuda``'s
device, and the nano-vllm mirror serving with tensor parallelism 2 (rank 1 in a spawned worker).
Each is also run once without injection, and its own output must be the same. The `memwatch` used
is the real command in a child process; the sidecar is a real ``memwatch serve``. The refusals are in
``test_inject_refusals.py``, the released vLLM in ``test_inject_vllm.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from injection import (
    LIGHT,
    Target,
    detach_and_wait,
    gdb_calls_work,
    memwatch,
    needs_gdb_calls,
    reap,
    target_env,
    unattended,
    wait_for_engine_steps,
)
from test_adapter_nanovllm import DEVICE, _free_port, _model_dir

from memwatch.attach.inject import detach, inject, payload
from memwatch.errors import NotFoundError

from processes import SidecarProcess, query, wait_for

MiB = 1 << 20
PLAIN = """
import sys, threading, time
from pathlib import Path
import torch
import fake_cuda

stop = Path(sys.argv[1])
x = torch.zeros(4)
rounds = 0
while rounds < 3 or not stop.exists():
    buffer = fake_cuda.empty(4 << 20)
    x += 1
    buffer.free()
    rounds += 1
    if rounds == 1:
        print("ready", flush=True)  # after the first step, so its 4 MiB segment is cached before any reading
    time.sleep(0.05)
print("threads", sorted(thread.name for thread in threading.enumerate()), flush=True)
"""
SERVE = """
import sys, threading, time
from pathlib import Path
import nanovllm.engine.model_runner
from nanovllm import LLM, SamplingParams
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler


def methods():
    return [dict(vars(owner)) for owner in (LLMEngine, Scheduler, ModelRunner)], nanovllm.engine.model_runner.load_model


if __name__ == "__main__":
    originals = methods()
    stop = Path(sys.argv[2])
    llm = LLM(sys.argv[1], tensor_parallel_size=2, max_num_batched_tokens=2048, max_model_len=1024, max_num_seqs=16)
    lengths = set()
    rounds = 0
    while rounds < 2 or not stop.exists():
        outputs = llm.generate([[1] * 100, [2] * 100], SamplingParams(max_tokens=8))
        lengths.add(tuple(len(output["token_ids"]) for output in outputs))
        if rounds == 0:
            print("ready", flush=True)
        rounds += 1
        time.sleep(0.05)
    print("lengths", sorted(lengths), flush=True)
    print("originals", methods() == originals, flush=True)
    print("threads", sorted(thread.name for thread in threading.enumerate()), flush=True)
"""



@pytest.fixture(autouse=True)
def _no_target_outlives_its_test() -> Iterator[None]:
    yield
    reap()


@needs_gdb_calls
def test_inject_into_a_plain_torch_loop_records_samples_and_detach_stops_it(
        tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(PLAIN)
    env = target_env(runtime_dir, db_path)
    reference = unattended(script, env)

    with SidecarProcess(runtime_dir, db_path):
        target = Target(script, env)
        done = memwatch(env, "attach", "--inject", str(target.proc.pid), "--interval", "0.1", "--once", "--json")
        assert done.returncode == 0, done.stderr
        assert "a sampler thread" in done.stderr and f"--detach {target.proc.pid}" in done.stderr
        assert json.loads(done.stdout)["source"] == "ring"  # the live view now reads the process's own ring
        wait_for(lambda: len(query(db_path, "SELECT 1 FROM samples")) >= 5, what="sampler readings in the database")
        assert target.running()

        detach_and_wait(env, target.proc.pid, db_path)
        assert target.running()
        output = target.finish()

    assert output == reference
    assert output[0].endswith("threads ['MainThread']\n")  # the sampler thread is gone
    [(engine, source, config)] = query(db_path, "SELECT engine, source, config FROM runs")
    assert (engine, source, json.loads(config)["attached_late"]) == ("python", "injected", True)
    # Every sample falls between two loop steps or inside one: 0 or 4 MiB allocated. The 4 MiB segment
    # stays cached, and the driver sees it plus the 64 MiB context: 68 MiB used of 160 MiB.
    rows = query(db_path, "SELECT allocated_bytes, reserved_bytes, driver_used_bytes, driver_free_bytes FROM samples")
    assert {row[0] for row in rows} <= {0, 4 * MiB}
    assert {row[1:] for row in rows} == {(4 * MiB, 68 * MiB, 92 * MiB)}


@needs_gdb_calls
def test_inject_into_a_nanovllm_tp2_engine_patches_every_rank_and_detach_restores_it(
        tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    model = _model_dir(tmp_path)
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    reference = unattended(script, target_env(runtime_dir, db_path, NANOVLLM_MIRROR_PORT=str(_free_port()), **DEVICE),
                            str(model))
    env = target_env(runtime_dir, db_path, NANOVLLM_MIRROR_PORT=str(_free_port()), **DEVICE)

    with SidecarProcess(runtime_dir, db_path):
        target = Target(script, env, str(model))
        done = memwatch(env, "attach", "--inject", str(target.proc.pid), "--once", "--json")
        assert done.returncode == 0, done.stderr
        assert "the nano-vllm adapter" in done.stderr
        assert len(json.loads(done.stdout)["ranks"]) == 2  # rank 1 lives in the spawned worker
        wait_for_engine_steps(db_path, [0, 1], 8, "steps of both ranks in the database")
        assert target.running()

        detach_and_wait(env, target.proc.pid, db_path)
        output = target.finish()

    assert output == reference
    assert "originals True\n" in output[0] and "lengths [(8, 8)]\n" in output[0]
    [(engine, source, ranks, config)] = query(db_path, "SELECT engine, source, rank_count, config FROM runs")
    assert (engine, source, ranks, json.loads(config)["attached_late"]) == ("nano-vllm", "injected", 2, True)
    # What startup would have recorded, read from the live engine (the adapter test derives the counts):
    # block_bytes = 2 · 16 layers · 256 · (4 KV heads // 2) · 128 · 2 bytes = 4 MiB; rank 0 chose 7 blocks,
    # rank 1 (8 MiB less free) 5. The readings it sized on are gone: no used, peak or current.
    sizing = [(rank, json.loads(data)) for rank, data in query(
        db_path, "SELECT rank, data FROM events WHERE kind = 'kv_allocated' ORDER BY rank")]
    assert [(rank, data["num_blocks"], data["block_bytes"], data["total_bytes"], data["gpu_memory_utilization"],
             data["used_bytes"], data["peak_bytes"], data["current_bytes"]) for rank, data in sizing] == [
        (0, 7, 4 * MiB, 160 * MiB, 0.9, None, None, None), (1, 5, 4 * MiB, 160 * MiB, 0.9, None, None, None)]
    late = [json.loads(data) for (data,) in query(db_path, "SELECT data FROM events WHERE kind = 'attached_late'")]
    assert len(late) == 2 and all("activation_reserve_bytes" in data["unknown_terms"] for data in late)
    # Each round is one prefill of 2 × 100 tokens and 7 decodes; rank 0 sees the block manager: 7 blocks.
    arrived = query(db_path, "SELECT rank, count(*) FROM events WHERE kind = 'request_arrived' GROUP BY rank")
    assert len(arrived) == 1 and arrived[0][0] == 0 and arrived[0][1] >= 2  # rank 0 records the workload
    prefills = query(db_path, "SELECT DISTINCT num_seqs, num_tokens FROM samples WHERE step_kind = 'prefill'")
    assert prefills == [(2, 200)]
    assert query(db_path, "SELECT DISTINCT kv_blocks_total FROM samples WHERE rank = 0 AND step_kind IS NOT NULL") \
        == [(7,)]



def test_the_injected_lines_load_the_engine_plugin_where_the_target_lacks_it(tmp_path: Path,
                                                                             runtime_dir: Path) -> None:
    """An interpreter without site-packages cannot import memwatch_engine; the lines load it from its folder,
    start the sampler, leave no name behind in ``__main__``, and report through the status file."""
    status = tmp_path / "status.json"
    request = {"action": "start", "mode": "sampler", "run_id": "feedc0de0001", "runtime_dir": str(runtime_dir),
               "interval_s": 0.05, "status": str(status)}
    program = payload(request) + "\nprint(sorted(name for name in globals() if not name.startswith('__')))\n"
    done = subprocess.run([sys.executable, "-S", "-c", program], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"]})
    assert (done.returncode, done.stdout, done.stderr) == (0, "[]\n", "")
    outcome = json.loads(status.read_text())
    assert outcome["ok"] and outcome["engine"] == "python" and outcome["ranks"] == [0]
    assert outcome["probes"] == ["nvml"]  # no torch in that interpreter, and none imported
    assert outcome["rings"] == [str(runtime_dir / "feedc0de0001-r0.ring")]


@needs_gdb_calls
def test_a_process_can_be_injected_again_after_a_detach(tmp_path: Path, runtime_dir: Path, db_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """No sidecar drains the first run's closed ring here: it must not pass for a recording still on."""
    script = tmp_path / "loop.py"
    script.write_text(LIGHT)
    target = Target(script, target_env(runtime_dir, db_path))
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(runtime_dir))
    first = inject(target.proc.pid, interval_s=0.05)
    assert detach(target.proc.pid) == [target.proc.pid]
    second = inject(target.proc.pid, interval_s=0.05)
    assert (first.engine, second.engine, second.already) == ("python", "python", False)
    assert first.run_id != second.run_id
    assert detach(target.proc.pid) == [target.proc.pid]
    with pytest.raises(NotFoundError):
        detach(target.proc.pid)
    out, err = target.finish()
    assert (out.splitlines()[-1], err) == ("threads ['MainThread']", "")
    assert sorted(path.name for path in runtime_dir.glob("*.ring")) == sorted(
        f"{run.run_id}-r0.ring" for run in (first, second))


def test_lines_that_run_after_the_injector_gave_up_do_nothing(tmp_path: Path, runtime_dir: Path) -> None:
    """``sys.remote_exec`` may run the file late: past its expiry it removes the file and starts nothing."""
    script, status = tmp_path / "inject-1.py", tmp_path / "status.json"
    request = {"action": "start", "mode": "sampler", "run_id": "feedc0de0002", "runtime_dir": str(runtime_dir),
               "status": str(status), "script": str(script), "expires": 1.0}
    script.write_text(payload(request) + "\n")
    done = subprocess.run([sys.executable, "-c", f"exec(open({str(script)!r}).read())\nimport sys\n"
                           "print('memwatch_engine.inject' in sys.modules)"],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "True\n", "")
    assert not script.exists() and not status.exists() and not list(runtime_dir.iterdir())


def test_where_gdb_cannot_call_into_a_process_the_user_is_told_why_and_the_process_runs_on(
        tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    """gdb 13 on a CPU with AMX: no function can be called in the target, so nothing is injected, and the user is
    told what to install; the target is left exactly as it was (its own output unchanged, no thread added)."""
    if gdb_calls_work():
        pytest.skip("this machine's gdb can call into a process: the tests above inject")
    script = tmp_path / "light.py"
    script.write_text(LIGHT)
    env = target_env(runtime_dir, db_path)
    target = Target(script, env)
    done = memwatch(env, "attach", "--inject", str(target.proc.pid), "--interval", "0.1", "--once")
    assert done.returncode == 4, done.stderr
    assert done.stderr == (f"error: gdb could not call into process {target.proc.pid}: the kernel refused its write-"
                           "back of the CPU's extended registers (gdb before 14 does not know the AMX-sized XSAVE area "
                           "of this CPU); install gdb 14 or newer, or run the engine on Python 3.14 (memwatch then "
                           "uses sys.remote_exec); the process runs on unobserved\n")
    assert target.running()
    assert target.finish() == ("ready\nthreads ['MainThread']\n", "")
    assert not list(runtime_dir.glob("*.ring"))
