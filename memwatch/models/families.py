"""Config families that predate the Llama field names: their attribute aliases and architecture flags.

Transformers maps old names onto ``hidden_size`` and friends with a per-class ``attribute_map``; reading
those tables would need the ``transformers`` package (and, for some classes, torch), so the aliases of
the families people still serve are kept in one table here, each checked by a test built from the
published config and against the ``attribute_map`` of the released Transformers (and vLLM) config
class. Besides the names, each family fixes what its config leaves implicit: a two-matrix MLP instead
of SwiGLU, LayerNorm with a bias, biases on every projection, learned position tables, one norm per
layer for parallel attention, an untied LM head with a bias.

:func:`normalize` returns a copy of the config in Llama's field names plus the ``ModelSpec`` flags
(under keys starting with ``_``), which :func:`memwatch.models.hf_config.config_fields` reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# model_type -> {canonical key: the family's own key}
_ALIASES: dict[str, dict[str, str]] = {
    "gpt2": {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
             "intermediate_size": "n_inner", "max_position_embeddings": "n_positions"},
    "gpt_bigcode": {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
                    "intermediate_size": "n_inner", "max_position_embeddings": "n_positions"},
    "gptj": {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
             "intermediate_size": "n_inner", "max_position_embeddings": "n_positions"},
    "bloom": {"hidden_size": "n_embed", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"},
    "falcon": {"hidden_size": "n_embed", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
               "num_kv_heads": "n_head_kv", "intermediate_size": "ffn_hidden_size"},
    "opt": {"intermediate_size": "ffn_dim"},
    "mpt": {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
            "max_position_embeddings": "max_seq_len"},
    "chatglm": {"num_hidden_layers": "num_layers", "intermediate_size": "ffn_hidden_size",
                "head_dim": "kv_channels", "vocab_size": "padded_vocab_size",
                "max_position_embeddings": "seq_length"},
}
# Old Falcon checkpoints say model_type "RefinedWebModel" (Falcon-7B) or "RefinedWeb" (Falcon-40B, whose remote
# code always had the new decoder architecture and counted its KV heads in ``n_head_kv``).
_MODEL_TYPES = {"refinedweb": "falcon", "refinedwebmodel": "falcon"}

_TWO_MATRIX_MLP = {"_gated_mlp": False, "_norm_bias": True}


def _model_type(config: Mapping[str, Any]) -> str:
    model_type = str(config.get("model_type") or "").lower()
    return _MODEL_TYPES.get(model_type, model_type)


def _gpt2(config: dict[str, Any]) -> None:
    config.setdefault("tie_word_embeddings", True)
    config.update(_TWO_MATRIX_MLP, attention_bias=True, mlp_bias=True,
                  _learned_positions=config.get("max_position_embeddings") or 0)
    if config.get("multi_query"):                                          # StarCoder (gpt_bigcode)
        config["num_key_value_heads"] = 1


def _gptj(config: dict[str, Any]) -> None:
    config.setdefault("tie_word_embeddings", False)
    config.update(_TWO_MATRIX_MLP, mlp_bias=True, _norms_per_layer=1, _lm_head_bias=True)


def _gpt_neox(config: dict[str, Any]) -> None:
    config.setdefault("tie_word_embeddings", False)
    bias = bool(config.get("attention_bias", True))
    config.update(_TWO_MATRIX_MLP, attention_bias=bias, mlp_bias=True)


def _bloom(config: dict[str, Any]) -> None:
    config.setdefault("tie_word_embeddings", True)
    config.update(_TWO_MATRIX_MLP, attention_bias=True, mlp_bias=True, _embedding_norm=True)


def _falcon(config: dict[str, Any]) -> None:
    config.setdefault("tie_word_embeddings", True)
    bias = bool(config.get("bias", False))
    config.update(_TWO_MATRIX_MLP, attention_bias=bias, mlp_bias=bias)
    heads = config.get("num_attention_heads")
    # Falcon-40B's old config: vLLM's RWConfig (vllm/transformers_utils/configs/falcon.py) makes it the new
    # architecture too, with n_head_kv as num_kv_heads.
    if config.get("new_decoder_architecture") or str(config.get("model_type")).lower() == "refinedweb":
        config["num_key_value_heads"] = config.get("num_kv_heads") or heads
        config["_norms_per_layer"] = 2 if config.get("num_ln_in_parallel_attn") in (None, 2) else 1
    else:
        config["num_key_value_heads"] = 1 if config.get("multi_query", True) else heads
        config["_norms_per_layer"] = 1 if config.get("parallel_attn", True) else 2


def _opt(config: dict[str, Any]) -> None:
    config.setdefault("tie_word_embeddings", True)
    bias = bool(config.get("enable_bias", True))
    # OPT's learned positions are offset by 2 rows (OPTLearnedPositionalEmbedding).
    config.update(_TWO_MATRIX_MLP, attention_bias=bias, mlp_bias=bias,
                  _learned_positions=(config.get("max_position_embeddings") or 0) + 2,
                  _final_norm=bool(config.get("do_layer_norm_before", True)))
    if config.get("word_embed_proj_dim", config.get("hidden_size")) != config.get("hidden_size"):
        config["_unsupported"] = "word_embed_proj_dim differs from hidden_size (project_in/project_out)"


def _mpt(config: dict[str, Any]) -> None:
    attn = config.get("attn_config") or {}
    bias = not config.get("no_bias", False)
    hidden = config.get("hidden_size") or 0
    config.update(_TWO_MATRIX_MLP, attention_bias=bias, mlp_bias=bias, tie_word_embeddings=True,
                  _norm_bias=bias)
    config.setdefault("intermediate_size", int(config.get("expansion_ratio") or 4) * hidden)
    heads = config.get("num_attention_heads")
    multi_query = attn.get("attn_type") == "multiquery_attention"
    config["num_key_value_heads"] = 1 if multi_query else attn.get("kv_n_heads") or heads
    if not attn.get("alibi", False) and config.get("learned_pos_emb", True):
        config["_learned_positions"] = config.get("max_position_embeddings") or 0


def _chatglm(config: dict[str, Any]) -> None:
    config.setdefault("tie_word_embeddings", False)
    if config.get("multi_query_attention"):
        config["num_key_value_heads"] = config.get("multi_query_group_num")
    config.update(_qkv_bias=bool(config.get("add_qkv_bias", False)),
                  attention_bias=bool(config.get("add_bias_linear", False)),
                  mlp_bias=bool(config.get("add_bias_linear", False)),
                  _norm_bias=not config.get("rmsnorm", True))


def _phi(config: dict[str, Any]) -> None:
    config.setdefault("tie_word_embeddings", False)
    config.update(_TWO_MATRIX_MLP, attention_bias=True, mlp_bias=True, _norms_per_layer=1, _lm_head_bias=True)


_FAMILIES = {"gpt2": _gpt2, "gpt_bigcode": _gpt2, "gptj": _gptj, "gpt_neox": _gpt_neox, "bloom": _bloom,
             "falcon": _falcon, "opt": _opt, "mpt": _mpt, "chatglm": _chatglm, "phi": _phi}


def normalize(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The config in Llama's field names, with the family's implicit architecture as ``_`` flags."""
    config = dict(raw)
    model_type = _model_type(config)
    for canonical, alias in _ALIASES.get(model_type, {}).items():
        if config.get(canonical) is None and config.get(alias) is not None:
            config[canonical] = config[alias]
    family = _FAMILIES.get(model_type)
    if family is not None:
        family(config)
        hidden = config.get("hidden_size")
        if config.get("intermediate_size") is None and isinstance(hidden, int):
            config["intermediate_size"] = 4 * hidden                       # GPT-2/GPT-J/BLOOM/Falcon default
    return config


def moe_and_hybrid(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """MoE and hybrid-layer fields in DeepSeek's names, from Mixtral's, Qwen-MoE's and Jamba's spellings."""
    fields: dict[str, Any] = {}
    experts = config.get("n_routed_experts") or config.get("num_local_experts") or config.get("num_experts")
    if experts:
        fields["n_routed_experts"] = experts
        fields["moe_intermediate_size"] = config.get("moe_intermediate_size") or config.get("intermediate_size")
        if config.get("decoder_sparse_step"):                                # Qwen-MoE: (layer + 1) % step == 0
            step = int(config["decoder_sparse_step"])
            fields.update(moe_layer_freq=step, moe_layer_offset=step - 1)
        if config.get("expert_layer_period"):                                # Jamba: layer % period == offset
            fields.update(moe_layer_freq=int(config["expert_layer_period"]),
                          moe_layer_offset=int(config.get("expert_layer_offset") or 0))
        fields["mlp_only_layers"] = tuple(config.get("mlp_only_layers") or ())
        fields["shared_expert_intermediate_size"] = config.get("shared_expert_intermediate_size") or 0
    if model_type == "jamba" or config.get("attn_layer_period"):
        period, offset = int(config.get("attn_layer_period") or 1), int(config.get("attn_layer_offset") or 0)
        layers = int(config.get("num_hidden_layers") or 0)
        hidden = int(config.get("hidden_size") or 0)
        rank = config.get("mamba_dt_rank") or "auto"
        fields.update(
            mixer_kind="mamba",
            attention_layers=tuple(layer for layer in range(layers) if layer % period == offset),
            mamba_d_state=int(config.get("mamba_d_state") or 16),
            mamba_d_conv=int(config.get("mamba_d_conv") or 4),
            mamba_d_inner=int(config.get("mamba_expand") or 2) * hidden,
            mamba_dt_rank=-(-hidden // 16) if rank == "auto" else int(rank),
            mamba_conv_bias=bool(config.get("mamba_conv_bias", True)),
            mamba_proj_bias=bool(config.get("mamba_proj_bias", False)),
            mamba_inner_norms=model_type == "jamba",
        )
    return fields
