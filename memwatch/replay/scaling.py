"""How a change of tensor-parallel size scales the calibrated memory, per rank.

Without the model's architecture, everything scales by old TP over new TP. When the run's model is one
memwatch knows (``memwatch.models``), the ratios come from its shapes instead: hidden-size activations,
norms and the logits stay whole on every rank while attention heads, the MLP and the vocabulary shard,
so a rank's activation does not halve when TP doubles. Only ratios are taken from the model; the bytes
they scale are the ones the run recorded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memwatch.errors import MemwatchError

if TYPE_CHECKING:
    from memwatch.models import ModelSpec
    from memwatch.sim.forward import TensorOp

PROBE_TOKENS = 8192
"""Prefill tokens of the forward whose per-token activation sets the activation ratio."""


@dataclass(frozen=True)
class TPScale:
    weights: float
    activation_per_token: float
    reserve: float
    """Of the warmup forward."""

    @classmethod
    def uniform(cls, factor: float) -> TPScale:
        return cls(factor, factor, factor)


def tp_scale(model: str | None, dtype: str | None, attention: str, old_tp: int, new_tp: int,
             warmup: tuple[int, int]) -> TPScale:
    """Ratios new/old per rank; ``warmup`` is the new warmup's ``(num_seqs, seq_len)``."""
    uniform = TPScale.uniform(old_tp / new_tp)
    if old_tp == new_tp or not model:
        return uniform if old_tp != new_tp else TPScale.uniform(1.0)
    from memwatch.models import ModelSpec, forward_activation_bytes
    from memwatch.models.spec import canonical_dtype

    try:
        spec = ModelSpec.load(model)
        if dtype:
            spec = dataclasses.replace(spec, dtype=canonical_dtype(dtype))

        def act(tokens: int, seqs: int, tp: int, seq_len: int) -> int:
            return forward_activation_bytes(spec, tokens, seqs, prefill=True, tp=tp, attention=attention,
                                            max_seq_len=seq_len)

        seqs, seq_len = warmup
        logits_free = [act(PROBE_TOKENS, 1, tp, PROBE_TOKENS) - act(1, 1, tp, 1) for tp in (old_tp, new_tp)]
        return TPScale(
            weights=spec.weight_bytes(tp=new_tp) / spec.weight_bytes(tp=old_tp),
            activation_per_token=logits_free[1] / logits_free[0],
            reserve=act(seqs * seq_len, seqs, new_tp, seq_len) / act(seqs * seq_len, seqs, old_tp, seq_len),
        )
    except (MemwatchError, OSError, ValueError, ZeroDivisionError):
        return uniform  # a model memwatch does not know, or one that does not shard this way


Forward = Callable[[int, int, bool, int], int]
"""``(num_tokens, num_seqs, prefill, max_seq_len)`` → activation bytes of one forward on one rank."""


def _known_spec(model: str | None, dtype: str | None, tp: int) -> ModelSpec | None:
    """The run's model as memwatch knows it, in the recorded dtype, if it shards over ``tp`` ranks."""
    if not model:
        return None
    from memwatch.models import ModelSpec
    from memwatch.models.spec import canonical_dtype

    try:
        spec = ModelSpec.load(model)
        if dtype:
            spec = dataclasses.replace(spec, dtype=canonical_dtype(dtype))
        spec.check_tp(tp)
    except (MemwatchError, OSError, ValueError):
        return None
    return spec


def eager_attention_floor(model: str | None, dtype: str | None, attention: str, tp: int) -> Forward | None:
    """With eager attention, the model's own activation formula, scores included, for a known model.

    Eager attention materialises scores that grow with the context attended over; the per-step peaks of
    short requests do not show that term, so the linear fit alone would miss the out-of-memory a long
    prompt causes. ``None`` for flash attention or a model memwatch does not know.
    """
    spec = _known_spec(model, dtype, tp) if attention == "eager" else None
    if spec is None:
        return None
    from memwatch.models import forward_activation_bytes

    def forward(num_tokens: int, num_seqs: int, prefill: bool, max_seq_len: int) -> int:
        return forward_activation_bytes(spec, num_tokens, num_seqs, prefill=prefill, tp=tp, attention="eager",
                                        max_seq_len=max_seq_len)

    return forward


Tensors = Callable[[int, int, bool, int], "list[TensorOp]"]
"""``(num_tokens, num_seqs, prefill, max_seq_len)`` → the allocator requests of one forward on one rank."""


def forward_tensors(model: str | None, dtype: str | None, attention: str, tp: int) -> Tensors | None:
    """For a known model, the order and relative sizes of a forward's tensors (:mod:`memwatch.sim.forward`).

    The replay scales them to the calibrated activation, so the bytes stay the recorded ones while the
    segments they take and leave cached (several, of the sizes a forward's phases need, not one block
    of its peak) are the forward's own: what a later temporary finds free, and what a leak outside
    PyTorch cannot get back. ``None`` for a model memwatch does not know.
    """
    spec = _known_spec(model, dtype, tp)
    if spec is None:
        return None
    from memwatch.sim.forward import forward_ops

    def tensors(num_tokens: int, num_seqs: int, prefill: bool, max_seq_len: int) -> list[TensorOp]:
        return forward_ops(spec, num_tokens, num_seqs, prefill=prefill, tp=tp, attention=attention,
                           max_seq_len=max_seq_len)

    return tensors
