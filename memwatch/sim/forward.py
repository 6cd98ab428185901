"""The memory model of one forward pass: the tensors it allocates and frees, in order, on one rank.

A forward is not one block of ``forward_activation_bytes``: the caching allocator sees one request
per tensor, and which segments they create, split and leave behind depends on their sizes and order.
This module turns a batch into that sequence of requests (:class:`TensorOp`), following the eager
code of nano-vllm's decoder layers (``qkv_proj``, attention, ``o_proj``; ``gate_up_proj``, ``act_fn``,
``down_proj``; then ``compute_logits``), where a local variable keeps its tensor alive until the
function returns. Per layer, with ``T`` tokens, ``b`` bytes per element and the per-rank widths of
:mod:`memwatch.models.activation`:

=================  ==================================  ===========================================
phase              tensors alive at its peak           freed after it
=================  ==================================  ===========================================
attention          residual ``T·h``, normed ``T·h``,   the normed input, ``qkv``, the scores and
                   ``qkv`` ``T·(Hq+2Hkv)·d``, scores   the attention output once ``o_proj`` wrote
                   (eager only), attention output      its ``T·h`` result, which is added into the
                   ``T·Hq·d``                          residual and freed
MLP                residual, normed, ``gate_up``       all but the residual
                   ``T·2W``, activated ``T·W``,
                   ``down`` ``T·h``
=================  ==================================  ===========================================

The logits (``S`` rows of the vocabulary in fp32) are allocated before the layers run and freed at
the end, so the forward's peak is exactly :func:`memwatch.models.forward_activation_bytes` (each
tensor rounded as the allocator rounds it): the planner's estimate and the simulator agree by
construction, and the simulator adds what the estimate cannot know, the segments.

Calibration: vLLM's profiler reports a PyTorch activation peak of 1.26 GiB for Meta-Llama-3-8B in
bf16 on one GPU, profiling 8,192 batched tokens over 256 sequences (vLLM pull request 10511, December
2024, "Memory profiling results"); this model gives 0.97 GiB for that forward (0.84 GiB of MLP
tensors, 0.12 GiB of logits). The rest is vLLM's sampler (probabilities and log-probabilities of every
row in fp32), which nano-vllm's sampler also allocates but this model leaves out; the same log shows
1.26 GiB at tensor parallel 2, where this model halves the MLP, so the measured peak there is mostly
the sampler and the unsharded residual stream. ``tests/test_sim_forward.py`` holds the estimate to
within 25 % of the single-GPU figure.

Layers after the second repeat the second's requests on the blocks it freed and leave the allocator
exactly as they found it, so :func:`forward_ops` emits two of them (``repeat_layers`` says how many it
stands for); the peak and the cache are the same as with every layer.
"""

from __future__ import annotations

from typing import NamedTuple

from memwatch.models import ModelSpec
from memwatch.models.activation import (
    _attention_elements_per_token,
    _eager_scores_bytes,
    _mlp_width,
    forward_activation_bytes,
)
from memwatch.models.spec import dtype_itemsize

LOGITS_ITEMSIZE = 4
LAYERS_SIMULATED = 2
"""Layers whose requests reach the allocator; the rest repeat the last one exactly."""


class TensorOp(NamedTuple):
    """One allocator request of a forward: allocate ``nbytes`` as ``name``, or free ``name`` (``nbytes`` 0)."""

    name: str
    nbytes: int

    @property
    def is_free(self) -> bool:
        return self.nbytes == 0


def _free(*names: str) -> list[TensorOp]:
    return [TensorOp(name, 0) for name in names]


def forward_ops(spec: ModelSpec, num_tokens: int, num_seqs: int, *, prefill: bool, tp: int = 1,
                attention: str = "flash", max_seq_len: int | None = None) -> list[TensorOp]:
    """The allocator requests of one forward, in order; every tensor allocated is freed by the end."""
    forward_activation_bytes(spec, num_tokens, num_seqs, prefill=prefill, tp=tp, attention=attention,
                             max_seq_len=max_seq_len)  # the same argument checks, one error wording
    b = dtype_itemsize(spec.dtype)
    tokens = num_tokens
    hidden = tokens * b * spec.hidden_size
    width = _mlp_width(spec, tp)
    attention_elements = _attention_elements_per_token(spec, tp)
    heads = spec.num_attention_heads // tp
    out_elements = heads * (spec.v_head_dim if spec.is_mla else spec.head_dim)
    ops = [TensorOp("logits", num_seqs * spec.vocab_size * LOGITS_ITEMSIZE), TensorOp("residual", hidden)]
    for layer in range(min(LAYERS_SIMULATED, spec.num_hidden_layers)):
        ops += [TensorOp(f"l{layer}.attn_norm", hidden),
                TensorOp(f"l{layer}.qkv", tokens * b * (attention_elements - out_elements))]
        if attention == "eager":
            scores = _eager_scores_bytes(spec, tp, num_tokens, num_seqs, prefill, max_seq_len)
            ops.append(TensorOp(f"l{layer}.scores", scores))
        ops.append(TensorOp(f"l{layer}.attn_out", tokens * b * out_elements))
        ops += _free(f"l{layer}.qkv", *([f"l{layer}.scores"] if attention == "eager" else []))
        ops.append(TensorOp(f"l{layer}.o_proj", hidden))
        ops += _free(f"l{layer}.attn_out", f"l{layer}.attn_norm", f"l{layer}.o_proj")
        ops += [TensorOp(f"l{layer}.mlp_norm", hidden), TensorOp(f"l{layer}.gate_up", tokens * b * 2 * width),
                TensorOp(f"l{layer}.act", tokens * b * width), TensorOp(f"l{layer}.down", hidden)]
        ops += _free(f"l{layer}.gate_up", f"l{layer}.act", f"l{layer}.mlp_norm", f"l{layer}.down")
    ops += _free("residual", "logits")
    return ops


def repeat_layers(spec: ModelSpec) -> int:
    """How many layers the last simulated one stands for (1 when every layer is simulated)."""
    return max(spec.num_hidden_layers - LAYERS_SIMULATED + 1, 1)
