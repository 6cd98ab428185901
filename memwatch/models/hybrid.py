"""The non-attention layers of hybrid models (Jamba's Mamba mixers): their weights and their state.

A Mamba layer caches nothing per token. Each sequence keeps a fixed state per layer, whatever its
length: the convolution window, ``d_inner × (d_conv − 1)`` elements (the inputs the causal
convolution still needs), and the SSM state, ``d_inner × d_state`` elements, at the model's precision.
Its weights (HF ``JambaMambaMixer``): ``in_proj`` (hidden → 2·d_inner), the depthwise ``conv1d``
(``d_inner × d_conv``, bias when ``mamba_conv_bias``), ``x_proj`` (d_inner → dt_rank + 2·d_state),
``dt_proj`` (dt_rank → d_inner, with bias), ``A_log`` (d_inner × d_state), ``D`` (d_inner),
``out_proj`` (d_inner → hidden), and Jamba's three inner RMSNorms (dt_rank, d_state, d_state).
Under tensor parallelism the inner width is split across ranks; ``x_proj``'s output and the inner
norms are replicated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memwatch.models.hf_config import dtype_itemsize
from memwatch.models.parameters import BIAS, LINEAR, NORM, OTHER

if TYPE_CHECKING:
    from memwatch.models.spec import ModelSpec


def _inner(spec: ModelSpec, tp: int) -> int:
    return -(-spec.mamba_d_inner // tp)


def state_layer_tensors(spec: ModelSpec, tp: int) -> list[tuple[str, int, int]]:
    """One Mamba layer's tensors on one rank as ``(kind, rows, cols)``."""
    hidden, inner = spec.hidden_size, _inner(spec, tp)
    state, rank = spec.mamba_d_state, spec.mamba_dt_rank
    tensors = [(LINEAR, 2 * inner, hidden), (OTHER, inner, spec.mamba_d_conv),
               (LINEAR, rank + 2 * state, inner), (LINEAR, inner, rank), (BIAS, inner, 1),
               (OTHER, inner, state), (OTHER, inner, 1), (LINEAR, hidden, inner)]
    if spec.mamba_conv_bias:
        tensors.append((BIAS, inner, 1))
    if spec.mamba_proj_bias:
        tensors += [(BIAS, 2 * inner, 1), (BIAS, hidden, 1)]
    if spec.mamba_inner_norms:
        tensors.append((NORM, rank + 2 * state, 1))
    return tensors


def state_bytes_per_layer(spec: ModelSpec, tp: int, dtype: str) -> int:
    """Bytes of one sequence's state in one Mamba layer on one rank: conv window plus SSM state."""
    inner = _inner(spec, tp)
    return inner * (spec.mamba_d_conv - 1 + spec.mamba_d_state) * dtype_itemsize(dtype)
