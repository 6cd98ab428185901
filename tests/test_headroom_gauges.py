"""The headroom gauges through a real sidecar process and a real HTTP scrape, each value worked out by hand.

An engine (a real ``Monitor`` with a probe whose readings are set) sizes a KV pool of 1,000 blocks of 16
tokens and steps with a known load; ``memwatch serve --prometheus`` drains its ring and serves ``/metrics``,
parsed by ``prometheus_client``'s parser and checked by ``promtool check metrics``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from memwatch.export.headroom import HELP as HEADROOM_HELP
from memwatch_engine import Monitor
from memwatch_engine.probes.base import DeviceInfo, Probe

from processes import SidecarProcess, memwatch_env, wait_for
from prometheus_server import binary, free_port

GiB = 1 << 30
MiB = 1 << 20
# allocated, peak, reserved, driver used, driver free, segments, active, inactive split, retries, OOMs
READING = (20 * GiB, 21 * GiB, 21 * GiB, 70 * GiB, 2 * GiB, 10, 20 * GiB, 0, 0, 0)


class SetProbe(Probe):
    """The same reading every time: a step's peak 1 GiB above what stays allocated."""

    name = "set"

    def read(self) -> tuple[int, int, int, int, int]:
        return READING[:5]

    def read_step(self) -> tuple[int, int, int, int, int, int, int, int, int, int]:
        return READING

    def device_info(self) -> DeviceInfo:
        return DeviceInfo(0, "test GPU", 80 * GiB)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _listening(port: int) -> bool:
    try:
        _scrape(port)
    except OSError:  # the endpoint opens once the sidecar has its lock and store
        return False
    return True


def _gauges(text: str, run_id: str) -> dict[str, float]:
    """``name`` (``name{shape}`` for the admissible requests) -> value, for the engine of ``run_id``."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("run_id") == run_id and "rank" not in sample.labels:
                shape = sample.labels.get("shape")
                found[f"{sample.name}{{{shape}}}" if shape else sample.name] = sample.value
    return found


def _engine(runtime_dir: Path, run_id: str) -> Monitor:
    monitor = Monitor(engine="nano-vllm", model="m", runtime_dir=runtime_dir, probe=SetProbe(), run_id=run_id,
                      spawn_sidecar=False, close_at_exit=False)
    with monitor.phase("kv_alloc"):
        # The activation reserve is peak - current at sizing: 22 - 20 = 2 GiB, the next forward's need.
        monitor.kv_allocated(1000, MiB, block_size=16, total_bytes=80 * GiB, gpu_memory_utilization=0.9,
                             used_bytes=60 * GiB, peak_bytes=22 * GiB, current_bytes=20 * GiB,
                             reserved_bytes=20 * GiB)
    monitor._enter_phase("serve")  # each step's peak is its own from here
    return monitor


def test_each_gauge_is_the_value_worked_out_by_hand(runtime_dir: Path, db_path: Path) -> None:
    port = free_port()
    with SidecarProcess(runtime_dir, db_path, "--prometheus", str(port), "--poll-interval", "0.05") as sidecar:
        wait_for(lambda: _listening(port), what="the sidecar's /metrics")
        engine = _engine(runtime_dir, "hand")
        engine.step("prefill", num_seqs=1, num_tokens=4096, kv_blocks_used=180, kv_blocks_total=1000,
                    requests_running=4, requests_waiting=2, kv_blocks_needed=110)
        engine.step("decode", num_seqs=4, num_tokens=4, kv_blocks_used=200, kv_blocks_total=1000,
                    requests_running=4, requests_waiting=2, kv_blocks_needed=100)
        # The margin needs the drained decode's ledger: wait for the largest safe prefill to be there.
        text = wait_for(lambda: (t := _scrape(port)) and "memwatch_max_safe_prefill_tokens{" in t and t,
                        what="the ledger of the drained steps")
        gauges = _gauges(text, "hand")
        # KV: 1,000 blocks of 16 tokens, 200 used, 100 more promised to the 4 running requests, 2 waiting.
        assert gauges["memwatch_kv_free_tokens"] == (1000 - 200) * 16 == 12800
        assert gauges["memwatch_kv_capacity_tokens"] == 1000 * 16
        assert gauges["memwatch_kv_committed_usage_ratio"] == (200 + 100) / 1000
        assert gauges["memwatch_requests_running"] == 4 and gauges["memwatch_requests_waiting"] == 2
        # Activation: the prefill of 4,096 tokens rose 1 GiB above what stayed allocated: 256 KiB a token.
        # The room a forward has now: free 2 GiB + wholly free cache (reserved 21 - active 20 - pinned 0 = 1 GiB)
        # = 3 GiB. (The ledger's OOM margin is that less the next forward's need, the 2 GiB reserve: 1 GiB; the
        # prefill is that forward, so its need is counted once.) Three quarters of it, 2.25 GiB / 256 KiB = 9,216.
        assert gauges["memwatch_max_safe_prefill_tokens"] == 3 * GiB * 3 // 4 // (GiB // 4096) == 9216
        # Admissible, KV limit: (1000 - 200 - 100) = 700 spare blocks // blocks of the shape, less the 2 waiting;
        # activation limit: 9,216 // prompt.
        assert gauges["memwatch_admissible_requests{512:256}"] == min(700 // 48 - 2, 9216 // 512) == 12
        assert gauges["memwatch_admissible_requests{2048:512}"] == min(700 // 160 - 2, 9216 // 2048) == 2
        assert gauges["memwatch_admissible_requests{8192:1024}"] == max(min(700 // 576 - 2, 9216 // 8192), 0) == 0
        assert gauges["memwatch_signal_valid"] == 1 and 0 <= gauges["memwatch_signal_age_seconds"] < 2

        # A step the sidecar has not drained yet is what the next scrape shows (read from the ring's newest slot).
        engine.step("decode", num_seqs=4, num_tokens=4, kv_blocks_used=216, kv_blocks_total=1000,
                    requests_running=4, requests_waiting=1, kv_blocks_needed=99)
        text = _scrape(port)
        gauges = _gauges(text, "hand")
        assert gauges["memwatch_kv_free_tokens"] == (1000 - 216) * 16
        assert gauges["memwatch_kv_capacity_tokens"] == 1000 * 16  # the same sample's, whatever was stored
        assert gauges["memwatch_kv_committed_usage_ratio"] == (216 + 99) / 1000
        assert gauges["memwatch_admissible_requests{2048:512}"] == min((1000 - 216 - 99) // 160 - 1, 4) == 3
        assert gauges["memwatch_admissible_requests{512:256}"] == min(685 // 48 - 1, 18) == 13
        assert gauges["memwatch_requests_waiting"] == 1
        _promtool_passes_the_headroom(_scrape(port))
        engine.close()
        sidecar.stop()


def _promtool(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60)


def _promtool_passes_the_headroom(text: str) -> None:
    """The whole exposition, the gauges' block among the per-rank series, passes ``promtool check metrics``."""
    def name(line: str) -> str:
        return line.split(" ")[2] if line.startswith("#") else line.split("{")[0]

    block = [line for line in text.splitlines() if name(line) in HEADROOM_HELP]
    assert len(block) > 2 * len(HEADROOM_HELP), text
    whole = _promtool(text)
    assert whole.returncode == 0 and not (whole.stdout + whole.stderr).strip(), whole.stdout + whole.stderr


def test_shapes_are_configured_and_a_bad_one_is_refused_in_one_line(runtime_dir: Path, db_path: Path) -> None:
    port = free_port()
    with SidecarProcess(runtime_dir, db_path, "--prometheus", str(port), "--admission-shape", "100:28",
                        "--admission-shape", "1000:0") as sidecar:
        wait_for(lambda: _listening(port), what="the sidecar's /metrics")
        engine = _engine(runtime_dir, "shapes")
        engine.step("decode", num_seqs=1, num_tokens=1, kv_blocks_used=0, kv_blocks_total=1000,
                    requests_running=0, requests_waiting=0, kv_blocks_needed=0)
        gauges = wait_for(lambda: _gauges(_scrape(port), "shapes").get("memwatch_signal_valid") and
                          _gauges(_scrape(port), "shapes"), what="the engine's signal")
        # No prefill yet, but the warmup's measure stands in only with max_num_batched_tokens: KV limit alone.
        # 1,000 free blocks // ceil(128 / 16) = 125 and // ceil(1000 / 16) = 63 -> 15.
        shapes = {k: v for k, v in gauges.items() if k.startswith("memwatch_admissible_requests")}
        assert shapes == {"memwatch_admissible_requests{100:28}": 125, "memwatch_admissible_requests{1000:0}": 15}
        assert "memwatch_max_safe_prefill_tokens" not in gauges
        engine.close()
        sidecar.stop()
    bad = subprocess.run([sys.executable, "-m", "memwatch", "serve", "--admission-shape", "2048"], capture_output=True,
                         text=True, timeout=60, env=memwatch_env(runtime_dir, db_path))
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("error: --admission-shape '2048' is not PROMPT:OUTPUT tokens (1 to 16777216 and 0 "
                                  "to 16777216); give e.g. 2048:512")


ENGINE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from test_headroom_gauges import _engine
    from pathlib import Path
    engine = _engine(Path(sys.argv[1]), "stops")
    while True:
        engine.step("decode", num_seqs=1, num_tokens=1, kv_blocks_used=10, kv_blocks_total=1000,
                    requests_running=1, requests_waiting=0, kv_blocks_needed=5)
        time.sleep(0.005)
""")


def test_a_stopped_engine_flips_the_signal_to_invalid_within_two_seconds(runtime_dir: Path, db_path: Path) -> None:
    port = free_port()
    with SidecarProcess(runtime_dir, db_path, "--prometheus", str(port)) as sidecar:
        wait_for(lambda: _listening(port), what="the sidecar's /metrics")
        engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(runtime_dir), str(Path(__file__).parent)],
                                  env=memwatch_env(runtime_dir, db_path))
        try:
            wait_for(lambda: _gauges(_scrape(port), "stops").get("memwatch_signal_valid") == 1,
                     what="a valid signal from the stepping engine")
            engine.send_signal(signal.SIGSTOP)  # alive, holding its ring, but no longer stepping
            stopped = time.monotonic()
            wait_for(lambda: _gauges(_scrape(port), "stops")["memwatch_signal_valid"] == 0, timeout=5,
                     what="the signal to turn invalid")
            took = time.monotonic() - stopped
            # Stale 1.5 s (the default) after the scrape that last saw the ring's count move: the engine wrote
            # within 5 ms of the stop and the scrapes come every 20 ms or so (wait_for), so 1.5 s plus those.
            assert 1.45 < took <= 2.0, took
            age = _gauges(_scrape(port), "stops")["memwatch_signal_age_seconds"]
            assert age > 1.5
        finally:
            engine.kill()
            engine.wait(timeout=30)
        sidecar.stop()


IDLE_ENGINE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from test_headroom_gauges import _engine
    from pathlib import Path
    engine = _engine(Path(sys.argv[1]), "idles")
    for _ in range(20):
        engine.step("decode", num_seqs=1, num_tokens=1, kv_blocks_used=10, kv_blocks_total=1000,
                    requests_running=1, requests_waiting=0, kv_blocks_needed=5)
    engine.step("decode", num_seqs=1, num_tokens=1, kv_blocks_used=0, kv_blocks_total=1000,
                requests_running=0, requests_waiting=0, kv_blocks_needed=0)  # the last request finished
    print("idle", flush=True)
    time.sleep(600)
""")


def test_an_idle_engine_stays_valid_until_its_process_ends(runtime_dir: Path, db_path: Path) -> None:
    port = free_port()
    with SidecarProcess(runtime_dir, db_path, "--prometheus", str(port)) as sidecar:
        wait_for(lambda: _listening(port), what="the sidecar's /metrics")
        engine = subprocess.Popen([sys.executable, "-c", IDLE_ENGINE, str(runtime_dir), str(Path(__file__).parent)],
                                  env=memwatch_env(runtime_dir, db_path), stdout=subprocess.PIPE, text=True)
        try:
            assert engine.stdout is not None and engine.stdout.readline().strip() == "idle"
            wait_for(lambda: _gauges(_scrape(port), "idles").get("memwatch_kv_free_tokens") == 1000 * 16,
                     what="the idle step")
            time.sleep(2.0)  # past the 1.5 s a busy engine's signal lasts without a step
            gauges = _gauges(_scrape(port), "idles")
            assert gauges["memwatch_signal_valid"] == 1 and gauges["memwatch_signal_age_seconds"] > 1.5
            engine.kill()  # its ring's writer is gone: the sidecar finishes the run, and the signal is invalid
            engine.wait(timeout=30)
            killed = time.monotonic()
            wait_for(lambda: _gauges(_scrape(port), "idles")["memwatch_signal_valid"] == 0, timeout=10,
                     what="the killed engine's signal to turn invalid")
            print(f"invalid {time.monotonic() - killed:.2f} s after the kill")
        finally:
            engine.kill()
            engine.wait(timeout=30)
            if engine.stdout is not None:
                engine.stdout.close()
        sidecar.stop()


FINISHED_ENGINE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from test_headroom_gauges import _engine
    from pathlib import Path
    engine = _engine(Path(sys.argv[1]), "drained")
    engine.request_arrived("a", 100, 50)
    for _ in range(20):
        engine.step("decode", num_seqs=1, num_tokens=1, kv_blocks_used=10, kv_blocks_total=1000,
                    requests_running=1, requests_waiting=0, kv_blocks_needed=5)
    # The last step sampled its last token: nano-vllm reads the load before the request leaves, so the step's
    # sample still counts it running; the request's end comes as an event after it, and no step follows.
    engine.request_finished("a", 50)
    print("idle", flush=True)
    time.sleep(600)
""")


def test_an_engine_whose_requests_all_finished_is_idle_though_its_last_step_counted_one(
        runtime_dir: Path, db_path: Path) -> None:
    port = free_port()
    with SidecarProcess(runtime_dir, db_path, "--prometheus", str(port), "--poll-interval", "0.05") as sidecar:
        wait_for(lambda: _listening(port), what="the sidecar's /metrics")
        engine = subprocess.Popen([sys.executable, "-c", FINISHED_ENGINE, str(runtime_dir),
                                   str(Path(__file__).parent)],
                                  env=memwatch_env(runtime_dir, db_path), stdout=subprocess.PIPE, text=True)
        try:
            assert engine.stdout is not None and engine.stdout.readline().strip() == "idle"
            wait_for(lambda: _gauges(_scrape(port), "drained").get("memwatch_requests_running") == 1,
                     what="the last step")
            time.sleep(2.0)  # past the 1.5 s a busy engine's signal lasts without a step
            gauges = _gauges(_scrape(port), "drained")
            assert gauges["memwatch_requests_running"] == 1  # what the last step read, unchanged
            assert gauges["memwatch_signal_valid"] == 1 and gauges["memwatch_signal_age_seconds"] > 1.5
            engine.kill()  # idle, but its process is gone: the writer's lock on its ring went with it
            engine.wait(timeout=30)
            wait_for(lambda: _gauges(_scrape(port), "drained")["memwatch_signal_valid"] == 0, timeout=10,
                     what="the killed idle engine's signal to turn invalid")
        finally:
            engine.kill()
            engine.wait(timeout=30)
            if engine.stdout is not None:
                engine.stdout.close()
        sidecar.stop()
