"""Translation of a Hugging Face ``config.json`` into the fields of :class:`~memwatch.models.spec.ModelSpec`.

Configs say some things only implicitly, by ``model_type``: Qwen2's q/k/v projections carry a bias,
Qwen3 and Gemma 3 normalise each query and key head, Gemma has four norms per layer and ties its LM
head by default. Sliding windows come in four spellings (``layer_types``, Gemma 3's
``sliding_window_pattern``, Gemma 2's alternation, Qwen's ``use_sliding_window`` with
``max_window_layers``); a ``sliding_window`` alone (Mistral) means every layer slides.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memwatch.errors import UsageError
from memwatch.models.bounds import check_bounds, parse_int
from memwatch.models.families import moe_and_hybrid, normalize
from memwatch.models.quantization import from_config as quantization_from_config
from memwatch.models.vision import vision_parameters

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

_ITEMSIZE = {
    "bfloat16": 2, "bf16": 2,
    "float16": 2, "fp16": 2, "half": 2,
    "float32": 4, "fp32": 4, "float": 4,
}
_CANONICAL_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                    "float": "float32"}
# Architectures whose q/k/v projections carry a bias although their config has no ``attention_bias``.
_QKV_BIAS_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"})
# Architectures with an RMSNorm over each query and key head.
_QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text"})
# Architectures with four norms per layer (pre/post attention, pre/post feed-forward) instead of two.
_SANDWICH_NORM_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text"})
# Architectures that tie the LM head to the embeddings unless the config says otherwise.
_TIED_BY_DEFAULT_MODEL_TYPES = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})


# Transformers' class defaults for the fields a multimodal ``text_config`` may leave out (LlamaConfig).
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "vocab_size": 32000, "tie_word_embeddings": False},
}


class ModelConfigError(UsageError):
    """A model name, config file or config field that memwatch cannot use."""


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype``: bf16/bfloat16 and fp16/float16 are 2, fp32/float32 4, fp8* 1."""
    key = dtype.strip().lower().removeprefix("torch.")
    if key.startswith(("fp8", "float8")):
        return 1
    try:
        return _ITEMSIZE[key]
    except KeyError:
        raise ModelConfigError(
            f"unknown dtype {dtype!r}; use one of bfloat16, float16, float32 or fp8"
        ) from None


def canonical_dtype(dtype: str) -> str:
    """The long spelling of a dtype (``bf16`` -> ``bfloat16``); fp8 spellings are kept as given."""
    dtype_itemsize(dtype)
    key = dtype.strip().lower().removeprefix("torch.")
    return _CANONICAL_DTYPE.get(key, key)


def read_config_file(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or a one-line error saying what is wrong with the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_int=parse_int)
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{path}: cannot read the model config ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: not valid JSON at line {exc.lineno} ({exc.msg})") from None
    except (ValueError, RecursionError) as exc:
        raise ModelConfigError(f"{path}: not a usable model config ({str(exc)[:100]})") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: a model config must be a JSON object")
    return data


def _field(config: Mapping[str, Any], key: str, name: str, default: Any = None,
           required: bool = False) -> Any:
    value = config.get(key)
    if value is None:
        if required:
            raise ModelConfigError(f"model config {name!r} lacks {key!r}; "
                                   "pass a Hugging Face config.json of a decoder-only model")
        return default
    return value


def _positive_int(config: Mapping[str, Any], key: str, name: str, default: int | None = None) -> int:
    value = _field(config, key, name, default, required=default is None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelConfigError(f"model config {name!r}: {key!r} must be a non-negative integer, "
                               f"got {value!r}")
    return value


def _layer_types(config: Mapping[str, Any], name: str, layers: int, model_type: str,
                 window: int | None) -> tuple[str, ...]:
    """Which layers slide, from ``layer_types``, Gemma's patterns, or Qwen's/Mistral's window fields."""
    explicit = config.get("layer_types")
    if explicit is not None:
        unknown = sorted({kind for kind in explicit if kind not in (FULL_ATTENTION, SLIDING_ATTENTION)})
        if unknown:
            raise ModelConfigError(f"model config {name!r}: unsupported layer types {unknown}; "
                                   f"memwatch models {FULL_ATTENTION} and {SLIDING_ATTENTION} layers")
        if len(explicit) != layers:
            raise ModelConfigError(f"model config {name!r}: layer_types lists {len(explicit)} layers, "
                                   f"num_hidden_layers is {layers}")
        return tuple(explicit)
    if window is None:
        return ()
    if config.get("sliding_window_pattern"):
        pattern = int(config["sliding_window_pattern"])
        sliding = [(layer + 1) % pattern != 0 for layer in range(layers)]
    elif model_type == "gemma2":
        sliding = [layer % 2 == 0 for layer in range(layers)]
    elif "use_sliding_window" in config:
        start = int(config.get("max_window_layers") or 0)
        sliding = [bool(config["use_sliding_window"]) and layer >= start for layer in range(layers)]
    else:
        sliding = [True] * layers
    if not any(sliding):
        return ()
    return tuple(SLIDING_ATTENTION if slides else FULL_ATTENTION for slides in sliding)


def _text_config(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a multimodal config, with Transformers' class defaults filled in."""
    text = raw.get("text_config")
    if "hidden_size" in raw or not isinstance(text, Mapping):
        return raw
    defaults = _CLASS_DEFAULTS.get(str(text.get("model_type") or ""), {})
    return {**defaults, **text, "torch_dtype": text.get("torch_dtype") or raw.get("torch_dtype") or raw.get("dtype"),
            "quantization_config": raw.get("quantization_config")}


def config_fields(raw: Mapping[str, Any], name: str) -> dict[str, Any]:
    """ModelSpec's fields from a parsed ``config.json`` (multimodal configs: their ``text_config``)."""
    if not isinstance(raw, Mapping):
        raise ModelConfigError(f"model config {name!r} must be a JSON object")
    check_bounds(raw, name)  # before anything loops over layers or multiplies widths
    config = normalize(_text_config(raw))
    model_type = str(config.get("model_type") or raw.get("model_type") or "")
    if config.get("_unsupported"):
        raise ModelConfigError(f"model config {name!r}: {config['_unsupported']} is not modelled; "
                               "pass --weights-bytes and --kv-cache-memory-bytes instead")
    hidden = _positive_int(config, "hidden_size", name)
    heads = _positive_int(config, "num_attention_heads", name)
    layers = _positive_int(config, "num_hidden_layers", name)
    if not (hidden and heads and layers):
        raise ModelConfigError(f"model config {name!r}: hidden_size, num_attention_heads and "
                               "num_hidden_layers must be positive")
    kv_heads = _positive_int(config, "num_key_value_heads", name, default=heads) or heads
    head_dim = _positive_int(config, "head_dim", name, default=hidden // heads) or hidden // heads
    raw_dtype = str(_field(config, "torch_dtype", name) or _field(config, "dtype", name, "float32"))
    try:
        dtype = canonical_dtype(raw_dtype)
    except ModelConfigError:
        raise ModelConfigError(f"model config {name!r}: unsupported torch_dtype {raw_dtype!r}") from None
    window = config.get("sliding_window")
    window = int(window) if window else None
    layer_types = _layer_types(config, name, layers, model_type, window)
    attention_bias = bool(config.get("attention_bias", False))
    kv_lora_rank = config.get("kv_lora_rank")

    vision = vision_parameters(raw, hidden)
    fields = dict(
        name=name,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_hidden_layers=layers,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_positive_int(config, "intermediate_size", name),
        vocab_size=_positive_int(config, "vocab_size", name),
        tie_word_embeddings=bool(config.get("tie_word_embeddings",
                                            model_type in _TIED_BY_DEFAULT_MODEL_TYPES)),
        dtype=dtype,
        model_type=model_type,
        qkv_bias=attention_bias or bool(config.get("_qkv_bias")) or model_type in _QKV_BIAS_MODEL_TYPES,
        o_bias=attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=model_type in _QK_NORM_MODEL_TYPES,
        norms_per_layer=config.get("_norms_per_layer") or (4 if model_type in _SANDWICH_NORM_MODEL_TYPES else 2),
        gated_mlp=config.get("_gated_mlp", True),
        norm_bias=config.get("_norm_bias", False),
        learned_positions=config.get("_learned_positions", 0),
        embedding_norm=config.get("_embedding_norm", False),
        final_norm=config.get("_final_norm", True),
        lm_head_bias=config.get("_lm_head_bias", False),
        vision_parameters=vision[0],
        uncounted=vision[1],
        quantization=quantization_from_config(config),
        layer_types=layer_types,
        sliding_window=window if layer_types else None,
        kv_lora_rank=None if kv_lora_rank is None else _positive_int(config, "kv_lora_rank", name),
        q_lora_rank=_positive_int(config, "q_lora_rank", name, default=0) or None,
        qk_nope_head_dim=_positive_int(config, "qk_nope_head_dim", name, default=0),
        qk_rope_head_dim=_positive_int(config, "qk_rope_head_dim", name, default=0),
        v_head_dim=_positive_int(config, "v_head_dim", name, default=0),
        n_shared_experts=_positive_int(config, "n_shared_experts", name, default=0),
        num_experts_per_tok=_positive_int(config, "num_experts_per_tok", name, default=0),
        first_k_dense_replace=_positive_int(config, "first_k_dense_replace", name, default=0),
        moe_layer_freq=_positive_int(config, "moe_layer_freq", name, default=1),
    )
    fields.update(moe_and_hybrid(config, model_type))
    return fields
