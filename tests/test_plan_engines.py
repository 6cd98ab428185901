"""Each engine's budget rule and defaults, worked by hand from the engines' own formulas."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from memwatch.cli.plan import plan
from memwatch.errors import UsageError
from memwatch.models import ModelSpec, forward_activation_bytes
from memwatch.plan import PlanInputs, plan_capacity
from memwatch.plan.engines import defaults, kv_budget, sglang_mem_fraction_static, vllm_capture_sizes

GIB, MIB = 2**30, 2**20
WEIGHTS = 7_615_616_512 * 2                                            # Qwen2.5-7B-Instruct in bf16
PER_TOKEN = 57_344


@pytest.fixture(scope="module")
def qwen() -> ModelSpec:
    return ModelSpec.load("Qwen2.5-7B-Instruct")


def test_block_sizes_follow_the_engine(qwen: ModelSpec) -> None:
    sizes = {engine: plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=GIB, engine=engine)).block_size
             for engine in ("nano-vllm", "vllm", "sglang")}
    assert sizes == {"nano-vllm": 256, "vllm": 64, "sglang": 1}  # vLLM: its newest release, 0.34
    assert plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=GIB, engine="vllm", block_size=32)).block_size == 32
    older = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=GIB, engine="vllm", engine_version="0.33"))
    assert older.block_size == 16


def test_vllm_deducts_weights_activation_and_graphs_but_not_the_context(qwen: ModelSpec) -> None:
    result = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="vllm", activation_reserve_bytes=GIB,
                                            cudagraph_bytes=512 * MIB, seq_len=32_768, engine_version="0.33"))
    requested = math.ceil(80 * GIB * 0.92)                             # request_memory: ceil(total × util)
    assert (result.utilization, result.budget_bytes) == (0.92, requested)
    assert result.kv_budget_bytes == requested - WEIGHTS - GIB - 512 * MIB
    assert result.non_torch_bytes == 512 * MIB                      # shown, outside the budget
    assert result.kv_blocks == result.kv_budget_bytes // (16 * PER_TOKEN)
    assert result.startup_error is None


def test_vllm_refuses_to_start_when_the_context_does_not_fit_the_slack(qwen: ModelSpec) -> None:
    result = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=24 * GIB, engine="vllm", utilization=0.99,
                                            seqs=1, seq_len=1024, engine_version="0.33"))
    # total × (1 − 0.99) = 245.76 MiB of slack cannot hold the 512 MiB context
    assert result.startup_error is not None and "refuses to start" in result.startup_error
    assert (result.kv_blocks, result.fits) == (0, False)
    code = CliRunner().invoke(plan, ["--engine", "vllm", "--engine-version", "0.33", "--gpu-memory", "24GiB",
                                     "--utilization", "0.99"]).exit_code
    assert code == 1


def test_vllm_kv_cache_memory_bytes_replaces_the_rule(qwen: ModelSpec) -> None:
    result = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=10 * GIB, engine="vllm", engine_version="0.33"))
    assert result.kv_budget_bytes == 10 * GIB and result.kv_blocks == 10 * GIB // (16 * PER_TOKEN)
    # 0.34: the explicit size turns the extensible KV cache off; blocks of 64 tokens.
    newer = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=10 * GIB, engine="vllm", engine_version="0.34"))
    assert newer.kv_budget_bytes == 10 * GIB and newer.kv_blocks == 10 * GIB // (64 * PER_TOKEN)
    assert not newer.extensible_kv_cache


def test_vllm_cuda_graph_estimate(qwen: ModelSpec) -> None:
    sizes = vllm_capture_sizes(256, 2048)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-2:] == [496, 512]
    assert len(sizes) == 3 + len(range(8, 256, 8)) + len(range(256, 513, 16)) == 51
    # up to min(2 × 100, 512, 2048) = 200: the grid to 200, and 100 sequences in one decode step
    assert vllm_capture_sizes(100, 2048) == [1, 2, 4, *range(8, 97, 8), 100, *range(104, 201, 8)]
    # a token budget of 100 caps the sizes and is captured itself
    assert vllm_capture_sizes(256, 100) == [1, 2, 4, *range(8, 97, 8), 100]
    result = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=24 * GIB, engine="vllm"))
    decode = forward_activation_bytes(qwen, 512, 512, prefill=False, max_seq_len=1)
    assert result.cudagraph_bytes == decode + 51 * MIB
    # vLLM's profile run: 2,048 batched tokens over at most 256 sequences on a device under 70 GiB
    assert result.activation_reserve_bytes == forward_activation_bytes(qwen, 2048, 256, prefill=True)


def test_vllm_batch_defaults_follow_the_device_size() -> None:
    # EngineArgs.get_batch_defaults, OPENAI_API_SERVER: 24 GiB, an 80 GB H100, a 141 GB H200, a 180 GB B200
    for version in ("0.33", "0.34"):
        tiers = {gib: defaults("vllm", int(gib * GIB), version=version) for gib in (24, 80, 141e9 / GIB, 180e9 / GIB)}
        assert [(d.max_num_batched_tokens, d.max_num_seqs) for d in tiers.values()] == [
            (2_048, 256), (8_192, 1_024), (8_192, 1_024), (16_384, 1_024)]
    older = [defaults("vllm", gib * GIB, version="0.33") for gib in (24, 80, 180)]
    assert {(d.block_size, d.utilization) for d in older} == {(16, 0.92)}


def test_sglang_automatic_mem_fraction_static() -> None:
    # 24 GiB = 24,576 MB: chunked prefill 4,096, decode graphs up to 48; reserved = 512 + 6,144 + 128 + 96 MB
    assert sglang_mem_fraction_static(24 * GIB) == round((24_576 - 6_880) / 24_576, 3) == 0.72
    # 80 GiB: chunked prefill 8,192, graphs up to 256: 13,440 MB reserved (above the 10 GiB floor)
    assert sglang_mem_fraction_static(80 * GIB) == round((81_920 - 13_440) / 81_920, 3) == 0.836
    # TP 8 on 80 GiB: max_bs 512 and 1,024 MB for the parallel slack
    assert sglang_mem_fraction_static(80 * GIB, tp=8) == round((81_920 - 14_848) / 81_920, 3)


def test_sglang_static_fraction_covers_weights_and_the_pool(qwen: ModelSpec) -> None:
    result = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="sglang", seq_len=1000))
    before_load = 80 * GIB - 512 * MIB                                 # free after the context is created
    assert result.utilization == 0.836
    assert result.kv_budget_bytes == int(before_load * 0.836) - WEIGHTS
    assert result.kv_blocks == result.kv_budget_bytes // PER_TOKEN   # a pool of single tokens
    assert result.seq_kv_bytes == 1000 * PER_TOKEN                    # no block rounding
    given = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="sglang", utilization=0.9))
    assert given.kv_budget_bytes == int(before_load * 0.9) - WEIGHTS


def test_each_engine_prints_its_own_ledger() -> None:
    runner = CliRunner()
    text = {engine: runner.invoke(plan, ["--engine", engine, "--gpu-memory", "80GiB",
                                         *(["--engine-version", "0.33"] if engine == "vllm" else [])]).stdout
            for engine in ("nano-vllm", "vllm", "sglang")}
    assert "− non-PyTorch" in text["nano-vllm"] and "× utilization 0.9 " in text["nano-vllm"]
    assert "− CUDA graphs" in text["vllm"] and "· non-PyTorch" in text["vllm"]
    assert "outside the budget" in " ".join(text["vllm"].split())
    assert "× mem_fraction_static 0.836" in text["sglang"] and "· activation reserve" in text["sglang"]
    assert all(len(line) <= 80 for out in text.values() for line in out.splitlines())
    data = json.loads(runner.invoke(plan, ["--engine", "sglang", "--gpu-memory", "80GiB", "--json"]).stdout)
    assert [line["label"] for line in data["ledger"]][:3] == ["GPU memory", "non-PyTorch",
                                                              "mem_fraction_static 0.836"]


def test_vllm_0_34_extensible_kv_cache_keeps_the_margin_and_the_activation_peak_free(qwen: ModelSpec) -> None:
    """vLLM 0.34 by default (its extensible KV cache on CUDA): utilization resolves to 1.0, blocks of 64 tokens, and
    the cache gets what is measured free after capture, less max(1 GiB, 0.75 × activation) and the activation."""
    result = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="vllm", activation_reserve_bytes=GIB,
                                            cudagraph_bytes=512 * MIB, seq_len=32_768))
    assert (result.engine_version, result.extensible_kv_cache, result.utilization) == ("0.34", True, 1.0)
    assert result.budget_bytes == 80 * GIB and result.block_size == 64
    # free after capture: 80 GiB − 512 MiB context − weights − 512 MiB graphs; margin max(1 GiB, 768 MiB) = 1 GiB.
    # min(80 GiB − weights − 512 MiB, that free − 1 GiB) − 1 GiB of activation:
    assert result.kv_budget_bytes == 80 * GIB - 512 * MIB - WEIGHTS - 512 * MIB - GIB - GIB == 67_446_887_424
    assert result.kv_blocks == 67_446_887_424 // (64 * PER_TOKEN) == 18_377
    assert result.non_torch_bytes == 512 * MIB and result.startup_error is None
    labels = [(line.op, line.label) for line in result.ledger]
    assert labels == [("", "GPU memory"), ("−", "non-PyTorch"), ("−", "weights"), ("−", "CUDA graphs"),
                      ("−", "sizing margin"), ("−", "activation reserve"), ("=", "KV budget"),
                      ("·", "utilization 1")]
    # A larger activation peak sets the margin: 0.75 × 2 GiB.
    larger = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="vllm", activation_reserve_bytes=2 * GIB,
                                            cudagraph_bytes=512 * MIB))
    assert larger.kv_budget_bytes == 80 * GIB - 512 * MIB - WEIGHTS - 512 * MIB - 1536 * MIB - 2 * GIB


def test_vllm_0_34_a_utilization_given_caps_the_extensible_kv_cache(qwen: ModelSpec) -> None:
    """Utilization 0.5: ceil(40 GiB) less weights and graphs is below the measured free memory less the margin, so
    the share binds; memory outside PyTorch is then outside it and vLLM starts anyway (the share is only a cap)."""
    result = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="vllm", utilization=0.5,
                                            activation_reserve_bytes=GIB, cudagraph_bytes=512 * MIB))
    assert result.budget_bytes == 40 * GIB
    assert result.kv_budget_bytes == 40 * GIB - WEIGHTS - 512 * MIB - GIB
    assert [line.label for line in result.ledger if line.op == "·"] == ["non-PyTorch"]
    assert result.startup_error is None
    # Without the extensible cache 0.34 sizes as 0.33 did, with its own blocks: 0.92, the context in the slack.
    estimate = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="vllm", extensible_kv_cache=False,
                                              activation_reserve_bytes=GIB, cudagraph_bytes=512 * MIB))
    requested = math.ceil(80 * GIB * 0.92)
    assert (estimate.utilization, estimate.block_size, estimate.extensible_kv_cache) == (0.92, 64, False)
    assert estimate.kv_budget_bytes == requested - WEIGHTS - GIB - 512 * MIB


def test_vllm_0_34_extensible_kv_cache_that_holds_no_block_is_a_failed_start(qwen: ModelSpec) -> None:
    result = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=16 * GIB, engine="vllm", activation_reserve_bytes=GIB,
                                            cudagraph_bytes=512 * MIB))
    assert result.kv_budget_bytes == 16 * GIB - 512 * MIB - WEIGHTS - 512 * MIB - GIB - GIB < 0
    assert result.kv_blocks == 0 and "refuses to start" in (result.startup_error or "")


def test_engine_versions_the_planner_does_not_know_or_cannot_combine_are_refused(qwen: ModelSpec) -> None:
    for inputs, words in (
            (PlanInputs(gpu_memory_bytes=80 * GIB, engine="vllm", engine_version="0.32"), "not a release"),
            (PlanInputs(gpu_memory_bytes=80 * GIB, engine="vllm", engine_version="0.33", extensible_kv_cache=True),
             "no extensible KV cache"),
            (PlanInputs(kv_cache_memory_bytes=GIB, engine="vllm", extensible_kv_cache=True), "kv_cache_memory_bytes"),
            (PlanInputs(gpu_memory_bytes=80 * GIB, engine="sglang", engine_version="0.34"), "--engine vllm"),
            (PlanInputs(gpu_memory_bytes=80 * GIB, engine="nano-vllm", extensible_kv_cache=False), "--engine vllm")):
        with pytest.raises(UsageError, match=words):
            plan_capacity(qwen, inputs)
    assert plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="vllm",
                                          engine_version="v0.34.1")).engine_version == "0.34"
    assert plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="sglang")).engine_version is None


def test_the_cli_plans_the_release_it_is_told() -> None:
    runner = CliRunner()
    plans = {version: json.loads(runner.invoke(plan, ["--engine", "vllm", "--engine-version", version,
                                                      "--gpu-memory", "80GiB", "--json"]).stdout)
             for version in ("0.33.0", "0.34.0")}
    assert [(p["engine_version"], p["extensible_kv_cache"], p["block_size"], p["utilization"])
            for p in plans.values()] == [("0.33", False, 16, 0.92), ("0.34", True, 64, 1.0)]
    text = runner.invoke(plan, ["--engine", "vllm", "--gpu-memory", "80GiB", "--no-extensible-kv-cache"]).stdout
    assert text.splitlines()[0].startswith("plan for Qwen2.5-7B-Instruct (GQA) on vllm 0.34, per rank")
    text = runner.invoke(plan, ["--engine", "vllm", "--gpu-memory", "80GiB"]).stdout
    assert "on vllm 0.34, per rank" in text.splitlines()[0] and "− sizing margin" in text
    assert text.splitlines()[1].endswith("blocks of 64 tokens, extensible")
    assert all(len(line) <= 80 for line in text.splitlines())
    other = runner.invoke(plan, ["--engine", "sglang", "--gpu-memory", "80GiB"]).stdout.splitlines()
    assert other[0] == "plan for Qwen2.5-7B-Instruct (GQA) on sglang, per rank at tp 1, pp 1"
    assert other[1] == "weights bfloat16, KV cache bfloat16, blocks of 1 tokens"
    refused = runner.invoke(plan, ["--engine", "vllm", "--engine-version", "0.2", "--gpu-memory", "80GiB"])
    assert refused.exit_code == 2 and "not a release memwatch plans for" in refused.stderr


def test_vllm_0_34_extensible_ledger_lines_say_which_bound_binds(qwen: ModelSpec) -> None:
    """10 GiB, 1 GiB outside PyTorch, 2 GiB of weights, 512 MiB of graphs, 1 GiB of activation (a 1 GiB margin). At
    utilization 0.8 the share less weights and graphs, 5.5 GiB, equals the measured free memory less the margin: the
    measured memory is named as the bound. At 0.7 the share binds, 5.5 − 1 GiB less."""
    given = {"gpu_memory_bytes": 10 * GIB, "engine": "vllm", "weights_bytes": 2 * GIB, "non_torch_bytes": GIB,
             "cudagraph_bytes": 512 * MIB, "activation_reserve_bytes": GIB}
    tie = plan_capacity(qwen, PlanInputs(utilization=0.8, **given))
    lines = [(line.op, line.label, line.num_bytes, line.note) for line in tie.ledger]
    assert lines == [
        ("", "GPU memory", 10 * GIB, ""),
        ("−", "non-PyTorch", GIB, "given (--non-torch-bytes)"),
        ("−", "weights", 2 * GIB, "given (--weights-bytes)"),
        ("−", "CUDA graphs", 512 * MIB, "given (--cudagraph-bytes)"),
        ("−", "sizing margin", GIB, "max(1 GiB, 0.75 × activation reserve): kept free of the measured memory"),
        ("−", "activation reserve", GIB, "given (--activation-reserve-bytes)"),
        ("=", "KV budget", 4 * GIB + 512 * MIB, ""),
        ("·", "utilization 0.8", 8 * GIB, "the cap, not reached")]
    capped = plan_capacity(qwen, PlanInputs(utilization=0.7, **given))
    requested = math.ceil(10 * GIB * 0.7)
    lines = [(line.op, line.label, line.num_bytes, line.note) for line in capped.ledger]
    assert lines == [
        ("", "GPU memory", 10 * GIB, ""),
        ("×", "utilization 0.7", requested, "rounded up"),
        ("−", "weights", 2 * GIB, "given (--weights-bytes)"),
        ("−", "CUDA graphs", 512 * MIB, "given (--cudagraph-bytes)"),
        ("−", "activation reserve", GIB, "given (--activation-reserve-bytes)"),
        ("=", "KV budget", requested - 2 * GIB - 512 * MIB - GIB, ""),
        ("·", "non-PyTorch", GIB, "given (--non-torch-bytes); outside the share")]
    assert (capped.budget_bytes, capped.startup_error) == (requested, None)


def test_sglang_chunked_prefill_and_graph_batch_follow_the_device_tiers() -> None:
    """``handle_gpu_memory_settings``' tiers, at each edge (MiB of device memory) and each side of TP 4: under 20 GiB
    2,048 tokens and graphs to 8; under 35 GiB 4,096 and 48 (160 from TP 4); under 60 GiB 4,096 and 32 (160);
    under 160 GiB 8,192 and 256 (512); then 16,384 and 512. An unknown device gets 4,096 and 160."""
    def tier(mib: int, tp: int = 1) -> tuple[int, int]:
        rules = defaults("sglang", mib * MIB, tp)
        return rules.max_num_batched_tokens, rules.max_num_seqs

    assert [tier(mib) for mib in (20 * 1024 - 1, 20 * 1024, 35 * 1024 - 1, 35 * 1024, 60 * 1024 - 1, 60 * 1024,
                                  160 * 1024 - 1, 160 * 1024)] == [
        (2048, 8), (4096, 48), (4096, 48), (4096, 32), (4096, 32), (8192, 256), (8192, 256), (16384, 512)]
    assert [tier(mib, 3) for mib in (20 * 1024, 35 * 1024, 60 * 1024)] == [(4096, 48), (4096, 32), (8192, 256)]
    assert [tier(mib, 4) for mib in (20 * 1024 - 1, 20 * 1024, 35 * 1024, 60 * 1024, 160 * 1024)] == [
        (2048, 8), (4096, 160), (4096, 160), (8192, 512), (16384, 512)]
    rules = defaults("sglang", None)
    assert (rules.block_size, rules.utilization, rules.max_num_batched_tokens, rules.max_num_seqs) == (
        1, None, 4096, 160)


def test_sglang_reserved_memory_term_by_term() -> None:
    """``reserved = 512 + 1.5 × max(chunked, 2,048) + tp × pp / 8 × 1,024 + 2 × max_bs`` MB, at least 10 GiB only
    above 60 GiB; the fraction is ``(gpu − reserved) / gpu`` to 3 decimals."""
    # 16 GiB = 16,384 MB: chunked 2,048, graphs to 8: 512 + 3,072 + 128 + 16 = 3,728 → 12,656 / 16,384 = 0.77246.
    assert sglang_mem_fraction_static(16 * GIB) == 0.772
    # TP 2 × PP 2 on 16 GiB: + 512 − 128 MB: 4,112 → 0.74902; TP 4 alone also 512 MB.
    assert sglang_mem_fraction_static(16 * GIB, tp=2, pp=2) == sglang_mem_fraction_static(16 * GIB, tp=4) == 0.749
    # 60 GiB exactly (61,440 MB): chunked 8,192, graphs 256: 512 + 12,288 + 128 + 512 = 13,440, no floor → 0.78125.
    assert sglang_mem_fraction_static(60 * GIB) == round((61_440 - 13_440) / 61_440, 3) == 0.781
    # 100 GiB: the 13,440 MB reserved is above the 10,240 MB floor.
    assert sglang_mem_fraction_static(100 * GIB) == round((102_400 - 13_440) / 102_400, 3) == 0.869
    # 170 GiB: chunked 16,384, graphs 512: 512 + 24,576 + 128 + 1,024 = 26,240 MB.
    assert sglang_mem_fraction_static(170 * GIB) == round((174_080 - 26_240) / 174_080, 3) == 0.849


def test_each_engines_ledger_line_by_line(qwen: ModelSpec) -> None:
    """10 GiB at 0.5, 2 GiB of weights, 1 GiB of activation, 512 MiB outside PyTorch, 256 MiB of graphs, all given."""
    given = {"gpu_memory_bytes": 10 * GIB, "utilization": 0.5, "weights_bytes": 2 * GIB, "non_torch_bytes": 512 * MIB,
             "activation_reserve_bytes": GIB, "cudagraph_bytes": 256 * MIB}
    start = ("", "GPU memory", 10 * GIB, "")
    weights, activation = ("−", "weights", 2 * GIB, "given (--weights-bytes)"), (
        "−", "activation reserve", GIB, "given (--activation-reserve-bytes)")
    non_torch = ("−", "non-PyTorch", 512 * MIB, "given (--non-torch-bytes)")

    def lines(**inputs: object) -> list[tuple[str, str, int, str]]:
        plan_ = plan_capacity(qwen, PlanInputs(**{**given, **inputs}))  # type: ignore[arg-type]
        return [(line.op, line.label, line.num_bytes, line.note) for line in plan_.ledger]

    assert lines(engine="nano-vllm") == [start, ("×", "utilization 0.5", 5 * GIB, ""), non_torch, weights, activation,
                                         ("=", "KV budget", 5 * GIB - 512 * MIB - 3 * GIB, "")]
    assert lines(engine="vllm", engine_version="0.33") == [
        start, ("×", "utilization 0.5", 5 * GIB, "rounded up"), weights, activation,
        ("−", "CUDA graphs", 256 * MIB, "given (--cudagraph-bytes)"),
        ("=", "KV budget", 5 * GIB - 3 * GIB - 256 * MIB, ""),
        ("·", "non-PyTorch", 512 * MIB,
         "given (--non-torch-bytes); outside the budget, must fit in total × (1 − util) = 5,368,709,120 B")]
    assert lines(engine="sglang") == [
        start, non_torch, ("×", "mem_fraction_static 0.5", (10 * GIB - 512 * MIB) // 2, ""), weights,
        ("=", "KV budget", (10 * GIB - 512 * MIB) // 2 - 2 * GIB, ""),
        ("·", "activation reserve", GIB, "not deducted: runs in the (1 − mem_fraction_static) remainder")]
    # Memory outside PyTorch exactly filling total × (1 − util) still starts; a byte more does not.
    fits = plan_capacity(qwen, PlanInputs(**{**given, "non_torch_bytes": 5 * GIB}, engine="vllm",  # type: ignore[arg-type]
                                          engine_version="0.33"))
    over = plan_capacity(qwen, PlanInputs(**{**given, "non_torch_bytes": 5 * GIB + 1}, engine="vllm",  # type: ignore[arg-type]
                                          engine_version="0.33"))
    assert fits.startup_error is None and fits.budget_bytes == 5 * GIB
    assert "refuses to start" in (over.startup_error or "")


def test_defaults_at_the_tier_edges_and_unknown_engines() -> None:
    assert [(d.max_num_batched_tokens, d.max_num_seqs) for d in (
        defaults("vllm", 70 * GIB - 1), defaults("vllm", 70 * GIB), defaults("vllm", 160 * GIB - 1),
        defaults("vllm", 160 * GIB), defaults("vllm", None))] == [
        (2_048, 256), (8_192, 1_024), (8_192, 1_024), (16_384, 1_024), (2_048, 256)]
    assert defaults("nano-vllm", None) == defaults("nano-vllm", 80 * GIB)
    assert (defaults("nano-vllm", None).block_size, defaults("nano-vllm", None).max_num_seqs) == (256, 512)
    assert defaults("vllm", 80 * GIB).utilization == 0.92  # extensible only when asked
    for call in (lambda: defaults("tgi", 80 * GIB),
                 lambda: kv_budget("tgi", 80 * GIB, 0.9, weights=0, activation=0, non_torch=0, cudagraph=0,
                                   notes=dict.fromkeys(("weights", "activation", "non_torch", "cudagraph"), ""))):
        with pytest.raises(UsageError) as raised:
            call()
        assert str(raised.value) == "unknown engine 'tgi'; use one of nano-vllm, vllm, sglang"
