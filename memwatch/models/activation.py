"""The transient activation peak of one forward pass, in bytes, per tensor-parallel rank.

This is what ``peak − current`` measures around a forward: the tensors that live only while it runs,
excluding the weights and the KV cache (both stay allocated before and after). The engine sizes its KV
cache after measuring it on a warmup forward, so the estimate here is the *activation reserve* the
ledger and the simulator expect.

Activations are freed layer by layer, so the peak is the largest set of tensors alive at once inside
one layer, not a sum over layers. With ``T`` tokens in the batch, ``S`` sequences, ``b`` bytes per
element of the model dtype, ``h = hidden_size``, ``Hq = num_attention_heads / tp``,
``Hkv = KV heads per rank``, ``d = head_dim`` and ``W = MLP width per rank``::

    attention_phase = T × b × (h            residual
                               + h          normed input
                               + (Hq + 2·Hkv)·d   q, k, v projections
                               + Hq·d)      attention output
                      + eager scores        (attention="eager" only)
    mlp_phase       = T × b × (h + h        residual, normed input
                               + 2·W        gate and up projections
                               + W          activated product
                               + h)         down projection
    peak            = max(attention_phase, mlp_phase) + S × vocab_size × 4      fp32 logits

* **Eager scores** are materialised per sequence: ``Hq × L_q × L_kv × 4`` bytes (fp32), with
  ``L_q = T / S`` on prefill and ``L_q = 1`` on decode, ``L_kv`` the context length (``max_seq_len``,
  defaulting to ``L_q`` on prefill; capped at the window when every layer slides). Flash attention keeps
  them on chip, so they cost nothing here.
* **Logits** are computed for the sampled rows only, one per sequence on prefill and on decode.
* **MLA** layers project ``q`` to ``Hq·(qk_nope + qk_rope)``, cache a latent of
  ``kv_lora_rank + qk_rope``, expand it to ``Hq·(qk_nope + v_head)`` and output ``Hq·v_head``.
* **MoE** layers use ``W = (num_experts_per_tok + n_shared_experts) × moe_intermediate_size / tp``:
  every token passes through its routed experts and the shared ones; the widest layer sets ``W``.

The model is deliberately simple (no allocator rounding, no kernel workspaces); the ledger compares it
with the measured ``peak − current`` and reports the difference rather than hiding it.
"""

from __future__ import annotations

from memwatch.errors import UsageError
from memwatch.models.spec import FULL_ATTENTION, ModelSpec, dtype_itemsize

ATTENTION_IMPLEMENTATIONS = ("flash", "eager")
_LOGITS_ITEMSIZE = 4
_SCORES_ITEMSIZE = 4


def _mlp_width(spec: ModelSpec, tp: int) -> int:
    dense = -(-spec.intermediate_size // tp)
    if spec.n_routed_experts == 0:
        return dense
    experts = spec.num_experts_per_tok + spec.n_shared_experts
    moe = -(-experts * spec.moe_intermediate_size // tp)
    has_dense_layer = any(not spec.is_moe_layer(layer) for layer in range(spec.num_hidden_layers))
    return max(moe, dense) if has_dense_layer else moe


def _attention_elements_per_token(spec: ModelSpec, tp: int) -> int:
    """Elements of the q/k/v projections plus the attention output, per token on one rank."""
    heads = spec.num_attention_heads // tp
    if spec.is_mla:
        query = heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
        latent = (spec.kv_lora_rank or 0) + spec.qk_rope_head_dim
        expanded = heads * (spec.qk_nope_head_dim + spec.v_head_dim)
        return query + latent + expanded + heads * spec.v_head_dim
    kv_heads = spec.kv_heads_per_rank(tp)
    return (heads + 2 * kv_heads) * spec.head_dim + heads * spec.head_dim


def _eager_scores_bytes(spec: ModelSpec, tp: int, num_tokens: int, num_seqs: int, prefill: bool,
                        max_seq_len: int | None) -> int:
    if prefill:
        query_len = -(-num_tokens // num_seqs)
        context_len = max_seq_len or query_len
    else:
        if max_seq_len is None:
            raise UsageError("eager decode needs max_seq_len, the context length each sequence "
                             "attends over; pass max_seq_len")
        query_len, context_len = 1, max_seq_len
    all_layers_slide = spec.layer_types and FULL_ATTENTION not in spec.layer_types
    if all_layers_slide and spec.sliding_window:
        context_len = min(context_len, spec.sliding_window)
    heads = spec.num_attention_heads // tp
    return num_seqs * heads * query_len * context_len * _SCORES_ITEMSIZE


def forward_activation_bytes(spec: ModelSpec, num_tokens: int, num_seqs: int, *, prefill: bool,
                             tp: int = 1, attention: str = "flash",
                             max_seq_len: int | None = None) -> int:
    """Transient activation peak of one forward of ``num_tokens`` tokens over ``num_seqs`` sequences.

    See the module docstring for the formula. ``max_seq_len`` is the context length attended over
    (needed for eager decode; optional on prefill, where it defaults to the per-sequence query length).
    """
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise UsageError(f"unknown attention implementation {attention!r}; use flash or eager")
    if num_seqs < 1 or num_tokens < num_seqs:
        raise UsageError(f"a forward needs at least one sequence and one token per sequence, "
                         f"got {num_tokens} tokens over {num_seqs} sequences")
    if not prefill and num_tokens != num_seqs:
        raise UsageError(f"a decode step carries one token per sequence, "
                         f"got {num_tokens} tokens over {num_seqs} sequences")
    spec.check_tp(tp)
    itemsize = dtype_itemsize(spec.dtype)
    hidden = spec.hidden_size

    attention_phase = num_tokens * itemsize * (2 * hidden + _attention_elements_per_token(spec, tp))
    if attention == "eager":
        attention_phase += _eager_scores_bytes(spec, tp, num_tokens, num_seqs, prefill, max_seq_len)
    width = _mlp_width(spec, tp)
    mlp_phase = num_tokens * itemsize * (3 * hidden + 3 * width)
    logits = num_seqs * spec.vocab_size * _LOGITS_ITEMSIZE
    return max(attention_phase, mlp_phase) + logits


def warmup_batch(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> tuple[int, int]:
    """The worst-case prefill batch an engine warms up with, as ``(num_seqs, seq_len)``.

    nano-vllm: ``seq_len = min(max_num_batched_tokens, max_model_len)`` and
    ``num_seqs = min(max_num_batched_tokens // seq_len, max_num_seqs)``.
    """
    if min(max_num_batched_tokens, max_model_len, max_num_seqs) < 1:
        raise UsageError("max_num_batched_tokens, max_model_len and max_num_seqs must all be at least 1")
    seq_len = min(max_num_batched_tokens, max_model_len)
    num_seqs = min(max_num_batched_tokens // seq_len, max_num_seqs)
    return num_seqs, seq_len
