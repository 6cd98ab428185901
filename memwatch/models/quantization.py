"""Bytes of a quantized checkpoint, from its ``quantization_config``: linear layers as each scheme stores them.

Only linear layers are quantized; embeddings, the LM head, norms, biases and MoE routers stay at the
model's own precision (every scheme below skips them). For a linear layer of ``out × in`` weights,
``n = out × in``, group size ``g`` and ``b`` bits, the stored tensors are:

=================  =========================================================================================
AWQ (GEMM)         ``qweight`` ``n·b/8``; ``qzeros`` ``ceil(in/g)·out·b/8``; fp16 ``scales`` ``ceil(in/g)·out·2``
GPTQ               as AWQ, plus ``g_idx``: one int32 per input feature (``4·in``); ``g = -1`` is one group
bitsandbytes 4-bit packed ``n/2``; one absmax per 64 weights (fp32, or uint8 plus one fp32 per 256 blocks
                   with double quantization); a 16-entry fp32 code book per tensor (``quant_map``), and with
                   double quantization the 256-entry fp32 code book of the absmax (``nested_quant_map``)
bitsandbytes 8-bit ``n`` int8 plus one fp32 row scale (``SCB``) per output feature
FP8                ``n`` bytes plus fp32 scales: one per tensor, per output channel, or per
                   ``weight_block_size`` block (``ceil(out/bo)·ceil(in/bi)``); with static activation
                   scales (``activation_scheme: static``) one fp32 ``input_scale`` more
compressed-tensors ``pack-quantized`` int4/int8 packed into int32 (``n·b/8``) with scales at the model dtype
                   per group or channel (and zero points when asymmetric); ``float-quantized`` as FP8
=================  =========================================================================================

The layouts follow the checkpoints' own tensor names (AutoAWQ's ``WQLinear_GEMM``, AutoGPTQ's
``QuantLinear``, bitsandbytes' ``Params4bit``/``Int8Params``, compressed-tensors' ``weight_packed``,
``weight_scale``, ``weight_zero_point``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memwatch.errors import UsageError

if TYPE_CHECKING:
    from memwatch.models.parameters import TensorGroup

METHODS = ("none", "awq", "gptq", "bnb-4bit", "bnb-8bit", "fp8")
"""Values of ``--quantization``."""
_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "marlin": "gptq", "fbgemm_fp8": "fp8"}
_BNB_BLOCK = 64
_BNB_NESTED_BLOCK = 256
_BNB_NESTED_CODE = 256                                                 # entries of the absmax's 8-bit code book
_FP32 = 4


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


@dataclass(frozen=True)
class Quantization:
    """How one checkpoint stores its linear layers; ``method`` ``none`` means at the model dtype."""

    method: str = "none"
    bits: int = 16
    group_size: int = 0
    """Input features per scale; 0 (or -1 in configs) means one scale per output channel."""
    zero_points: bool = False
    scale_itemsize: int = 2
    g_idx: bool = False
    block: tuple[int, int] | None = None
    strategy: str = "tensor"
    """FP8 scales: ``tensor``, ``channel`` or ``block``."""
    double_quant: bool = False
    input_scale: bool = False
    """Static activation quantization: one fp32 ``input_scale`` per linear layer."""
    source: str = ""

    @property
    def quantized(self) -> bool:
        return self.method != "none"

    def _groups(self, in_features: int) -> int:
        return 1 if self.group_size <= 0 else _ceil_div(in_features, self.group_size)

    @property
    def _input_scale_bytes(self) -> int:
        return _FP32 if self.input_scale else 0

    def linear_bytes(self, rows: int, cols: int) -> int:
        """Stored bytes of one ``rows (out) × cols (in)`` linear weight, scales and zero points included."""
        n = rows * cols
        if self.method in ("awq", "gptq", "int"):
            packed = _ceil_div(n * self.bits, 8)
            groups = self._groups(cols)
            scales = groups * rows * self.scale_itemsize
            zeros = _ceil_div(groups * rows * self.bits, 8) if self.zero_points else 0
            return packed + scales + zeros + (_FP32 * cols if self.g_idx else 0) + self._input_scale_bytes
        if self.method == "bnb-4bit":
            blocks = _ceil_div(n, _BNB_BLOCK)
            if self.double_quant:                          # uint8 absmax, its fp32 absmax per 256 blocks and code book
                absmax = blocks + _FP32 * (_ceil_div(blocks, _BNB_NESTED_BLOCK) + _BNB_NESTED_CODE)
            else:
                absmax = _FP32 * blocks
            return _ceil_div(n, 2) + absmax + 16 * _FP32
        if self.method == "bnb-8bit":
            return n + _FP32 * rows
        if self.method == "fp8":
            if self.block is not None:
                scales = _ceil_div(rows, self.block[0]) * _ceil_div(cols, self.block[1])
            else:
                scales = rows if self.strategy == "channel" else 1
            return n + _FP32 * scales + self._input_scale_bytes
        raise UsageError(f"cannot price linear layers quantized with {self.method!r}")

    def bytes_of(self, groups: Iterable[TensorGroup], dtype: str) -> int:
        """Bytes of ``groups``: linear layers as quantized, every other tensor at ``dtype``."""
        from memwatch.models.hf_config import dtype_itemsize
        from memwatch.models.parameters import LINEAR

        itemsize = dtype_itemsize(dtype)
        total = 0
        for group in groups:
            if group.kind == LINEAR and self.quantized:
                total += group.count * self.linear_bytes(group.rows, group.cols)
            else:
                total += group.elements * itemsize
        return total

    def describe(self) -> str:
        """One phrase for the plan: the scheme and where it was read."""
        if not self.quantized:
            return "not quantized"
        detail = {"bnb-4bit": "nf4/fp4" + (", double quant" if self.double_quant else ""),
                  "bnb-8bit": "LLM.int8"}.get(self.method)
        if detail is None and self.method == "fp8":
            detail = (f"block {self.block[0]}×{self.block[1]} scales" if self.block
                      else f"per-{self.strategy} scales")
        if detail is None:
            detail = f"{self.bits}-bit, " + (f"group {self.group_size}" if self.group_size > 0 else "per channel")
        return f"{self.method} {detail} ({self.source})" if self.source else f"{self.method} {detail}"


NO_QUANTIZATION = Quantization()


def _int(config: Mapping[str, Any], *keys: str, default: int) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def _compressed_tensors(config: Mapping[str, Any], source: str) -> Quantization:
    groups = config.get("config_groups") or {}
    group_config = next((group for group in groups.values()
                         if isinstance(group, Mapping) and isinstance(group.get("weights"), Mapping)), None)
    if group_config is None:
        raise UsageError(f"{source}: compressed-tensors config has no config_groups with weights; "
                         "pass --quantization or --weights-bytes")
    weights, activations = group_config["weights"], group_config.get("input_activations")
    static = isinstance(activations, Mapping) and activations.get("dynamic") is False
    bits = _int(weights, "num_bits", default=8)
    strategy = str(weights.get("strategy") or "tensor")
    if weights.get("type") == "float":
        block = weights.get("block_structure")
        return Quantization("fp8", 8, strategy="block" if block else strategy, input_scale=static,
                            block=tuple(block) if block else None, source=source)  # type: ignore[arg-type]
    group = _int(weights, "group_size", default=0) if strategy == "group" else 0
    return Quantization("int", bits, group_size=group, zero_points=not weights.get("symmetric", True),
                        input_scale=static, source=source)


def from_config(config: Mapping[str, Any]) -> Quantization:
    """The scheme of a ``config.json``'s ``quantization_config`` (none when it has none)."""
    quant = config.get("quantization_config") or config.get("compression_config")
    if not isinstance(quant, Mapping):
        return NO_QUANTIZATION
    method = str(quant.get("quant_method") or "").lower()
    method = _ALIASES.get(method, method)
    source = f"quantization_config: {method}"
    if method == "awq":
        return Quantization("awq", _int(quant, "bits", "w_bit", default=4),
                            group_size=_int(quant, "group_size", "q_group_size", default=128),
                            zero_points=bool(quant.get("zero_point", True)), source=source)
    if method == "gptq":
        return Quantization("gptq", _int(quant, "bits", default=4), group_size=_int(quant, "group_size", default=128),
                            zero_points=True, g_idx=True, source=source)
    if method == "bitsandbytes":
        if quant.get("load_in_4bit"):
            return Quantization("bnb-4bit", 4, double_quant=bool(quant.get("bnb_4bit_use_double_quant")),
                                source=source)
        if quant.get("load_in_8bit"):
            return Quantization("bnb-8bit", 8, source=source)
    if method == "fp8":
        block = quant.get("weight_block_size")
        return Quantization("fp8", 8, block=tuple(block) if block else None,  # type: ignore[arg-type]
                            strategy="block" if block else "tensor",
                            input_scale=quant.get("activation_scheme") == "static", source=source)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, source)
    raise UsageError(f"unsupported quant_method {quant.get('quant_method')!r} in the model config; pass "
                     f"--quantization ({', '.join(METHODS)}) or --weights-bytes")


def from_option(method: str, bits: int | None = None, group_size: int | None = None) -> Quantization:
    """The scheme ``--quantization`` names, with the common defaults (4-bit, groups of 128)."""
    key = method.lower()
    source = "--quantization"
    if key == "none":
        return NO_QUANTIZATION
    if key in ("awq", "gptq"):
        return Quantization(key, bits or 4, group_size=128 if group_size is None else group_size,
                            zero_points=True, g_idx=key == "gptq", source=source)
    if key == "bnb-4bit":
        return Quantization("bnb-4bit", 4, source=source)
    if key == "bnb-8bit":
        return Quantization("bnb-8bit", 8, source=source)
    if key == "fp8":
        return Quantization("fp8", 8, strategy="tensor", source=source)
    raise UsageError(f"unknown quantization {method!r}; use one of {', '.join(METHODS)}")
