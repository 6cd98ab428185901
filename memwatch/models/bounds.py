"""The range of every model config field memwatch reads, checked before any arithmetic uses it.

A config is a file from outside (a download, a user's directory). A valid JSON number can be absurd:
``num_hidden_layers: 1e20`` makes the plan loop once per layer for ever, and a 5,000-digit
``vocab_size`` cannot even be turned into a Python ``int`` (its digit limit is 4,300). Each field
below has a range far beyond any real model (the largest have ~200 layers, 262,144 tokens of
vocabulary and 16,384 hidden units) but small enough that every loop and product stays instant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_LAYERS = 10_000
MAX_WIDTH = 1 << 20
"""Hidden and feed-forward widths, vocabulary size."""
MAX_HEADS = 65_536
MAX_LENGTH = 1 << 31
"""Token counts: context lengths and sliding windows."""

FIELD_BOUNDS: dict[str, tuple[int, int]] = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers"), (1, MAX_LAYERS)),
    **dict.fromkeys(("first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step", "expert_layer_period",
                     "expert_layer_offset", "attn_layer_period", "attn_layer_offset", "max_window_layers",
                     "sliding_window_pattern", "num_ln_in_parallel_attn"), (0, MAX_LAYERS)),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "vocab_size", "intermediate_size", "n_inner", "ffn_dim",
                     "moe_intermediate_size", "shared_expert_intermediate_size", "word_embed_proj_dim",
                     "kv_lora_rank", "q_lora_rank", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank",
                     "mamba_expand", "expansion_ratio", "mlp_ratio", "patch_size", "image_size",
                     "num_channels"), (0, MAX_WIDTH)),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "num_key_value_heads", "num_kv_heads",
                     "kv_n_heads", "multi_query_group_num", "head_dim", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "n_routed_experts", "num_local_experts", "num_experts", "n_shared_experts",
                     "num_experts_per_tok"), (0, MAX_HEADS)),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "sliding_window", "max_seq_len"), (0, MAX_LENGTH)),
}
"""Each integer field by the names families spell it, with its allowed range (inclusive)."""

MAX_DIGITS = 30
"""A JSON integer longer than this is kept as :class:`HugeNumber`, never converted (and never stored whole)."""


class HugeNumber:
    """An integer too long to be a config value, kept by its length so an error can name it."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"a {self.digits:,}-digit number"


def parse_int(text: str) -> int | HugeNumber:
    """``json.loads``'s ``parse_int``: long integers are not converted (over 4,300 digits that raises)."""
    return HugeNumber(text) if len(text) > MAX_DIGITS else int(text)


def check_bounds(config: Mapping[str, Any], name: str, depth: int = 0) -> None:
    """Raise :class:`ModelConfigError` naming the first field outside its range (nested configs too)."""
    from memwatch.models.hf_config import ModelConfigError

    for key, value in config.items():
        if isinstance(value, Mapping) and depth < 4 and key not in FIELD_BOUNDS:
            check_bounds(value, name, depth + 1)
            continue
        bounds = FIELD_BOUNDS.get(key)
        if isinstance(value, HugeNumber) and bounds is None:
            raise ModelConfigError(f"model config {name!r}: {key} is {value!r}; no config field is that large, "
                                   "fix the config")
        if bounds is None or value is None:
            continue
        low, high = bounds
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            shown = repr(value)[:40]
            raise ModelConfigError(f"model config {name!r}: {key} is {shown}; it must be a number from "
                                   f"{low:,} to {high:,}")
