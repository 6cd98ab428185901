"""The activation model: exact bytes for known shapes, the phase that dominates, eager scores."""

from __future__ import annotations

import pytest

from memwatch.errors import UsageError
from memwatch.models import ModelSpec, forward_activation_bytes, warmup_batch

GIB = 2**30


@pytest.fixture(scope="module")
def qwen() -> ModelSpec:
    return ModelSpec.load("Qwen2.5-7B-Instruct")


def test_qwen_warmup_prefill_of_16384_tokens(qwen: ModelSpec) -> None:
    h, inter, vocab, tokens = 3584, 18944, 152064, 16_384
    # MLP phase dominates: residual + normed + gate/up (2·I) + activated (I) + down, bf16
    mlp_phase = tokens * 2 * (h + h + 2 * inter + inter + h)
    logits = 1 * vocab * 4                                        # one fp32 row for the one sequence
    assert forward_activation_bytes(qwen, tokens, 1, prefill=True) == mlp_phase + logits == 2_215_200_768
    assert 1 * GIB < 2_215_200_768 < 4 * GIB


def test_tp_splits_the_mlp_width_but_not_the_residual(qwen: ModelSpec) -> None:
    h, inter, tokens = 3584, 18944, 4096
    expected = tokens * 2 * (3 * h + 3 * (inter // 2)) + 4 * 152064 * 4
    assert forward_activation_bytes(qwen, tokens, 4, prefill=True, tp=2) == expected


def test_attention_phase_wins_when_the_mlp_is_narrow() -> None:
    spec = ModelSpec.from_config({"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 8,
                                  "num_hidden_layers": 2, "intermediate_size": 16, "vocab_size": 10,
                                  "torch_dtype": "float32"})
    tokens = 100
    attention_phase = tokens * 4 * (64 + 64 + (8 + 2 * 8) * 8 + 8 * 8)   # fp32 elements
    mlp_phase = tokens * 4 * (3 * 64 + 3 * 16)
    assert attention_phase > mlp_phase
    assert forward_activation_bytes(spec, tokens, 2, prefill=True) == attention_phase + 2 * 10 * 4


def test_eager_prefill_materialises_square_scores(qwen: ModelSpec) -> None:
    h, inter, seqs, seq_len = 3584, 18944, 4, 4096
    tokens = seqs * seq_len
    scores = seqs * 28 * seq_len * seq_len * 4                     # per seq: heads × L × L × fp32
    attention_phase = tokens * 2 * (2 * h + (28 + 2 * 4) * 128 + 28 * 128) + scores
    logits = seqs * 152064 * 4
    assert scores == 7 * GIB
    assert forward_activation_bytes(qwen, tokens, seqs, prefill=True, attention="eager") == (
        attention_phase + logits)
    flash = forward_activation_bytes(qwen, tokens, seqs, prefill=True)
    assert flash == tokens * 2 * (3 * h + 3 * inter) + logits


def test_eager_decode_scores_are_one_row_per_head(qwen: ModelSpec) -> None:
    h, inter, seqs, context = 3584, 18944, 8, 4096
    scores = seqs * 28 * 1 * context * 4
    attention_phase = seqs * 2 * (2 * h + 36 * 128 + 28 * 128) + scores
    mlp_phase = seqs * 2 * (3 * h + 3 * inter)
    expected = max(attention_phase, mlp_phase) + seqs * 152064 * 4
    assert attention_phase > mlp_phase
    assert forward_activation_bytes(qwen, seqs, seqs, prefill=False, attention="eager",
                                    max_seq_len=context) == expected
    prefill_scores = 1 * 28 * context * context * 4
    assert prefill_scores // (scores // seqs) == context           # [L, L] against [1, L] per head


def test_mla_moe_shapes() -> None:
    spec = ModelSpec.load("DeepSeek-V2-Lite")
    h, tokens = 2048, 1000
    attention = 16 * (128 + 64) + (512 + 64) + 16 * (128 + 128) + 16 * 128
    width = max((6 + 2) * 1408, 10944)                             # routed + shared experts vs dense
    mlp_phase = tokens * 2 * (3 * h + 3 * width)
    assert mlp_phase > tokens * 2 * (2 * h + attention)
    assert forward_activation_bytes(spec, tokens, 1, prefill=True) == mlp_phase + 102400 * 4


def test_bad_inputs_are_refused(qwen: ModelSpec) -> None:
    with pytest.raises(UsageError, match="unknown attention implementation 'sdpa'"):
        forward_activation_bytes(qwen, 10, 1, prefill=True, attention="sdpa")
    with pytest.raises(UsageError, match="one token per sequence"):
        forward_activation_bytes(qwen, 10, 2, prefill=False)
    with pytest.raises(UsageError, match="at least one sequence"):
        forward_activation_bytes(qwen, 1, 2, prefill=True)
    with pytest.raises(UsageError, match="eager decode needs max_seq_len"):
        forward_activation_bytes(qwen, 2, 2, prefill=False, attention="eager")
    with pytest.raises(UsageError, match="does not divide the 28 query heads"):
        forward_activation_bytes(qwen, 10, 1, prefill=True, tp=8)


@pytest.mark.parametrize(("args", "expected"), [
    ((16_384, 4096, 512), (4, 4096)),        # nano-vllm defaults with a 4K model length
    ((16_384, 32_768, 512), (1, 16_384)),    # model length above the token budget
    ((16_384, 100, 3), (3, 100)),            # capped by max_num_seqs
])
def test_warmup_batch(args: tuple[int, int, int], expected: tuple[int, int]) -> None:
    assert warmup_batch(*args) == expected


def test_warmup_batch_refuses_zero() -> None:
    with pytest.raises(UsageError, match="at least 1"):
        warmup_batch(0, 4096, 1)
