"""The engines' rules at their edges: the profile batch vLLM runs, the graphs it captures, the release it is told,
SGLang's reserve to the megabyte. Activation bytes are worked by hand from :mod:`memwatch.models.activation`.

Qwen2.5-7B-Instruct in bf16 (hidden 3,584, 28 query heads, 4 KV heads, head_dim 128, MLP 18,944, vocabulary
152,064). The MLP phase is the larger one, so a forward of ``T`` tokens over ``S`` sequences peaks at
``T × 2 × (3 × 3,584 + 3 × W) + S × 152,064 × 4``: per token 135,168 B at TP 1 (W 18,944) and 78,336 B at TP 2
(W 9,472), per sequence 608,256 B of fp32 logits.
"""

from __future__ import annotations

import pytest

from memwatch.errors import UsageError
from memwatch.models import ModelSpec
from memwatch.plan import PlanInputs, plan_capacity
from memwatch.plan.engines import (
    EngineDefaults,
    LedgerLine,
    activation_bytes,
    defaults,
    kv_budget,
    sglang_mem_fraction_static,
    vllm_capture_sizes,
    vllm_cudagraph_bytes,
    vllm_release,
)

GIB, MIB = 2**30, 2**20
PER_TOKEN_TP1 = 2 * (3 * 3584 + 3 * 18_944)
PER_TOKEN_TP2 = 2 * (3 * 3584 + 3 * 9472)
LOGITS = 152_064 * 4


@pytest.fixture(scope="module")
def qwen() -> ModelSpec:
    return ModelSpec.load("Qwen2.5-7B-Instruct")


def test_the_hand_worked_per_token_and_per_sequence_bytes() -> None:
    assert (PER_TOKEN_TP1, PER_TOKEN_TP2, LOGITS) == (135_168, 78_336, 608_256)
    # The attention phase is smaller at both: 2 × (2 × 3,584 + (28 + 8) × 128 + 28 × 128) = 30,720 B a token at
    # TP 1, 2 × (7,168 + (14 + 4) × 128 + 14 × 128) = 22,528 B at TP 2.
    assert 2 * (2 * 3584 + 36 * 128 + 28 * 128) == 30_720 < PER_TOKEN_TP1
    assert 2 * (2 * 3584 + 18 * 128 + 14 * 128) == 22_528 < PER_TOKEN_TP2


def test_vllm_profiles_its_token_budget_over_at_most_that_many_sequences(qwen: ModelSpec) -> None:
    """vLLM's profile run: ``max_num_batched_tokens`` tokens over ``min(max_num_seqs, tokens)`` sequences, at
    least one; each rank's share of the MLP at TP 2."""
    assert activation_bytes("vllm", qwen, 1, 2048, None, 256) == 2048 * 135_168 + 256 * 608_256 == 432_537_600
    assert activation_bytes("vllm", qwen, 2, 2048, None, 256) == 2048 * 78_336 + 256 * 608_256 == 316_145_664
    # One sequence allowed: one row of logits, whatever the token budget.
    assert activation_bytes("vllm", qwen, 1, 2048, None, 1) == 2048 * 135_168 + 608_256 == 277_432_320
    # More sequences allowed than tokens: one token each, 100 rows of logits.
    assert activation_bytes("vllm", qwen, 1, 100, None, 256) == 100 * (135_168 + 608_256) == 74_342_400


def test_nano_vllm_warms_up_on_sequences_of_the_model_length(qwen: ModelSpec) -> None:
    """nano-vllm's warmup: ``seq_len = min(tokens, max_model_len)``, ``num_seqs = min(tokens // seq_len,
    max_num_seqs)``; without a model length the one sequence takes the whole token budget."""
    # 16,384 tokens as 4 sequences of 4,096: 4 rows of logits.
    assert activation_bytes("nano-vllm", qwen, 1, 16_384, 4096, 512) == 16_384 * 135_168 + 4 * 608_256
    assert 16_384 * 135_168 + 4 * 608_256 == 2_217_025_536
    assert activation_bytes("nano-vllm", qwen, 1, 16_384, None, 512) == 16_384 * 135_168 + 608_256 == 2_215_200_768
    assert activation_bytes("nano-vllm", qwen, 2, 16_384, None, 512) == 16_384 * 78_336 + 608_256 == 1_284_065_280
    # At most max_num_seqs of them: 2 sequences of 4,096 tokens.
    assert activation_bytes("nano-vllm", qwen, 1, 16_384, 4096, 2) == 8192 * 135_168 + 2 * 608_256


def test_vllm_graph_estimate_is_each_ranks_largest_decode_plus_a_mib_a_graph(qwen: ModelSpec) -> None:
    """256 sequences and 2,048 tokens capture 51 sizes up to 512: a decode of 512 sequences at TP 2, one token
    each, is 512 × (78,336 + 608,256) B, and 51 MiB more for the graphs."""
    assert vllm_cudagraph_bytes(qwen, 2, 256, 2048) == 512 * (78_336 + 608_256) + 51 * MIB == 405_012_480


def test_capture_sizes_stop_at_512_and_take_the_batch_limits_below_it() -> None:
    # 513 sequences would be 1,026 at twice the sequences: the ceiling of 512 holds, and 513 is above it.
    sizes = vllm_capture_sizes(513, 8192)
    assert sizes[-3:] == [480, 496, 512] and len(sizes) == 3 + 31 + 17 and 513 not in sizes
    # 3 sequences and 6 tokens: up to min(6, 512, 6) = 6, both limits captured.
    assert vllm_capture_sizes(3, 6) == [1, 2, 3, 4, 6]
    assert vllm_capture_sizes(1, 1) == [1]


def test_an_unknown_release_names_the_ones_planned_for() -> None:
    assert (vllm_release(None), vllm_release("0.33.2"), vllm_release("v0.34")) == ("0.34", "0.33", "0.34")
    with pytest.raises(UsageError) as raised:
        vllm_release("0.32.1")
    assert str(raised.value) == "vLLM '0.32.1' is not a release memwatch plans for; use one of 0.33, 0.34"


def test_every_default_of_each_engine() -> None:
    assert defaults("nano-vllm", None) == EngineDefaults(256, 0.9, 16_384, 512)
    assert defaults("vllm", None, version="0.34", extensible=True) == EngineDefaults(64, 1.0, 2048, 256)
    assert defaults("vllm", 80 * GIB, version="0.34") == EngineDefaults(64, 0.92, 8192, 1024)
    assert defaults("vllm", 200 * GIB, version="0.33", extensible=True) == EngineDefaults(16, 0.92, 16_384, 1024)
    assert defaults("sglang", 80 * GIB, tp=4) == EngineDefaults(1, None, 8192, 512)


def test_sglang_reserve_to_the_megabyte_at_a_rounding_edge() -> None:
    """Under 20 GiB: ``512 + 1.5 × 2,048 + 1 × 1 / 8 × 1,024 + 2 × 8 = 3,728`` MB reserved. On a device of
    6,400.1 MiB the fraction ``1 − 3,728 / 6,400.1 = 0.417509…`` is just above the edge of 0.4175, so it rounds to
    0.418; a reserve larger by an eighth of a megabyte (3,728.125) would round it to 0.417."""
    device = 6400 * MIB + MIB // 10
    assert round(1 - 3728 / (device / MIB), 6) == 0.417509 and round(1 - 3728.125 / (device / MIB), 6) == 0.41749
    assert sglang_mem_fraction_static(device) == 0.418


def test_sglang_automatic_fraction_says_where_it_comes_from(qwen: ModelSpec) -> None:
    auto = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="sglang"))
    [line] = [line for line in auto.ledger if line.op == "×"]
    assert (line.label, line.note) == ("mem_fraction_static 0.836", "SGLang's automatic value for this device")


def test_every_engines_ledger_starts_at_the_device_with_its_note() -> None:
    """The device line carries what the caller says of the device (``notes["gpu"]``), under every rule."""
    notes = {"gpu": "NVIDIA H100 80GB HBM3, as read", "weights": "", "activation": "", "non_torch": "",
             "cudagraph": ""}
    for engine, extensible in (("nano-vllm", False), ("vllm", False), ("vllm", True), ("sglang", False)):
        split = kv_budget(engine, 80 * GIB, 0.9, weights=GIB, activation=GIB, non_torch=GIB, cudagraph=GIB,
                          notes=notes, extensible=extensible)
        assert split.lines[0] == LedgerLine("", "GPU memory", 80 * GIB, "NVIDIA H100 80GB HBM3, as read"), engine


def test_each_rules_budget_and_kv_bytes_as_its_engine_sizes_them() -> None:
    """10 GiB at 0.5, 512 MiB outside PyTorch, 2 GiB of weights, 1 GiB of activation, 256 MiB of graphs. SGLang's
    budget is its fraction of what the device had before the weights: (10 GiB − 512 MiB) / 2 = 4.75 GiB. vLLM
    unless told otherwise is its 0.33 rule: ceil(10 GiB × 0.5) less weights, activation and graphs."""
    notes = dict.fromkeys(("weights", "activation", "non_torch", "cudagraph"), "")
    terms = {"weights": 2 * GIB, "activation": GIB, "non_torch": 512 * MIB, "cudagraph": 256 * MIB, "notes": notes}
    sglang = kv_budget("sglang", 10 * GIB, 0.5, **terms)  # type: ignore[arg-type]
    assert (sglang.budget_bytes, sglang.kv_budget_bytes) == (4864 * MIB, 4864 * MIB - 2 * GIB)
    vllm = kv_budget("vllm", 10 * GIB, 0.5, **terms)  # type: ignore[arg-type]
    assert (vllm.budget_bytes, vllm.kv_budget_bytes) == (5 * GIB, 5 * GIB - 3 * GIB - 256 * MIB)
    # Here the extensible cache would give the same bytes (its share binds); what tells the rules apart is that the
    # memory outside PyTorch must fit beside the budget, which vLLM checks before it starts.
    assert vllm.lines[-1] == LedgerLine("·", "non-PyTorch", 512 * MIB,
                                        "; outside the budget, must fit in total × (1 − util) = 5,368,709,120 B")
    nano = kv_budget("nano-vllm", 10 * GIB, 0.5, **terms)  # type: ignore[arg-type]
    assert (nano.budget_bytes, nano.kv_budget_bytes) == (5 * GIB, 5 * GIB - 512 * MIB - 3 * GIB)
