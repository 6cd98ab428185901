"""MoE experts, multimodal vision towers and hybrid non-attention layers, from published configs.

As in ``test_model_families.py``: the KV bytes per token by hand, the weights against the published
parameter count or the tensors of the checkpoint's own names and shapes.
"""

from __future__ import annotations

import pytest
from checkpoint_shapes import Shapes, parameters, per_layer

from memwatch.models import ModelConfigError, ModelSpec


def test_mixtral_expert_weights() -> None:
    config = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
              "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    spec = ModelSpec.from_config(config, "Mixtral-8x7B")
    assert spec.num_parameters() == 46_702_792_704                     # Mixtral 8x7B: 46.7 B
    assert spec.weight_bytes() == 46_702_792_704 * 2                   # bfloat16
    breakdown = spec.parameter_breakdown()
    assert breakdown["mlp"] == 32 * (8 * 3 * 4096 * 14336 + 8 * 4096)  # experts and router
    assert spec.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2


def test_qwen2_moe_shared_expert_and_sparse_step() -> None:
    config = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
              "num_key_value_heads": 16, "num_hidden_layers": 24, "num_experts": 60, "num_experts_per_tok": 4,
              "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
              "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    spec = ModelSpec.from_config(config, "Qwen1.5-MoE-A2.7B")
    h = 2048
    layer = (3 * h * h + 3 * h                                          # q, k, v with bias
             + h * h                                                   # o
             + 60 * 3 * h * 1408 + 3 * h * 5632                        # routed experts, shared expert
             + 60 * h + h                                              # router, shared expert gate
             + 2 * h)                                                  # norms
    assert spec.num_parameters() == 24 * layer + 2 * 151936 * h + h
    assert spec.weight_bytes() == (24 * layer + 2 * 151936 * h + h) * 2
    assert round(spec.num_parameters() / 1e9, 1) == 14.3               # Qwen1.5-MoE-A2.7B: 14.3 B total
    assert spec.kv_bytes_per_token() == 2 * 24 * 16 * 128 * 2


def test_llava_counts_the_vision_tower_and_projector() -> None:
    config = {"model_type": "llava", "projector_hidden_act": "gelu", "torch_dtype": "float16",
              "text_config": {"model_type": "llama", "vocab_size": 32064, "max_position_embeddings": 4096,
                              "torch_dtype": "float16"},
              "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336,
                                "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
                                "patch_size": 14, "projection_dim": 768}}
    tensors: Shapes = {"vision_tower.vision_model.embeddings.class_embedding": (1024,),
                       "vision_tower.vision_model.embeddings.patch_embedding.weight": (1024, 3, 14, 14),
                       "vision_tower.vision_model.embeddings.position_embedding.weight": (577, 1024),
                       "vision_tower.vision_model.pre_layrnorm.weight": (1024,),
                       "vision_tower.vision_model.pre_layrnorm.bias": (1024,),
                       "vision_tower.vision_model.post_layernorm.weight": (1024,),
                       "vision_tower.vision_model.post_layernorm.bias": (1024,),
                       "multi_modal_projector.linear_1.weight": (4096, 1024),
                       "multi_modal_projector.linear_1.bias": (4096,),
                       "multi_modal_projector.linear_2.weight": (4096, 4096),
                       "multi_modal_projector.linear_2.bias": (4096,)}
    projection = {f"self_attn.{p}_proj.{kind}": (1024, 1024) if kind == "weight" else (1024,)
                  for p in "qkvo" if p != "o" for kind in ("weight", "bias")}
    projection |= {"self_attn.out_proj.weight": (1024, 1024), "self_attn.out_proj.bias": (1024,)}
    tensors |= per_layer("vision_tower.vision_model.encoder.layers", 24, {
        **projection, "layer_norm1.weight": (1024,), "layer_norm1.bias": (1024,),
        "mlp.fc1.weight": (4096, 1024), "mlp.fc1.bias": (4096,), "mlp.fc2.weight": (1024, 4096),
        "mlp.fc2.bias": (1024,), "layer_norm2.weight": (1024,), "layer_norm2.bias": (1024,)})
    spec = ModelSpec.from_config(config, "llava-1.5-7b-hf")
    llama2_7b = 6_738_415_616 + 64 * 4096 * 2                          # Llama-2-7B with 64 more vocabulary rows
    assert spec.parameter_breakdown()["vision"] == parameters(tensors)
    assert spec.num_parameters() == llama2_7b + parameters(tensors)
    assert round(spec.num_parameters() / 1e9, 2) == 7.06               # llava-1.5-7b-hf: 7.06 B
    assert spec.kv_bytes_per_token() == 2 * 32 * 32 * 128 * 2          # the text model's KV only


def test_qwen2_5_vl_counts_its_own_vision_tower_and_merger() -> None:
    config = {"model_type": "qwen2_5_vl", "hidden_size": 3584, "intermediate_size": 18944,
              "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                                "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                                "spatial_merge_size": 2, "spatial_patch_size": 14, "temporal_patch_size": 2}}
    tensors: Shapes = {"visual.patch_embed.proj.weight": (1280, 3, 2, 14, 14), "visual.merger.ln_q.weight": (1280,),
                       "visual.merger.mlp.0.weight": (5120, 5120), "visual.merger.mlp.0.bias": (5120,),
                       "visual.merger.mlp.2.weight": (3584, 5120), "visual.merger.mlp.2.bias": (3584,)}
    tensors |= per_layer("visual.blocks", 32, {
        "norm1.weight": (1280,), "norm2.weight": (1280,), "attn.qkv.weight": (3840, 1280), "attn.qkv.bias": (3840,),
        "attn.proj.weight": (1280, 1280), "attn.proj.bias": (1280,), "mlp.gate_proj.weight": (3420, 1280),
        "mlp.gate_proj.bias": (3420,), "mlp.up_proj.weight": (3420, 1280), "mlp.up_proj.bias": (3420,),
        "mlp.down_proj.weight": (1280, 3420), "mlp.down_proj.bias": (1280,)})
    spec = ModelSpec.from_config(config, "Qwen2.5-VL-7B-Instruct")
    assert spec.parameter_breakdown()["vision"] == parameters(tensors)
    assert spec.num_parameters() == 7_615_616_512 + parameters(tensors)   # Qwen2.5-7B's text model
    assert round(spec.num_parameters() / 1e9, 2) == 8.29               # Qwen2.5-VL-7B-Instruct: 8.29 B
    assert spec.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2


def test_qwen2_vl_tower_with_layernorms_and_a_two_matrix_mlp() -> None:
    vision = {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3, "hidden_size": 3584,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    spec = ModelSpec.from_config({"model_type": "qwen2_vl", "hidden_size": 3584, "intermediate_size": 18944,
                                  "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
                                  "vocab_size": 152064, "vision_config": vision})
    block = 2 * 2 * 1280 + (3840 * 1280 + 3840) + (1280 * 1280 + 1280) + (5120 * 1280 + 5120) + (1280 * 5120 + 1280)
    merger = 2 * 1280 + 5120 * 5120 + 5120 + 3584 * 5120 + 3584
    assert spec.parameter_breakdown()["vision"] == 3 * 2 * 14 * 14 * 1280 + 32 * block + merger
    assert round(spec.num_parameters() / 1e9, 2) == 8.29               # Qwen2-VL-7B-Instruct: 8.29 B


def test_an_unknown_vision_tower_is_named_as_not_counted() -> None:
    from memwatch.plan import PlanInputs, plan_capacity

    config = {"model_type": "mystery_vlm", "vision_config": {"model_type": "mystery_vision", "width": 1024},
              "text_config": {"model_type": "llama", "torch_dtype": "bfloat16"}}
    spec = ModelSpec.from_config(config, "mystery")
    assert spec.parameter_breakdown().get("vision", 0) == 0
    plan = plan_capacity(spec, PlanInputs(kv_cache_memory_bytes=2**30))
    assert "the vision tower (mystery_vision) is not counted" in plan.weights_source


JAMBA = {"model_type": "jamba", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
         "num_key_value_heads": 8, "num_hidden_layers": 32, "num_experts": 16, "num_experts_per_tok": 2,
         "expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 8, "attn_layer_offset": 4,
         "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 256,
         "mamba_conv_bias": True, "mamba_proj_bias": False, "vocab_size": 65536, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16"}


def test_jamba_hybrid_caches_kv_only_in_its_attention_layers() -> None:
    spec = ModelSpec.from_config(JAMBA, "Jamba-v0.1")
    assert spec.attention_layers == (4, 12, 20, 28)
    assert spec.kv_bytes_per_token() == 4 * 2 * 8 * 128 * 2            # 4 attention layers of 32
    # 28 Mamba layers: conv window d_inner × (d_conv − 1) and SSM state d_inner × d_state, bf16
    assert spec.state_bytes_per_sequence() == 28 * 8192 * (3 + 16) * 2
    mamba = (4096 * 16384 + 8192 * 4 + 8192 + 8192 * (256 + 32) + 256 * 8192 + 8192   # in, conv, x, dt
             + 8192 * 16 + 8192 + 8192 * 4096 + 256 + 16 + 16)                            # A, D, out, norms
    assert spec.parameter_breakdown()["mixer"] == 28 * mamba
    assert round(spec.num_parameters() / 1e9, 1) == 51.6               # Jamba-v0.1: 51.6 B


def test_plan_of_a_hybrid_adds_the_state_of_each_sequence() -> None:
    from memwatch.plan import PlanInputs, plan_capacity

    spec = ModelSpec.from_config(JAMBA, "Jamba-v0.1")
    plan = plan_capacity(spec, PlanInputs(kv_cache_memory_bytes=2**30, seqs=2, seq_len=1024))
    state = 28 * 8192 * 19 * 2
    assert plan.state_bytes_per_seq == state
    assert plan.ideal_seq_kv_bytes == 1024 * 16_384 + state
    assert plan.seq_kv_bytes == 4 * 256 * 16_384 + state  # 1,024 tokens fill 4 blocks of 256: no rounding up
    assert "28 of 32 layers are mamba mixers: no per-token KV" in plan.state_note


def test_a_hybrids_state_keeps_the_model_precision_under_an_fp8_kv_cache() -> None:
    """The KV dtype is the attention layers' alone: vLLM sizes the Mamba conv and SSM state in ``mamba_cache_dtype``,
    whose "auto" is the model's dtype (``vllm/config/cache.py``), never ``--kv-cache-dtype``. Jamba with fp8 KV: 4
    attention layers × 2 × 8 heads × 128 × 1 B = 8,192 B a token; the 28 Mamba layers' state stays bf16."""
    from memwatch.plan import PlanInputs, plan_capacity

    spec = ModelSpec.from_config(JAMBA, "Jamba-v0.1")
    plan = plan_capacity(spec, PlanInputs(kv_cache_memory_bytes=2**30, kv_dtype="fp8", seqs=2, seq_len=1024))
    state = 28 * 8192 * 19 * 2
    assert (plan.kv_bytes_per_token, plan.state_bytes_per_seq) == (8192, state)
    assert plan.ideal_seq_kv_bytes == plan.seq_kv_bytes == 1024 * 8192 + state
    assert f"a fixed state of {state:,} B per sequence" in plan.state_note
    # Run in float32 (``--dtype``), the state is float32 too: twice the bf16 bytes.
    wide = plan_capacity(spec, PlanInputs(kv_cache_memory_bytes=2**30, dtype="fp32", kv_dtype="fp8"))
    assert (wide.kv_bytes_per_token, wide.state_bytes_per_seq) == (8192, 2 * state)


def test_unknown_layer_kinds_are_refused() -> None:
    config = {"model_type": "qwen3_next", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
              "intermediate_size": 128, "vocab_size": 100, "layer_types": ["linear_attention", "full_attention"]}
    with pytest.raises(ModelConfigError, match="unsupported layer types"):
        ModelSpec.from_config(config, "tiny")
