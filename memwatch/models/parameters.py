"""Parameter counts from a model config, whole or per tensor-parallel rank.

Counting from the config (rather than trusting the "7B" in a name) is what lets the planner price the
weights term exactly. Per rank, the engines' sharding applies: vocabulary-parallel embeddings and LM
head (``ceil(vocab / tp)`` rows), column/row-parallel projections split by heads or by the MLP width,
one replicated KV head per rank when ``tp >= num_key_value_heads``, and replicated norms, MoE routers
and MLA's down-projections (``kv_a_proj_with_mqa``, ``q_a_proj``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memwatch.models.spec import ModelSpec


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _attention(spec: ModelSpec, tp: int) -> int:
    """One layer's attention projections on one rank, biases included where the architecture has them."""
    hidden = spec.hidden_size
    heads = spec.num_attention_heads // tp
    if spec.is_mla:
        qk_head_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        if spec.q_lora_rank:
            query = hidden * spec.q_lora_rank + spec.q_lora_rank * heads * qk_head_dim
        else:
            query = hidden * heads * qk_head_dim
        kv_down = hidden * ((spec.kv_lora_rank or 0) + spec.qk_rope_head_dim)
        kv_up = (spec.kv_lora_rank or 0) * heads * (spec.qk_nope_head_dim + spec.v_head_dim)
        output = heads * spec.v_head_dim * hidden
        return query + kv_down + kv_up + output
    kv_heads = spec.kv_heads_per_rank(tp)
    head_dim = spec.head_dim
    weights = hidden * head_dim * (2 * heads + 2 * kv_heads)
    qkv_bias = (heads + 2 * kv_heads) * head_dim if spec.qkv_bias else 0
    o_bias = hidden if spec.o_bias else 0
    return weights + qkv_bias + o_bias


def _gated_mlp(hidden: int, width: int, bias: bool) -> int:
    """gate, up (hidden -> width) and down (width -> hidden)."""
    return 3 * hidden * width + ((2 * width + hidden) if bias else 0)


def _mlp(spec: ModelSpec, layer: int, tp: int) -> int:
    hidden = spec.hidden_size
    if not spec.is_moe_layer(layer):
        return _gated_mlp(hidden, _ceil_div(spec.intermediate_size, tp), spec.mlp_bias)
    expert_width = _ceil_div(spec.moe_intermediate_size, tp)
    routed = spec.n_routed_experts * _gated_mlp(hidden, expert_width, False)
    shared_width = _ceil_div(spec.n_shared_experts * spec.moe_intermediate_size, tp)
    shared = _gated_mlp(hidden, shared_width, False) if spec.n_shared_experts else 0
    router = spec.n_routed_experts * hidden
    return routed + shared + router


def _norms_per_layer(spec: ModelSpec) -> int:
    norms = spec.norms_per_layer * spec.hidden_size
    if spec.qk_norm:
        norms += 2 * spec.head_dim
    if spec.is_mla:
        norms += (spec.kv_lora_rank or 0) + (spec.q_lora_rank or 0)
    return norms


def parameter_breakdown(spec: ModelSpec, tp: int = 1, pp: int = 1, pp_rank: int = 0) -> dict[str, int]:
    """Parameters one rank holds, by part; at ``tp = pp = 1`` they sum to the model's parameter count.

    With pipeline parallelism the first stage holds the embeddings and the last the final norm and
    the LM head, which is a copy of the embeddings when they are tied and the stages differ.
    """
    spec.check_tp(tp)
    stages = spec.pipeline_stages(pp)
    layers = stages[pp_rank]
    first, last = pp_rank == 0, pp_rank == pp - 1
    embedding = _ceil_div(spec.vocab_size, tp) * spec.hidden_size
    untied_head = not spec.tie_word_embeddings or pp > 1
    return {
        "embed_tokens": embedding if first else 0,
        "attention": len(layers) * _attention(spec, tp),
        "mlp": sum(_mlp(spec, layer, tp) for layer in layers),
        "norms": len(layers) * _norms_per_layer(spec) + (spec.hidden_size if last else 0),
        "lm_head": embedding if last and untied_head else 0,
    }
