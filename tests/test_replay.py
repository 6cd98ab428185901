"""Replay: a recorded run's workload and calibrated memory, run again at its own and at other settings.

Fidelity: every shipped scenario, recorded and replayed at its own settings, must come back with the
same KV block count on every rank, preemptions within ±10 %, the same OOM outcome and an OOM step
within 5 %, and its last step (the drain, or a crash outside PyTorch's allocator) within 5 %.
Prediction: record at one setting, replay at another, and compare with a direct simulation of the
scenario at the new setting (which the replay never reads): same OOM outcome, KV blocks within one
block, preemptions within ±15 %. Simulations run on a virtual clock; each scenario takes well under a
second here, and is recorded once for the whole module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from memwatch.replay.compare import load_recording, replay_run
from memwatch.replay.outcome import RankOutcome, run_outcome
from memwatch.replay.run import Settings
from memwatch.sim import Scenario, shipped_scenarios
from memwatch.store import open_store
from memwatch.store.queries import events, get_run

from stored_runs import store_scenario

GiB = 1 << 30
MiB = 1 << 20

UNMODELLED: dict[str, str] = {}
"""Shipped scenarios whose out-of-memory comes from memory the calibrated model does not follow (none)."""

Recorded = Callable[[str], tuple[Path, str]]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    """``recorded(name)``: the database and run id of the shipped scenario ``name``, simulated once per module.

    Replays and direct simulations are stored next to it; the recorded run itself is only read.
    """
    root = tmp_path_factory.mktemp("recordings")
    runs: dict[str, tuple[Path, str]] = {}

    def record(name: str) -> tuple[Path, str]:
        if name not in runs:
            db_path = root / f"{name}.db"
            runs[name] = (db_path, store_scenario(name, root / name, db_path))
        return runs[name]

    return record


def _close(replayed: int, recorded: int, fraction: float) -> bool:
    return abs(replayed - recorded) <= fraction * recorded


def _assert_matches(replayed: list[RankOutcome], recorded: list[RankOutcome], *, blocks: int, preemptions: float,
                    oom_step: float, steps: float | None = None) -> None:
    assert len(replayed) == len(recorded)
    for mine, theirs in zip(replayed, recorded, strict=True):
        assert theirs.kv_blocks is not None and mine.kv_blocks is not None
        assert abs(mine.kv_blocks - theirs.kv_blocks) <= blocks, (mine, theirs)
        assert _close(mine.preemptions, theirs.preemptions, preemptions), (mine, theirs)
        assert mine.oom == theirs.oom, (mine, theirs)
        if theirs.oom:
            assert mine.oom_step is not None and theirs.oom_step is not None
            assert _close(mine.oom_step, theirs.oom_step, oom_step), (mine, theirs)
        if steps is not None:  # the last step: the drain, or a crash outside PyTorch's allocator (no OOM event)
            assert _close(mine.steps, theirs.steps, steps), (mine, theirs)


def test_every_shipped_scenario_is_checked_or_named_as_unmodelled() -> None:
    assert set(UNMODELLED) <= set(shipped_scenarios())


@pytest.mark.parametrize("name", [name for name in shipped_scenarios() if name not in UNMODELLED])
def test_replay_at_the_recorded_settings_reproduces_the_run(name: str, recorded: Recorded) -> None:
    db_path, run_id = recorded(name)
    comparison = replay_run(db_path, run_id, Settings())
    recorded = comparison.recording.outcome
    for theirs, mine in zip(recorded, comparison.outcome, strict=False):  # -s shows the fidelity table
        print(f"\n{name:<24} rank {theirs.rank}  KV blocks {theirs.kv_blocks}/{mine.kv_blocks}  preemptions "
              f"{theirs.preemptions}/{mine.preemptions}  OOM step {theirs.oom_step or '-'}/{mine.oom_step or '-'}"
              f"  steps {theirs.steps}/{mine.steps}  (recorded/replayed)", end="")
    _assert_matches(comparison.outcome, recorded, blocks=0, preemptions=0.10, oom_step=0.05, steps=0.05)
    db = open_store(db_path, readonly=True)
    replayed = get_run(db, comparison.result.run_id)
    assert replayed.config["replay_of"] == run_id and replayed.source == "sim"
    assert run_outcome(db, run_id) == recorded  # the original is untouched


def _engine(**changes: object):
    return lambda scenario: dataclasses.replace(scenario, engine=dataclasses.replace(scenario.engine, **changes))


def _gpu(total: int):
    return lambda scenario: dataclasses.replace(scenario, gpu=dataclasses.replace(scenario.gpu, total_bytes=total))


def _rate(factor: float):
    def change(scenario: Scenario) -> Scenario:
        random = scenario.workload.random
        assert random is not None and random.rate_per_s is not None
        workload = dataclasses.replace(scenario.workload,
                                       random=dataclasses.replace(random, rate_per_s=random.rate_per_s * factor))
        return dataclasses.replace(scenario, workload=workload)
    return change


PREDICTIONS = [
    ("kv_pressure", Settings(utilization=0.7), _engine(gpu_memory_utilization=0.7)),
    ("kv_pressure", Settings(utilization=0.5), _engine(gpu_memory_utilization=0.5)),
    ("kv_pressure", Settings(max_num_seqs=16), _engine(max_num_seqs=16)),
    ("clean_chat", Settings(utilization=0.5), _engine(gpu_memory_utilization=0.5)),
    ("clean_chat", Settings(load=3.0), _rate(3.0)),
    ("non_torch_leak", Settings(utilization=0.5), _engine(gpu_memory_utilization=0.5)),
    ("non_torch_leak", Settings(gpu_memory_bytes=12 * GiB), _gpu(12 * GiB)),
    ("demo", Settings(gpu_memory_bytes=32 * GiB), _gpu(32 * GiB)),
    ("warmup_short", Settings(utilization=0.8), _engine(gpu_memory_utilization=0.8)),
    ("non_torch_leak_tp2", Settings(utilization=0.5), _engine(gpu_memory_utilization=0.5)),
    ("clean_eager", Settings(utilization=0.7), _engine(gpu_memory_utilization=0.7)),
    ("skip_peak_reset", Settings(gpu_memory_bytes=10 * GiB), _gpu(10 * GiB)),
    ("rank_imbalance", Settings(gpu_memory_bytes=10 * GiB), _gpu(10 * GiB)),
    ("clean_llama_80g", Settings(tp=2), _engine(tensor_parallel_size=2)),
    ("fragmentation", Settings(gpu_memory_bytes=10 * GiB), _gpu(10 * GiB)),
    ("other_process_oom", Settings(gpu_memory_bytes=16 * GiB), _gpu(16 * GiB)),
    ("other_process_oom_tp2", Settings(gpu_memory_bytes=12 * GiB), _gpu(12 * GiB)),
    ("other_process_oom_tp2", Settings(utilization=0.8), _engine(gpu_memory_utilization=0.8)),
    ("fragmentation_80g", Settings(gpu_memory_bytes=90_000_000_000), _gpu(90_000_000_000)),
    ("non_torch_leak_h200", Settings(utilization=0.9), _engine(gpu_memory_utilization=0.9)),
    ("clean_bursty", Settings(load=2.0), _rate(2.0)),
    ("chunked_prompt", Settings(utilization=0.5), _engine(gpu_memory_utilization=0.5)),
    ("torch_leak", Settings(utilization=0.5), _engine(gpu_memory_utilization=0.5)),
    ("torch_leak", Settings(gpu_memory_bytes=12 * GiB), _gpu(12 * GiB)),
    ("torch_leak_tp4", Settings(utilization=0.5), _engine(gpu_memory_utilization=0.5)),
]


def test_replay_under_a_change_predicts_a_direct_simulation(recorded: Recorded, tmp_path: Path) -> None:
    rows = []
    for index, (name, change, direct) in enumerate(PREDICTIONS):
        db_path, run_id = recorded(name)
        replayed = replay_run(db_path, run_id, change).outcome
        direct_id = store_scenario(direct(Scenario.load(name)), tmp_path / f"direct{index}", db_path)
        simulated = run_outcome(open_store(db_path, readonly=True), direct_id)
        rows.append((name, change, replayed, simulated))
    print(f"\n{'scenario':<22} {'change (replay/direct)':<28} {'KV blocks':>15} {'preemptions':>13} {'OOM step':>13} "
          f"{'steps':>13}")
    for name, change, replayed, simulated in rows:
        what = ", ".join(f"{k}={v}" for k, v in change.describe().items() if not (k == "load" and v == 1.0))
        mine, theirs = replayed[0], simulated[0]
        steps = [next((str(r.oom_step) for r in ranks if r.oom), "-") for ranks in (replayed, simulated)]
        print(f"{name:<22} {what:<28} {mine.kv_blocks:>7}/{theirs.kv_blocks:<7} "
              f"{mine.preemptions:>6}/{theirs.preemptions:<6} {steps[0]:>6}/{steps[1]:<6} "
              f"{mine.steps:>6}/{theirs.steps:<6}")
    assert len({row[0] for row in rows}) >= 6 and len(rows) == len(PREDICTIONS)
    for _, _, replayed, simulated in rows:
        _assert_matches(replayed, simulated, blocks=1, preemptions=0.15, oom_step=0.05, steps=0.05)


def test_the_calibration_fits_the_recorded_samples(recorded: Recorded) -> None:
    """kv_pressure on Qwen3-0.6B (bf16): the model's own numbers, worked by hand from its config."""
    db_path, run_id = recorded("kv_pressure")
    recording = load_recording(open_store(db_path, readonly=True), run_id)
    [rank] = recording.calibration.ranks
    # KV block: 2 (K, V) · 28 layers · 256 tokens · 8 KV heads · 128 head dim · 2 bytes = 28 MiB
    assert rank.block_bytes == 2 * 28 * 256 * 8 * 128 * 2
    assert recording.calibration.settings.gpu_memory_utilization == 0.6
    assert rank.total_bytes == 8 * GiB
    # Flash attention: per token, the MLP phase is the peak: the residual, the normed input, gate_up (2 ·
    # intermediate), the activated half and down_proj's output, (3 · hidden 1024 + 3 · intermediate 3072) ·
    # 2 bytes = 24,576; per sequence, one row of fp32 logits over the 151,936-token vocabulary = 607,744.
    assert rank.activation_per_token == pytest.approx((3 * 1024 + 3 * 3072) * 2, rel=0.01)
    assert rank.activation_per_seq == pytest.approx(151_936 * 4, rel=0.01)
    # Each recorded rise is the forward plus what the allocator did not split off its blocks: at most 1 MiB
    # for each of the six tensors alive at the MLP peak (logits, residual, normed, gate_up, act, down).
    assert rank.fitted_forwards > 0 and rank.fit_max_error_bytes <= 6 * MiB
    assert recording.calibration.cost.prefill_tokens_per_s == pytest.approx(8000.0)
    assert len(recording.workload.requests) == 32
    assert {(r.prompt_tokens, r.output_tokens) for r in recording.workload.requests} == {(1024, 2000)}


def test_a_leak_keeps_leaking_past_the_end_of_the_recording(recorded: Recorded) -> None:
    """non_torch_leak leaks 2.5 MiB a step until its cudaMalloc fails (a crash, not an OOM event); with more
    room the replay lasts longer."""
    db_path, run_id = recorded("non_torch_leak")
    recording = load_recording(open_store(db_path, readonly=True), run_id)
    assert recording.calibration.ranks[0].outside_growth_per_step == pytest.approx(2.5 * MiB)
    bigger = replay_run(db_path, run_id, Settings(gpu_memory_bytes=9 * GiB))
    [original], [replayed] = recording.outcome, bigger.outcome
    assert not original.oom and not replayed.oom  # the leak crashes outside PyTorch's allocator
    # 1 GiB more device, 0.6 of it to the KV cache: the other 0.4 GiB lasts 409.6 MiB / 2.5 MiB ≈ 164 steps more.
    assert replayed.steps - original.steps == pytest.approx(164, abs=12)


def test_fragmentation_is_calibrated_from_the_allocator_signals(recorded: Recorded) -> None:
    """fragmentation: from step 300, every 10 steps a temporary of 126 MiB + 512 bytes (2 MiB more each time)
    with a small long-lived tensor born while it lives. The calibration finds the series in the steps' own
    peaks and ``allocated``, and continues it past the recording to the temporary its OOM asked for."""
    db_path, run_id = recorded("fragmentation")
    recording = load_recording(open_store(db_path, readonly=True), run_id)
    [rank] = recording.calibration.ranks
    series = rank.transients
    first = series.recorded[0]
    assert (first.step, first.temporary_bytes) == (300, 126 * MiB + 512)
    assert all(event.kept_bytes >= MiB + 512 for event in series.recorded)  # the long-lived tensor, rounded
    assert (series.period, series.growth_bytes) == (10, 2 * MiB)
    assert all(event.step % 10 == 0 for event in series.recorded)
    [oom] = [e for e in events(open_store(db_path, readonly=True), run_id) if e.kind == "oom"]
    # The recording ends at step 540's temporary, the 25th: 126 MiB + 512 + 24 · 2 MiB.
    assert oom.data["requested_bytes"] == 126 * MiB + 512 + 24 * 2 * MiB
    assert series.at(540) is not None and series.at(540).temporary_bytes == oom.data["requested_bytes"]
    assert series.at(545) is None
    # The temporaries are left out of the forward fit: its one prefill (8 prompts of 1,024 tokens) fits
    # 8,192 · 24,576 + 8 · 607,744 bytes (worked out for kv_pressure above), within the allocator's remainders.
    assert rank.activation(8192, 8) == pytest.approx(8192 * 24_576 + 8 * 607_744, abs=6 * MiB)


def test_a_greedy_process_takes_whatever_is_free_at_any_setting(recorded: Recorded) -> None:
    """other_process_oom_tp2: at step 100 another process takes every free byte of rank 1 (it asked for
    8 GiB). The calibration marks that rise as greedy on rank 1 only; other_process's 2 GiB, which left
    room, is not. On a 16 GiB card the greedy process still fills rank 1, so the wave of longer prompts
    still runs it out of memory, where replaying the recorded bytes would have left it 4 GiB free."""
    db_path, run_id = recorded("other_process_oom_tp2")
    recording = load_recording(open_store(db_path, readonly=True), run_id)
    assert [rank.greedy_steps for rank in recording.calibration.ranks] == [(), (100,)]
    bigger = replay_run(db_path, run_id, Settings(gpu_memory_bytes=16 * GiB))
    assert [rank.oom for rank in bigger.outcome] == [False, True]
    [rank1] = [r for r in bigger.outcome if r.rank == 1]
    [original] = [r for r in recording.outcome if r.rank == 1]
    assert rank1.oom_step == original.oom_step  # the same wave of longer prompts
    db_path, run_id = recorded("other_process")
    calm = load_recording(open_store(db_path, readonly=True), run_id)
    assert calm.calibration.ranks[0].greedy_steps == ()
