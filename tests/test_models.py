"""ModelSpec: loading configs, parameter counts, weight bytes and KV bytes, checked by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memwatch.errors import NotFoundError
from memwatch.models import ModelConfigError, ModelSpec, dtype_itemsize, shipped_models
from memwatch.models.spec import FULL_ATTENTION, SLIDING_ATTENTION

GIB = 2**30


@pytest.fixture(scope="module")
def qwen() -> ModelSpec:
    return ModelSpec.load("Qwen2.5-7B-Instruct")


# ------------------------------------------------------------------------------------------ loading


def test_shipped_models_cover_every_attention_kind() -> None:
    assert shipped_models() == [
        "DeepSeek-V2-Lite", "gemma-3-1b-it", "Llama-2-7b-hf", "Llama-3.1-8B-Instruct",
        "Mistral-7B-v0.1", "Qwen2.5-7B-Instruct", "Qwen3-0.6B",
    ]
    kinds = {name: ModelSpec.load(name).attention_kind for name in shipped_models()}
    assert kinds == {
        "DeepSeek-V2-Lite": "MLA", "gemma-3-1b-it": "MQA", "Llama-2-7b-hf": "MHA",
        "Llama-3.1-8B-Instruct": "GQA", "Mistral-7B-v0.1": "GQA", "Qwen2.5-7B-Instruct": "GQA",
        "Qwen3-0.6B": "GQA",
    }


def test_qwen_fields_come_from_the_public_config(qwen: ModelSpec) -> None:
    assert (qwen.name, qwen.hidden_size, qwen.num_attention_heads, qwen.num_hidden_layers) == (
        "Qwen2.5-7B-Instruct", 3584, 28, 28)
    assert (qwen.num_key_value_heads, qwen.head_dim, qwen.intermediate_size, qwen.vocab_size) == (
        4, 3584 // 28, 18944, 152064)
    assert (qwen.dtype, qwen.tie_word_embeddings, qwen.qkv_bias, qwen.o_bias) == (
        "bfloat16", False, True, False)
    # sliding_window is 131072 in the config but use_sliding_window is false: no layer slides.
    assert (qwen.layer_types, qwen.sliding_window, qwen.num_sliding_layers) == ((), None, 0)


@pytest.mark.parametrize("name", ["qwen2.5-7b-instruct", "Qwen/Qwen2.5-7B-Instruct", "QWEN2.5-7B-INSTRUCT",
                                  "Qwen2.5-7B-Instruct.json"])
def test_names_match_case_insensitively_with_an_organisation_prefix(name: str, qwen: ModelSpec) -> None:
    assert ModelSpec.load(name) == qwen


def test_a_config_file_and_a_directory_holding_one_load_alike(tmp_path: Path, qwen: ModelSpec) -> None:
    shipped = Path(__file__).parents[1] / "memwatch/models/configs/Qwen2.5-7B-Instruct.json"
    model_dir = tmp_path / "my-qwen"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(shipped.read_text())
    from_dir = ModelSpec.load(model_dir)
    from_file = ModelSpec.load(model_dir / "config.json")
    assert from_dir == from_file
    assert from_dir.name == "my-qwen"
    assert from_dir.num_parameters() == qwen.num_parameters()


def test_unknown_name_lists_the_shipped_models(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(NotFoundError) as info:
        ModelSpec.load("no-such-model")
    message = str(info.value)
    assert "unknown model 'no-such-model'" in message and str(tmp_path) in message
    assert all(name in message for name in shipped_models())
    assert info.value.exit_code == 3


def test_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"directory has no config\.json"):
        ModelSpec.load(tmp_path)


def test_missing_field_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                                "vocab_size": 100}))
    with pytest.raises(ModelConfigError, match="lacks 'intermediate_size'"):
        ModelSpec.load(path)


def test_malformed_json_and_bad_values_are_refused(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON at line 1"):
        ModelSpec.load(broken)
    with pytest.raises(ModelConfigError, match="hidden_size is 'big'; it must be a number from 0 to 1,048,576"):
        ModelSpec.from_config({"hidden_size": "big", "num_attention_heads": 4, "num_hidden_layers": 2,
                               "intermediate_size": 8, "vocab_size": 10})
    with pytest.raises(ModelConfigError, match="unsupported torch_dtype 'int4'"):
        ModelSpec.from_config({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                               "intermediate_size": 8, "vocab_size": 10, "torch_dtype": "int4"})


def test_multimodal_config_reads_its_text_config() -> None:
    spec = ModelSpec.from_config({
        "model_type": "gemma3", "torch_dtype": "bfloat16",
        "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "num_attention_heads": 8,
                        "num_key_value_heads": 4, "head_dim": 256, "num_hidden_layers": 34,
                        "intermediate_size": 10240, "vocab_size": 262208, "sliding_window": 1024,
                        "sliding_window_pattern": 6},
    }, name="gemma-3-4b-it")
    assert (spec.hidden_size, spec.head_dim, spec.dtype, spec.tie_word_embeddings) == (
        2560, 256, "bfloat16", True)
    assert spec.num_sliding_layers == 34 - 5  # layers 5, 11, 17, 23, 29 are global


def test_head_dim_explicit_or_derived() -> None:
    qwen3 = ModelSpec.load("Qwen3-0.6B")
    assert qwen3.head_dim == 128  # explicit; hidden 1024 / 16 heads would give 64
    llama = ModelSpec.load("Llama-2-7b-hf")
    assert llama.head_dim == 4096 // 32


def test_dtype_itemsize() -> None:
    assert [dtype_itemsize(d) for d in ("bf16", "bfloat16", "fp16", "float16", "torch.float16")] == [2] * 5
    assert [dtype_itemsize(d) for d in ("fp32", "float32")] == [4, 4]
    assert [dtype_itemsize(d) for d in ("fp8", "fp8_e4m3", "fp8_e5m2", "float8_e4m3fn")] == [1] * 4
    with pytest.raises(ModelConfigError, match="unknown dtype 'int3'"):
        dtype_itemsize("int3")


# ------------------------------------------------------------------------------------- parameters


def test_qwen_parameter_count_is_the_published_figure(qwen: ModelSpec) -> None:
    h, inter, vocab, layers, kv_dim = 3584, 18944, 152064, 28, 4 * 128
    embed = vocab * h                                   # 544,997,376
    attention = layers * (h * h + h                     # q_proj with bias
                          + 2 * (h * kv_dim + kv_dim)   # k_proj, v_proj with bias
                          + h * h)                      # o_proj, no bias
    mlp = layers * 3 * h * inter                        # gate, up, down
    norms = layers * 2 * h + h                          # two RMSNorms per layer + final norm
    lm_head = vocab * h                                 # untied
    assert qwen.parameter_breakdown() == {
        "embed_tokens": embed, "attention": attention, "mlp": mlp, "norms": norms, "lm_head": lm_head,
    }
    assert (embed, attention, mlp, norms) == (544_997_376, 822_212_608, 5_703_204_864, 204_288)
    assert qwen.num_parameters() == 7_615_616_512
    assert qwen.weight_bytes() == 7_615_616_512 * 2
    assert qwen.weight_bytes("float32") == 7_615_616_512 * 4


@pytest.mark.parametrize(("name", "published"), [
    ("Qwen3-0.6B", 596_049_920),            # tied embeddings, q/k norms
    ("Llama-3.1-8B-Instruct", 8_030_261_248),
    ("Llama-2-7b-hf", 6_738_415_616),
    ("Mistral-7B-v0.1", 7_241_732_096),
    ("gemma-3-1b-it", 999_885_952),         # tied, four norms per layer, q/k norms
])
def test_dense_parameter_counts(name: str, published: int) -> None:
    assert ModelSpec.load(name).num_parameters() == published


def test_mla_moe_parameter_count_by_hand() -> None:
    spec = ModelSpec.load("DeepSeek-V2-Lite")
    h, heads, layers = 2048, 16, 27
    attention = (h * heads * (128 + 64)          # q_proj (no q_lora_rank)
                 + h * (512 + 64)                # kv_a_proj_with_mqa
                 + 512 * heads * (128 + 128)     # kv_b_proj
                 + heads * 128 * h)              # o_proj
    dense_mlp = 3 * h * 10944                    # layer 0 (first_k_dense_replace = 1)
    moe_mlp = 64 * 3 * h * 1408 + 3 * h * 2 * 1408 + 64 * h   # routed + shared + router
    norms = layers * (2 * h + 512) + h
    embed = 102400 * h
    expected = 2 * embed + layers * attention + dense_mlp + (layers - 1) * moe_mlp + norms
    assert expected == 15_706_484_224
    assert spec.num_parameters() == expected


def test_weight_bytes_per_tp_rank(qwen: ModelSpec) -> None:
    h, layers = 3584, 28
    embed = (152064 // 2) * h                              # vocabulary-parallel
    attention = layers * (h * 128 * (2 * 14 + 2 * 2)       # 14 query heads and 2 KV heads per rank
                          + (14 + 2 * 2) * 128)            # their biases
    mlp = layers * 3 * h * (18944 // 2)
    norms = layers * 2 * h + h                             # replicated
    assert qwen.weight_bytes(tp=2) == (2 * embed + attention + mlp + norms) * 2


# ---------------------------------------------------------------------------------------------- KV


def test_qwen_kv_per_token_and_block(qwen: ModelSpec) -> None:
    # 2 (K and V) × 28 layers × 4 KV heads × 128 head_dim × 2 bytes
    assert qwen.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2 == 57_344
    assert qwen.kv_bytes_per_token() * 4 * 32_768 == 7 * GIB
    # nano-vllm: 2 × layers × block_size × (kv_heads // tp) × head_dim × itemsize
    assert qwen.block_bytes(256) == 2 * 28 * 256 * 4 * 128 * 2 == 14_680_064
    assert qwen.block_bytes(256, tp=4) == 14_680_064 // 4
    assert qwen.kv_bytes_per_token(kv_dtype="fp8") == 57_344 // 2


def test_tp_shards_kv_heads_and_replicates_past_their_count(qwen: ModelSpec) -> None:
    assert [qwen.kv_heads_per_rank(tp) for tp in (1, 2, 4, 28)] == [4, 2, 1, 1]
    assert qwen.kv_bytes_per_token(tp=2) == 2 * 28 * 2 * 128 * 2 == 28_672
    assert qwen.kv_bytes_per_token(tp=28) == 2 * 28 * 1 * 128 * 2 == 14_336  # one replicated head
    gemma = ModelSpec.load("gemma-3-1b-it")                    # a single KV head
    assert gemma.kv_bytes_per_token(tp=2) == gemma.kv_bytes_per_token(tp=1) == 2 * 26 * 1 * 256 * 2


def test_tp_that_does_not_divide_the_heads_is_refused(qwen: ModelSpec) -> None:
    with pytest.raises(ModelConfigError, match=r"size 8 does not divide the 28 query heads .* "
                                               r"use one of 1, 2, 4, 7, 14, 28"):
        qwen.kv_bytes_per_token(tp=8)
    with pytest.raises(ModelConfigError, match="cannot shard the 4 KV heads"):
        qwen.kv_bytes_per_token(tp=14)  # divides 28 query heads, but 14 is not a multiple of 4
    with pytest.raises(ModelConfigError, match="at least 1"):
        qwen.check_tp(0)


def test_mha_kv() -> None:
    llama = ModelSpec.load("Llama-2-7b-hf")
    assert llama.dtype == "float16"
    assert llama.kv_bytes_per_token() == 2 * 32 * 32 * 128 * 2 == 524_288
    assert llama.kv_bytes_per_token(tp=4) == 2 * 32 * 8 * 128 * 2


def test_mla_caches_one_latent_held_whole_by_every_rank() -> None:
    spec = ModelSpec.load("DeepSeek-V2-Lite")
    # 27 layers × (kv_lora_rank 512 + qk_rope_head_dim 64) × 2 bytes; no factor 2, no TP split
    assert spec.kv_bytes_per_token() == 27 * (512 + 64) * 2 == 31_104
    assert spec.kv_bytes_per_token(tp=2) == spec.kv_bytes_per_token(tp=16) == 31_104
    assert spec.block_bytes(64) == 64 * 31_104


def test_sliding_window_caps_each_sequence() -> None:
    mistral = ModelSpec.load("Mistral-7B-v0.1")
    per_token = 2 * 32 * 8 * 128 * 2                     # 131,072: every layer slides
    assert (mistral.sliding_window, mistral.num_sliding_layers) == (4096, 32)
    assert mistral.kv_bytes_per_token() == per_token
    assert mistral.kv_bytes_for_sequence(1000) == per_token * 1000
    assert mistral.kv_bytes_for_sequence(32_768) == per_token * 4096 == 512 * 2**20


def test_hybrid_full_and_sliding_layers() -> None:
    gemma = ModelSpec.load("gemma-3-1b-it")
    full_layers = [i for i, kind in enumerate(gemma.layer_types) if kind == FULL_ATTENTION]
    assert full_layers == [5, 11, 17, 23]                # (i + 1) % sliding_window_pattern(6) == 0
    per_layer = 2 * 1 * 256 * 2                          # 1 KV head × head_dim 256 × bf16, K and V
    assert gemma.kv_bytes_per_token_split() == (4 * per_layer, 22 * per_layer)
    # 4 full layers keep all 32,768 tokens; 22 sliding layers keep the last 512
    assert gemma.kv_bytes_for_sequence(32_768) == 4 * per_layer * 32_768 + 22 * per_layer * 512


def test_explicit_layer_types() -> None:
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
            "intermediate_size": 128, "vocab_size": 100, "torch_dtype": "float32", "sliding_window": 8}
    spec = ModelSpec.from_config({**base, "layer_types": [SLIDING_ATTENTION, FULL_ATTENTION,
                                                          SLIDING_ATTENTION]})
    per_layer = 2 * 2 * 16 * 4
    assert spec.kv_bytes_for_sequence(100) == per_layer * 100 + 2 * per_layer * 8
    with pytest.raises(ModelConfigError, match=r"unsupported layer types \['linear_attention'\]"):
        ModelSpec.from_config({**base, "layer_types": ["linear_attention"] * 3})
    with pytest.raises(ModelConfigError, match="lists 2 layers, num_hidden_layers is 3"):
        ModelSpec.from_config({**base, "layer_types": [FULL_ATTENTION] * 2})


def test_pipeline_parallel_counts_only_the_layers_of_the_busiest_rank(qwen: ModelSpec) -> None:
    assert [len(stage) for stage in qwen.pipeline_stages(3)] == [10, 9, 9]
    assert qwen.kv_bytes_per_token(pp=2) == 2 * 14 * 4 * 128 * 2
    assert qwen.kv_bytes_per_token(pp=3) == 2 * 10 * 4 * 128 * 2
    assert qwen.kv_bytes_per_token(tp=2, pp=2) == 2 * 14 * 2 * 128 * 2
    with pytest.raises(ModelConfigError, match="between 1 and 28"):
        qwen.pipeline_stages(29)


def test_block_size_must_be_positive(qwen: ModelSpec) -> None:
    with pytest.raises(ModelConfigError, match="block size must be at least 1"):
        qwen.block_bytes(0)
