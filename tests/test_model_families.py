"""Config families with their own field names, from published configs (MoE, multimodal and hybrid models:
``test_model_moe_vision_hybrid.py``).

Each test feeds the published ``config.json`` fields of one model and checks the KV bytes per token by
hand and the weights against an independent count: the published parameter count, and a safetensors
index built here from the checkpoint's own tensor names and shapes (``total_size`` = Σ elements ×
itemsize), which is what the checkpoint's ``model.safetensors.index.json`` records.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import pytest
from checkpoint_shapes import Shapes, parameters, per_layer, safetensors_index

from memwatch.models import ModelConfigError, ModelSpec
from memwatch.models.families import normalize


def check(config: Mapping[str, object], tensors: Shapes, itemsize: int) -> ModelSpec:
    spec = ModelSpec.from_config(config, "model")
    index = safetensors_index(tensors, itemsize)
    assert spec.num_parameters() == parameters(tensors)
    assert spec.weight_bytes() == index["metadata"]["total_size"]  # type: ignore[index]
    return spec


RELEASED = Path(__file__).resolve().parents[1] / ".engines" / "vllm"


def attribute_map(path: str) -> dict[str, str]:
    """The ``attribute_map`` of the config class in a released file (Transformers', or vLLM's own)."""
    if not (RELEASED / ".installed").exists():
        pytest.fail(f"the released engines are not installed in {RELEASED}: run `make engines`")
    tree = ast.parse((RELEASED / path).read_text(encoding="utf-8"))
    return next(ast.literal_eval(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and any(getattr(target, "id", "") == "attribute_map" for target in node.targets))


@pytest.mark.parametrize(("model_type", "path"), [
    ("gpt2", "transformers/models/gpt2/configuration_gpt2.py"),
    ("gpt_bigcode", "transformers/models/gpt_bigcode/configuration_gpt_bigcode.py"),
    ("gptj", "transformers/models/gptj/configuration_gptj.py"),
    ("bloom", "transformers/models/bloom/configuration_bloom.py"),
    ("mpt", "transformers/models/mpt/configuration_mpt.py"),
    ("falcon", "vllm/transformers_utils/configs/falcon.py"),          # RWConfig: Falcon's first configs
])
def test_every_alias_of_the_released_config_class_is_read(model_type: str, path: str) -> None:
    aliases = attribute_map(path)
    config = normalize({"model_type": model_type, **{alias: 1000 + i for i, alias in enumerate(aliases.values())}})
    assert {canonical: config.get(canonical) for canonical in aliases} == {
        canonical: 1000 + i for i, canonical in enumerate(aliases)}


def test_gpt2_names_learned_positions_and_conv1d_biases() -> None:
    config = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
              "n_ctx": 1024, "n_inner": None, "vocab_size": 50257, "activation_function": "gelu_new"}
    tensors: Shapes = {"wte.weight": (50257, 768), "wpe.weight": (1024, 768), "ln_f.weight": (768,),
                       "ln_f.bias": (768,)}
    tensors |= per_layer("h", 12, {
        "ln_1.weight": (768,), "ln_1.bias": (768,), "attn.c_attn.weight": (768, 2304), "attn.c_attn.bias": (2304,),
        "attn.c_proj.weight": (768, 768), "attn.c_proj.bias": (768,), "ln_2.weight": (768,), "ln_2.bias": (768,),
        "mlp.c_fc.weight": (768, 3072), "mlp.c_fc.bias": (3072,), "mlp.c_proj.weight": (3072, 768),
        "mlp.c_proj.bias": (768,)})
    spec = check(config, tensors, 4)                                   # no torch_dtype: float32
    assert spec.num_parameters() == 124_439_808                        # gpt2's published count
    assert spec.kv_bytes_per_token() == 2 * 12 * 12 * 64 * 4
    assert spec.tie_word_embeddings and spec.attention_kind == "MHA"


def test_starcoder_gpt_bigcode_multi_query() -> None:
    config = {"model_type": "gpt_bigcode", "n_embd": 6144, "n_head": 48, "n_layer": 40, "n_positions": 8192,
              "n_inner": 24576, "multi_query": True, "vocab_size": 49152, "torch_dtype": "float32"}
    tensors: Shapes = {"transformer.wte.weight": (49152, 6144), "transformer.wpe.weight": (8192, 6144),
                       "transformer.ln_f.weight": (6144,), "transformer.ln_f.bias": (6144,)}
    tensors |= per_layer("transformer.h", 40, {
        "ln_1.weight": (6144,), "ln_1.bias": (6144,), "attn.c_attn.weight": (6144 + 2 * 128, 6144),
        "attn.c_attn.bias": (6144 + 2 * 128,), "attn.c_proj.weight": (6144, 6144), "attn.c_proj.bias": (6144,),
        "ln_2.weight": (6144,), "ln_2.bias": (6144,), "mlp.c_fc.weight": (24576, 6144), "mlp.c_fc.bias": (24576,),
        "mlp.c_proj.weight": (6144, 24576), "mlp.c_proj.bias": (6144,)})
    spec = check(config, tensors, 4)
    assert round(spec.num_parameters() / 1e9, 1) == 15.5               # StarCoder: 15.5 B
    assert spec.attention_kind == "MQA" and spec.kv_bytes_per_token() == 2 * 40 * 1 * 128 * 4


def test_gpt_neox_pythia_160m() -> None:
    config = {"model_type": "gpt_neox", "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
              "num_hidden_layers": 12, "vocab_size": 50304, "tie_word_embeddings": False,
              "use_parallel_residual": True, "rotary_pct": 0.25, "torch_dtype": "float16"}
    tensors: Shapes = {"gpt_neox.embed_in.weight": (50304, 768), "embed_out.weight": (50304, 768),
                       "gpt_neox.final_layer_norm.weight": (768,), "gpt_neox.final_layer_norm.bias": (768,)}
    tensors |= per_layer("gpt_neox.layers", 12, {
        "input_layernorm.weight": (768,), "input_layernorm.bias": (768,),
        "post_attention_layernorm.weight": (768,), "post_attention_layernorm.bias": (768,),
        "attention.query_key_value.weight": (2304, 768), "attention.query_key_value.bias": (2304,),
        "attention.dense.weight": (768, 768), "attention.dense.bias": (768,),
        "mlp.dense_h_to_4h.weight": (3072, 768), "mlp.dense_h_to_4h.bias": (3072,),
        "mlp.dense_4h_to_h.weight": (768, 3072), "mlp.dense_4h_to_h.bias": (768,)})
    spec = check(config, tensors, 2)
    assert spec.num_parameters() == 162_322_944                        # Pythia's table: 160M total params
    assert spec.kv_bytes_per_token() == 2 * 12 * 12 * 64 * 2


def test_gptj_6b_untied_head_with_bias_and_one_norm_per_layer() -> None:
    config = {"model_type": "gptj", "n_embd": 4096, "n_head": 16, "n_layer": 28, "n_positions": 2048,
              "rotary_dim": 64, "vocab_size": 50400, "torch_dtype": "float16"}
    tensors: Shapes = {"transformer.wte.weight": (50400, 4096), "lm_head.weight": (50400, 4096),
                       "lm_head.bias": (50400,), "transformer.ln_f.weight": (4096,), "transformer.ln_f.bias": (4096,)}
    tensors |= per_layer("transformer.h", 28, {
        "ln_1.weight": (4096,), "ln_1.bias": (4096,), "attn.q_proj.weight": (4096, 4096),
        "attn.k_proj.weight": (4096, 4096), "attn.v_proj.weight": (4096, 4096), "attn.out_proj.weight": (4096, 4096),
        "mlp.fc_in.weight": (16384, 4096), "mlp.fc_in.bias": (16384,), "mlp.fc_out.weight": (4096, 16384),
        "mlp.fc_out.bias": (4096,)})
    spec = check(config, tensors, 2)
    assert round(spec.num_parameters() / 1e9, 2) == 6.05               # "6B"; model card: 6,053,381,344 n_parameters
    assert spec.kv_bytes_per_token() == 2 * 28 * 16 * 256 * 2


def test_falcon_7b_old_spelling_is_multi_query() -> None:
    config = {"model_type": "RefinedWebModel", "hidden_size": 4544, "n_head": 71, "n_layer": 32,
              "multi_query": True, "parallel_attn": True, "bias": False, "vocab_size": 65024,
              "torch_dtype": "bfloat16"}
    tensors: Shapes = {"transformer.word_embeddings.weight": (65024, 4544),
                       "transformer.ln_f.weight": (4544,), "transformer.ln_f.bias": (4544,)}
    tensors |= per_layer("transformer.h", 32, {
        "input_layernorm.weight": (4544,), "input_layernorm.bias": (4544,),
        "self_attention.query_key_value.weight": (4544 + 2 * 64, 4544), "self_attention.dense.weight": (4544, 4544),
        "mlp.dense_h_to_4h.weight": (18176, 4544), "mlp.dense_4h_to_h.weight": (4544, 18176)})
    spec = check(config, tensors, 2)
    assert spec.num_parameters() == 6_921_720_704                      # Falcon-7B's published count
    assert spec.attention_kind == "MQA"
    assert spec.kv_bytes_per_token() == 2 * 32 * 1 * 64 * 2


def test_falcon_40b_new_decoder_architecture_is_grouped() -> None:
    config = {"model_type": "falcon", "hidden_size": 8192, "num_attention_heads": 128, "num_kv_heads": 8,
              "num_hidden_layers": 60, "new_decoder_architecture": True, "parallel_attn": True, "bias": False,
              "vocab_size": 65024, "torch_dtype": "bfloat16"}
    tensors: Shapes = {"transformer.word_embeddings.weight": (65024, 8192),
                       "transformer.ln_f.weight": (8192,), "transformer.ln_f.bias": (8192,)}
    tensors |= per_layer("transformer.h", 60, {
        "ln_attn.weight": (8192,), "ln_attn.bias": (8192,), "ln_mlp.weight": (8192,), "ln_mlp.bias": (8192,),
        "self_attention.query_key_value.weight": ((128 + 2 * 8) * 64, 8192),
        "self_attention.dense.weight": (8192, 8192),
        "mlp.dense_h_to_4h.weight": (32768, 8192), "mlp.dense_4h_to_h.weight": (8192, 32768)})
    spec = check(config, tensors, 2)
    assert spec.attention_kind == "GQA" and spec.num_key_value_heads == 8
    assert spec.kv_bytes_per_token() == 2 * 60 * 8 * 64 * 2
    # the same checkpoint's first config.json, read by its remote code: model_type "RefinedWeb", n_head_kv
    old = {"model_type": "RefinedWeb", "hidden_size": 8192, "n_head": 128, "n_head_kv": 8, "n_layer": 60,
           "parallel_attn": True, "bias": False, "alibi": False, "vocab_size": 65024, "torch_dtype": "bfloat16"}
    spec = check(old, tensors, 2)
    assert spec.num_key_value_heads == 8 and spec.kv_bytes_per_token() == 2 * 60 * 8 * 64 * 2


def test_bloom_560m_embedding_layernorm() -> None:
    config = {"model_type": "bloom", "hidden_size": 1024, "n_head": 16, "n_layer": 24, "vocab_size": 250880}
    tensors: Shapes = {"word_embeddings.weight": (250880, 1024), "word_embeddings_layernorm.weight": (1024,),
                       "word_embeddings_layernorm.bias": (1024,), "ln_f.weight": (1024,), "ln_f.bias": (1024,)}
    tensors |= per_layer("h", 24, {
        "input_layernorm.weight": (1024,), "input_layernorm.bias": (1024,),
        "self_attention.query_key_value.weight": (3072, 1024), "self_attention.query_key_value.bias": (3072,),
        "self_attention.dense.weight": (1024, 1024), "self_attention.dense.bias": (1024,),
        "post_attention_layernorm.weight": (1024,), "post_attention_layernorm.bias": (1024,),
        "mlp.dense_h_to_4h.weight": (4096, 1024), "mlp.dense_h_to_4h.bias": (4096,),
        "mlp.dense_4h_to_h.weight": (1024, 4096), "mlp.dense_4h_to_h.bias": (1024,)})
    spec = check(config, tensors, 4)
    assert spec.num_parameters() == 559_214_592                        # bloom-560m's model card
    assert spec.kv_bytes_per_token() == 2 * 24 * 16 * 64 * 4


def test_opt_125m_offset_positions() -> None:
    config = {"model_type": "opt", "hidden_size": 768, "ffn_dim": 3072, "num_attention_heads": 12,
              "num_hidden_layers": 12, "max_position_embeddings": 2048, "vocab_size": 50272,
              "word_embed_proj_dim": 768, "do_layer_norm_before": True, "enable_bias": True,
              "torch_dtype": "float16"}
    tensors: Shapes = {"decoder.embed_tokens.weight": (50272, 768), "decoder.embed_positions.weight": (2050, 768),
                       "decoder.final_layer_norm.weight": (768,), "decoder.final_layer_norm.bias": (768,)}
    projection = {f"self_attn.{p}_proj.{kind}": (768, 768) if kind == "weight" else (768,)
                  for p in "qkv" for kind in ("weight", "bias")}
    tensors |= per_layer("decoder.layers", 12, {
        **projection, "self_attn.out_proj.weight": (768, 768), "self_attn.out_proj.bias": (768,),
        "self_attn_layer_norm.weight": (768,), "self_attn_layer_norm.bias": (768,),
        "fc1.weight": (3072, 768), "fc1.bias": (3072,), "fc2.weight": (768, 3072), "fc2.bias": (768,),
        "final_layer_norm.weight": (768,), "final_layer_norm.bias": (768,)})
    spec = check(config, tensors, 2)
    assert spec.num_parameters() == 125_239_296                        # "125M"
    assert spec.kv_bytes_per_token() == 2 * 12 * 12 * 64 * 2


def test_opt_with_an_embedding_projection_is_refused_not_miscounted() -> None:
    config = {"model_type": "opt", "hidden_size": 1024, "ffn_dim": 4096, "num_attention_heads": 16,
              "num_hidden_layers": 24, "vocab_size": 50272, "word_embed_proj_dim": 512}
    with pytest.raises(ModelConfigError, match="word_embed_proj_dim"):
        ModelSpec.from_config(config, "opt-350m")


def test_mpt_7b_nested_attn_config() -> None:
    config = {"model_type": "mpt", "d_model": 4096, "n_heads": 32, "n_layers": 32, "expansion_ratio": 4,
              "max_seq_len": 2048, "vocab_size": 50432, "no_bias": True, "learned_pos_emb": True,
              "attn_config": {"alibi": True, "attn_type": "multihead_attention"}, "torch_dtype": "bfloat16"}
    tensors: Shapes = {"transformer.wte.weight": (50432, 4096), "transformer.norm_f.weight": (4096,)}
    tensors |= per_layer("transformer.blocks", 32, {
        "norm_1.weight": (4096,), "attn.Wqkv.weight": (12288, 4096), "attn.out_proj.weight": (4096, 4096),
        "norm_2.weight": (4096,), "ffn.up_proj.weight": (16384, 4096), "ffn.down_proj.weight": (4096, 16384)})
    spec = check(config, tensors, 2)                                   # ALiBi: no position table
    assert spec.num_parameters() == 6_649_286_656                      # MPT-7B's published count
    assert spec.kv_bytes_per_token() == 2 * 32 * 32 * 128 * 2
    grouped = {**config, "attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 8}}
    assert ModelSpec.from_config(grouped).kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2


def test_chatglm3_multi_query_groups_and_kv_channels() -> None:
    config = {"model_type": "chatglm", "hidden_size": 4096, "num_layers": 28, "num_attention_heads": 32,
              "kv_channels": 128, "multi_query_attention": True, "multi_query_group_num": 2,
              "ffn_hidden_size": 13696, "padded_vocab_size": 65024, "seq_length": 8192,
              "add_bias_linear": False, "add_qkv_bias": True, "rmsnorm": True, "torch_dtype": "float16"}
    tensors: Shapes = {"transformer.embedding.word_embeddings.weight": (65024, 4096),
                       "transformer.output_layer.weight": (65024, 4096),
                       "transformer.encoder.final_layernorm.weight": (4096,)}
    tensors |= per_layer("transformer.encoder.layers", 28, {
        "input_layernorm.weight": (4096,), "self_attention.query_key_value.weight": (4096 + 2 * 2 * 128, 4096),
        "self_attention.query_key_value.bias": (4096 + 2 * 2 * 128,), "self_attention.dense.weight": (4096, 4096),
        "post_attention_layernorm.weight": (4096,), "mlp.dense_h_to_4h.weight": (2 * 13696, 4096),
        "mlp.dense_4h_to_h.weight": (4096, 13696)})
    spec = check(config, tensors, 2)
    assert round(spec.num_parameters() / 1e9, 2) == 6.24               # "6B"; 6.24 B parameters
    assert spec.kv_bytes_per_token() == 2 * 28 * 2 * 128 * 2


def test_phi2_parallel_block_and_head_bias() -> None:
    config = {"model_type": "phi", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 51200,
              "partial_rotary_factor": 0.4, "tie_word_embeddings": False, "torch_dtype": "float16"}
    tensors: Shapes = {"model.embed_tokens.weight": (51200, 2560), "lm_head.weight": (51200, 2560),
                       "lm_head.bias": (51200,), "model.final_layernorm.weight": (2560,),
                       "model.final_layernorm.bias": (2560,)}
    projection = {f"self_attn.{p}.{kind}": (2560, 2560) if kind == "weight" else (2560,)
                  for p in ("q_proj", "k_proj", "v_proj", "dense") for kind in ("weight", "bias")}
    tensors |= per_layer("model.layers", 32, {
        **projection, "input_layernorm.weight": (2560,), "input_layernorm.bias": (2560,),
        "mlp.fc1.weight": (10240, 2560), "mlp.fc1.bias": (10240,), "mlp.fc2.weight": (2560, 10240),
        "mlp.fc2.bias": (2560,)})
    spec = check(config, tensors, 2)
    assert spec.num_parameters() == 2_779_683_840                      # phi-2: 2.78 B
    assert spec.kv_bytes_per_token() == 2 * 32 * 32 * 80 * 2
