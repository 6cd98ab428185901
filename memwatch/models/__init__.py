"""Model shapes from Hugging Face configs, and the memory they imply (weights, KV cache, activations)."""

from memwatch.models.activation import forward_activation_bytes, warmup_batch
from memwatch.models.spec import ModelConfigError, ModelSpec, dtype_itemsize, shipped_models

__all__ = [
    "ModelConfigError",
    "ModelSpec",
    "dtype_itemsize",
    "forward_activation_bytes",
    "shipped_models",
    "warmup_batch",
]
