"""Parameter counts from a model config, whole or per tensor-parallel rank, tensor by tensor.

Counting from the config (rather than trusting the "7B" in a name) is what lets the planner price the
weights term exactly. Per rank, the engines' sharding applies: vocabulary-parallel embeddings and LM
head (``ceil(vocab / tp)`` rows), column/row-parallel projections split by heads or by the MLP width,
one replicated KV head per rank when ``tp >= num_key_value_heads``, and replicated norms, MoE routers
and MLA's down-projections (``kv_a_proj_with_mqa``, ``q_a_proj``).

The count is kept as groups of identical tensors with their kind, because a quantized checkpoint stores
each kind differently: linear layers packed with per-group scales, embeddings, norms, biases and MoE
routers at their own precision (see :mod:`memwatch.models.quantization`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memwatch.models.spec import ModelSpec

LINEAR = "linear"
"""A weight matrix of ``rows = out_features`` by ``cols = in_features``: what quantization packs."""
EMBEDDING = "embedding"
NORM = "norm"
BIAS = "bias"
ROUTER = "router"
"""An MoE router: a small linear layer engines keep at full precision."""
OTHER = "other"
"""Any other tensor kept at the model's precision (a convolution, an SSM's decay and skip vectors)."""
VISION = "vision"
"""A vision tower and its projector, counted as a whole and kept at the model's precision."""


@dataclass(frozen=True)
class TensorGroup:
    """``count`` identical tensors of ``rows × cols`` elements in one part of the model."""

    part: str
    kind: str
    rows: int
    cols: int
    count: int = 1

    @property
    def elements(self) -> int:
        return self.rows * self.cols * self.count


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _attention(spec: ModelSpec, tp: int) -> list[tuple[str, int, int]]:
    """One layer's attention tensors on one rank as ``(kind, rows, cols)``."""
    hidden = spec.hidden_size
    heads = spec.num_attention_heads // tp
    if spec.is_mla:
        qk_head_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        latent = spec.kv_lora_rank or 0
        if spec.q_lora_rank:
            query = [(LINEAR, spec.q_lora_rank, hidden), (LINEAR, heads * qk_head_dim, spec.q_lora_rank)]
        else:
            query = [(LINEAR, heads * qk_head_dim, hidden)]
        return [*query,
                (LINEAR, latent + spec.qk_rope_head_dim, hidden),                        # kv_a_proj_with_mqa
                (LINEAR, heads * (spec.qk_nope_head_dim + spec.v_head_dim), latent),     # kv_b_proj
                (LINEAR, hidden, heads * spec.v_head_dim)]                               # o_proj
    kv_heads = spec.kv_heads_per_rank(tp)
    head_dim = spec.head_dim
    tensors = [(LINEAR, heads * head_dim, hidden), (LINEAR, kv_heads * head_dim, hidden),
               (LINEAR, kv_heads * head_dim, hidden), (LINEAR, hidden, heads * head_dim)]
    if spec.qkv_bias:
        tensors.append((BIAS, (heads + 2 * kv_heads) * head_dim, 1))
    if spec.o_bias:
        tensors.append((BIAS, hidden, 1))
    return tensors


def _dense_mlp(hidden: int, width: int, gated: bool, bias: bool) -> list[tuple[str, int, int]]:
    """gate (when gated) and up (hidden -> width), down (width -> hidden)."""
    tensors = [(LINEAR, width, hidden)] * (2 if gated else 1) + [(LINEAR, hidden, width)]
    if bias:
        tensors += [(BIAS, width, 1)] * (2 if gated else 1) + [(BIAS, hidden, 1)]
    return tensors


def _mlp(spec: ModelSpec, layer: int, tp: int) -> list[tuple[str, int, int]]:
    hidden = spec.hidden_size
    if not spec.is_moe_layer(layer):
        return _dense_mlp(hidden, _ceil_div(spec.intermediate_size, tp), spec.gated_mlp, spec.mlp_bias)
    expert_width = _ceil_div(spec.moe_intermediate_size, tp)
    tensors = _dense_mlp(hidden, expert_width, spec.gated_mlp, False) * spec.n_routed_experts
    shared = spec.shared_expert_intermediate_size or spec.n_shared_experts * spec.moe_intermediate_size
    if shared:
        tensors += _dense_mlp(hidden, _ceil_div(shared, tp), spec.gated_mlp, False)
    if spec.shared_expert_intermediate_size:
        tensors.append((ROUTER, 1, hidden))                                              # shared_expert_gate
    tensors.append((ROUTER, spec.n_routed_experts, hidden))
    return tensors


def _norms_per_layer(spec: ModelSpec) -> int:
    width = 2 if spec.norm_bias else 1
    norms = spec.norms_per_layer * spec.hidden_size * width
    if spec.qk_norm:
        norms += 2 * spec.head_dim
    if spec.is_mla:
        norms += (spec.kv_lora_rank or 0) + (spec.q_lora_rank or 0)
    return norms


def _grouped(part: str, tensors: list[tuple[str, int, int]], layers: int) -> list[TensorGroup]:
    counts: dict[tuple[str, int, int], int] = {}
    for tensor in tensors:
        counts[tensor] = counts.get(tensor, 0) + layers
    return [TensorGroup(part, kind, rows, cols, count) for (kind, rows, cols), count in counts.items() if count]


def tensor_groups(spec: ModelSpec, tp: int = 1, pp: int = 1, pp_rank: int = 0) -> list[TensorGroup]:
    """Every tensor one rank holds, grouped by part and shape.

    With pipeline parallelism the first stage holds the embeddings (and a vision tower) and the last
    the final norm and the LM head, which is a copy of the embeddings when they are tied and the
    stages differ.
    """
    spec.check_tp(tp)
    stages = spec.pipeline_stages(pp)
    layers = stages[pp_rank]
    first, last = pp_rank == 0, pp_rank == pp - 1
    hidden = spec.hidden_size
    vocab_rows = _ceil_div(spec.vocab_size, tp)
    groups: list[TensorGroup] = []
    if first:
        groups.append(TensorGroup("embed_tokens", EMBEDDING, vocab_rows, hidden))
        if spec.learned_positions:
            groups.append(TensorGroup("embed_tokens", EMBEDDING, spec.learned_positions, hidden))
        if spec.vision_parameters:
            groups.append(TensorGroup("vision", VISION, spec.vision_parameters, 1))
    attention_layers = [layer for layer in layers if spec.has_attention(layer)]
    groups += _grouped("attention", _attention(spec, tp), len(attention_layers))
    if len(attention_layers) < len(layers):
        from memwatch.models.hybrid import state_layer_tensors

        groups += _grouped("mixer", state_layer_tensors(spec, tp), len(layers) - len(attention_layers))
    mlp: list[tuple[str, int, int]] = []
    for layer in layers:
        mlp += _mlp(spec, layer, tp)
    groups += _grouped("mlp", mlp, 1)
    norm_width = 2 if spec.norm_bias else 1
    norms = len(layers) * _norms_per_layer(spec)
    if first and spec.embedding_norm:
        norms += hidden * norm_width
    if last and spec.final_norm:
        norms += hidden * norm_width
    groups.append(TensorGroup("norms", NORM, norms, 1))
    if last and (not spec.tie_word_embeddings or pp > 1):
        groups.append(TensorGroup("lm_head", EMBEDDING, vocab_rows, hidden))
    if last and spec.lm_head_bias:
        groups.append(TensorGroup("lm_head", BIAS, vocab_rows, 1))
    return [group for group in groups if group.elements]


def parameter_breakdown(spec: ModelSpec, tp: int = 1, pp: int = 1, pp_rank: int = 0) -> dict[str, int]:
    """Parameters one rank holds, by part; at ``tp = pp = 1`` they sum to the model's parameter count.

    The parts are always ``embed_tokens`` (with learned position embeddings), ``attention``, ``mlp``,
    ``norms`` and ``lm_head``; ``vision`` (tower and projector) and ``mixer`` (the non-attention layers
    of a hybrid model) appear only for models that have them.
    """
    parts = {"embed_tokens": 0, "attention": 0, "mlp": 0, "norms": 0, "lm_head": 0}
    for group in tensor_groups(spec, tp, pp, pp_rank):
        parts[group.part] = parts.get(group.part, 0) + group.elements
    return parts
