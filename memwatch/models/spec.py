"""A model's shape as read from a Hugging Face ``config.json``, and the memory it implies.

:class:`ModelSpec` holds only what memory accounting needs: the attention geometry (MHA, GQA, MQA,
DeepSeek-style MLA), which layers use a sliding window, the MLP and MoE sizes, the vocabulary and the
precision. From it come the parameter count, the weight bytes per tensor-parallel rank and the KV-cache
bytes per token and per block, with the engines' rules for sharding:

* **Tensor parallel.** Query heads are split evenly, so TP must divide them. KV heads are split too;
  when ``tp >= num_key_value_heads`` each rank holds **one** whole KV head (heads are replicated, never
  split), which needs ``tp`` to be a multiple of the KV-head count.
* **MLA.** Each layer caches one latent of ``kv_lora_rank + qk_rope_head_dim`` elements per token
  (no separate K and V), and every TP rank holds the whole latent.
* **Pipeline parallel.** Layers are cut into ``pp`` contiguous stages, the first stages taking one
  extra layer when the count does not divide; a rank caches only its own layers.
* **Sliding window.** A sliding layer caches at most ``sliding_window`` tokens of a request; the
  per-token figures here count every layer, :meth:`ModelSpec.kv_bytes_for_sequence` applies the cap.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from memwatch.errors import NotFoundError
from memwatch.models.hf_config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfigError,
    canonical_dtype,
    config_fields,
    dtype_itemsize,
    read_config_file,
)
from memwatch.models.quantization import NO_QUANTIZATION, Quantization

__all__ = [
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "ModelConfigError",
    "ModelSpec",
    "canonical_dtype",
    "dtype_itemsize",
    "shipped_models",
]


def _configs_dir() -> Any:
    return resources.files("memwatch.models").joinpath("configs")


def shipped_models() -> list[str]:
    """Names of the model configs that ship with memwatch, sorted case-insensitively."""
    names = [entry.name[: -len(".json")] for entry in _configs_dir().iterdir()
             if entry.name.endswith(".json")]
    return sorted(names, key=str.lower)


@dataclass(frozen=True)
class ModelSpec:
    """The memory-relevant shape of a decoder-only transformer."""

    name: str
    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: str
    model_type: str = ""
    qkv_bias: bool = False
    """Bias on the q, k and v projections (Qwen2 always; Llama-style models with ``attention_bias``)."""
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    layer_types: tuple[str, ...] = ()
    """``full_attention`` or ``sliding_attention`` per layer; empty means all full."""
    sliding_window: int | None = None
    # Multi-head latent attention (DeepSeek-V2/V3); ``kv_lora_rank`` None means ordinary attention.
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Mixture of experts; ``n_routed_experts`` 0 means every layer has a dense MLP.
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    moe_layer_offset: int = 0
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE's shared expert width (it has a sigmoid gate of its own); 0 when absent."""
    mlp_only_layers: tuple[int, ...] = ()
    # Architecture variants of the families before Llama (GPT-2, BLOOM, Falcon, OPT, MPT, Phi ...).
    gated_mlp: bool = True
    """gate and up projections (SwiGLU); False for the two-matrix MLP of GPT-2 style models."""
    norm_bias: bool = False
    """LayerNorm with a bias (two vectors per norm) rather than RMSNorm."""
    learned_positions: int = 0
    """Rows of a learned position-embedding table (GPT-2, OPT, MPT without ALiBi); 0 for RoPE/ALiBi."""
    embedding_norm: bool = False
    final_norm: bool = True
    lm_head_bias: bool = False
    vision_parameters: int = 0
    """Parameters of a multimodal model's vision tower and projector, counted from ``vision_config``."""
    uncounted: str = ""
    """What the config describes but the count leaves out (an unknown vision tower), for the plan to say."""
    # Hybrid models: layers without attention keep a fixed state per sequence instead of per-token KV.
    quantization: Quantization = NO_QUANTIZATION
    """How the checkpoint stores its linear layers (its ``quantization_config``)."""
    mixer_kind: str = ""
    """``mamba`` when some layers are Mamba mixers; their indices are those not in ``attention_layers``."""
    attention_layers: tuple[int, ...] | None = None
    """Indices of the layers that have attention; None means every layer."""
    mamba_d_state: int = 0
    mamba_d_conv: int = 0
    mamba_d_inner: int = 0
    mamba_dt_rank: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_inner_norms: bool = False

    # ----------------------------------------------------------------------------------------- loading

    @classmethod
    def load(cls, name_or_path: str | os.PathLike[str]) -> ModelSpec:
        """Read a ``config.json`` file, a directory holding one, a Hugging Face repo id or a shipped model.

        The order: an existing path; a repo id (``org/name``, optionally ``@revision``) whose config is
        in the local Hugging Face cache; a shipped model (names match case-insensitively and may carry
        an organisation prefix, ``Qwen/Qwen2.5-7B-Instruct``); then, unless ``HF_HUB_OFFLINE`` is set,
        the repo's ``config.json`` downloaded from the Hub. Nothing touches the network before that
        last step.
        """
        from memwatch.models import hub

        path = Path(name_or_path)
        if path.is_dir():
            path = path / "config.json"
            if not path.is_file():
                raise ModelConfigError(f"{name_or_path}: directory has no config.json; "
                                       "pass the config file or the model directory that holds it")
        if path.is_file():
            return cls.from_config(read_config_file(path), name=_name_for(path))
        text = str(name_or_path)
        if "/" not in text and "@" not in text and (plain := _shipped_path(text)) is not None:
            return cls.from_config(json.loads(plain.read_text(encoding="utf-8")), name=plain.name[: -len(".json")])
        looks_like_path = path.suffix == ".json" or path.is_absolute() or text.startswith((".", "~"))
        repo = None if looks_like_path else hub.parse(text)
        cached = hub.cached_config(repo) if repo is not None else None
        if repo is not None and cached is not None:
            return cls.from_config(read_config_file(cached), name=repo.repo_id)
        shipped = _shipped_path(text) if repo is None or repo.revision is None else None
        if shipped is not None:
            return cls.from_config(json.loads(shipped.read_text(encoding="utf-8")),
                                   name=shipped.name[: -len(".json")])
        if repo is not None and not hub.offline():
            return cls.from_config(read_config_file(hub.download_config(repo)), name=repo.repo_id)
        if looks_like_path:
            raise NotFoundError(f"model config {text!r}: no such file or directory; pass an existing config.json, "
                                "a directory holding one, or a model name")
        offline = " (HF_HUB_OFFLINE is set, so nothing was downloaded)" if repo is not None else ""
        raise NotFoundError(
            f"unknown model {text!r}: not a file or directory, not in the Hugging Face cache {hub.cache_dir()}"
            f"{offline}, and not a shipped model ({', '.join(shipped_models())}); pass a config.json, "
            "or download it with: hf download <org/name> config.json"
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str = "model") -> ModelSpec:
        """Build a spec from a parsed ``config.json`` (multimodal configs: their ``text_config``)."""
        return cls(**config_fields(config, name))

    # ------------------------------------------------------------------------------------ attention

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def attention_kind(self) -> str:
        """``MLA``, ``MHA`` (one KV head per query head), ``MQA`` (one KV head) or ``GQA``."""
        if self.is_mla:
            return "MLA"
        if self.num_key_value_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_key_value_heads == 1 else "GQA"

    @property
    def num_sliding_layers(self) -> int:
        return sum(kind == SLIDING_ATTENTION for kind in self.layer_types)

    def check_tp(self, tp: int) -> None:
        """Raise :class:`ModelConfigError` unless ``tp`` can shard this model's attention heads."""
        if tp < 1:
            raise ModelConfigError(f"tensor parallel size must be at least 1, got {tp}")
        heads = self.num_attention_heads
        if heads % tp:
            divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
            raise ModelConfigError(
                f"tensor parallel size {tp} does not divide the {heads} query heads of {self.name}; "
                f"use one of {divisors}"
            )
        kv = self.num_key_value_heads
        if not self.is_mla and (kv % tp if tp < kv else tp % kv):
            raise ModelConfigError(
                f"tensor parallel size {tp} cannot shard the {kv} KV heads of {self.name}: "
                f"it must divide {kv} or be a multiple of it"
            )

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """KV heads one TP rank holds: ``kv / tp``, or one replicated head when ``tp >= kv``."""
        self.check_tp(tp)
        return max(1, self.num_key_value_heads // tp)

    def pipeline_stages(self, pp: int = 1) -> list[range]:
        """The contiguous layer ranges of each pipeline rank; the first ranks take the remainder."""
        layers = self.num_hidden_layers
        if not 1 <= pp <= layers:
            raise ModelConfigError(f"pipeline parallel size must be between 1 and {layers} "
                                   f"(the layer count of {self.name}), got {pp}")
        base, extra = divmod(layers, pp)
        stages, start = [], 0
        for rank in range(pp):
            size = base + (rank < extra)
            stages.append(range(start, start + size))
            start += size
        return stages

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    # ------------------------------------------------------------------------------------------ KV

    def kv_bytes_per_token_per_layer(self, tp: int = 1, kv_dtype: str | None = None) -> int:
        """Bytes one layer caches for one token on one TP rank (K and V, or MLA's single latent)."""
        itemsize = dtype_itemsize(kv_dtype or self.dtype)
        if self.is_mla:
            self.check_tp(tp)
            return (self.kv_lora_rank or 0) * itemsize + self.qk_rope_head_dim * itemsize
        return 2 * self.kv_heads_per_rank(tp) * self.head_dim * itemsize

    def kv_bytes_per_token_split(self, tp: int = 1, pp: int = 1, kv_dtype: str | None = None,
                                 pp_rank: int = 0) -> tuple[int, int]:
        """Per-token KV bytes of one rank, split into (full-attention layers, sliding layers)."""
        per_layer = self.kv_bytes_per_token_per_layer(tp, kv_dtype)
        stage = [layer for layer in self.pipeline_stages(pp)[pp_rank] if self.has_attention(layer)]
        sliding = sum(self.layer_type(layer) == SLIDING_ATTENTION for layer in stage)
        return per_layer * (len(stage) - sliding), per_layer * sliding

    def state_bytes_per_sequence(self, tp: int = 1, pp: int = 1, dtype: str | None = None) -> int:
        """Fixed bytes per sequence that a hybrid model's non-attention layers keep (0 otherwise).

        These layers cache no per-token KV; each holds a state whose size does not grow with the
        sequence (see :mod:`memwatch.models.hybrid`).
        """
        from memwatch.models.hybrid import state_bytes_per_layer

        if self.attention_layers is None:
            return 0
        per_layer = state_bytes_per_layer(self, tp, dtype or self.dtype)
        return max(per_layer * sum(not self.has_attention(layer) for layer in stage)
                   for stage in self.pipeline_stages(pp))

    def kv_bytes_per_token(self, tp: int = 1, pp: int = 1, kv_dtype: str | None = None) -> int:
        """Per-token KV bytes on the busiest rank, every layer counted (no sliding-window cap).

        ``2 × layers_of_rank × kv_heads_per_rank × head_dim × itemsize`` for MHA/GQA;
        ``layers_of_rank × (kv_lora_rank + qk_rope_head_dim) × itemsize`` for MLA.
        """
        return max(sum(self.kv_bytes_per_token_split(tp, pp, kv_dtype, rank)) for rank in range(pp))

    def kv_bytes_for_sequence(self, seq_len: int, tp: int = 1, pp: int = 1,
                              kv_dtype: str | None = None) -> int:
        """Ideal KV bytes of one sequence on the busiest rank, sliding layers capped at the window."""
        window = self.sliding_window or seq_len
        return max(full * seq_len + sliding * min(seq_len, window)
                   for full, sliding in (self.kv_bytes_per_token_split(tp, pp, kv_dtype, rank)
                                         for rank in range(pp)))

    def block_bytes(self, block_size: int, tp: int = 1, kv_dtype: str | None = None, pp: int = 1) -> int:
        """Bytes of one KV block on the busiest rank.

        For full attention this is nano-vllm's
        ``2 × num_hidden_layers × block_size × (num_key_value_heads // tp) × head_dim × itemsize``
        (with one replicated head when ``tp >= num_key_value_heads``).
        """
        if block_size < 1:
            raise ModelConfigError(f"block size must be at least 1 token, got {block_size}")
        return block_size * self.kv_bytes_per_token(tp, pp, kv_dtype)

    # ------------------------------------------------------------------------------------- weights

    def parameter_breakdown(self, tp: int = 1, pp: int = 1, pp_rank: int = 0) -> dict[str, int]:
        """Parameters one rank holds, by part: embeddings, attention, MLP, norms, LM head."""
        from memwatch.models.parameters import parameter_breakdown

        return parameter_breakdown(self, tp, pp, pp_rank)

    def num_parameters(self) -> int:
        """Total parameters counted from the config (the LM head only when untied)."""
        return sum(self.parameter_breakdown().values())

    def weight_bytes(self, dtype: str | None = None, tp: int = 1, pp: int = 1,
                     quantization: Quantization | None = None) -> int:
        """Weight bytes of the heaviest rank at ``dtype`` (default: the model's own precision).

        With ``quantization`` (default: the checkpoint's own ``quantization_config``), linear layers
        are priced as that scheme stores them; everything else stays at ``dtype``.
        """
        from memwatch.models.parameters import tensor_groups

        scheme = self.quantization if quantization is None else quantization
        unquantized = dtype or self.dtype
        return max(scheme.bytes_of(tensor_groups(self, tp, pp, rank), unquantized) for rank in range(pp))

    def is_moe_layer(self, layer: int) -> bool:
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense_replace
                and layer % max(1, self.moe_layer_freq) == self.moe_layer_offset
                and layer not in self.mlp_only_layers)

    def has_attention(self, layer: int) -> bool:
        """Whether ``layer`` is an attention layer (every layer is, except in hybrid models)."""
        return self.attention_layers is None or layer in self.attention_layers


# ------------------------------------------------------------------------------------------ names


def _name_for(config_path: Path) -> str:
    if config_path.name == "config.json":
        return config_path.resolve().parent.name or "model"
    return config_path.stem


def _shipped_path(name: str) -> Any:
    wanted = name.strip().rstrip("/").rsplit("/", 1)[-1].lower()
    wanted = wanted.removesuffix(".json")
    for entry in _configs_dir().iterdir():
        if entry.name.lower() == f"{wanted}.json":
            return entry
    return None
