"""Checkpoint tensors by name and shape, and the safetensors index a checkpoint of them records."""

from __future__ import annotations

import math

Shapes = dict[str, tuple[int, ...]]


def per_layer(prefix: str, layers: int, tensors: Shapes) -> Shapes:
    """``{prefix}.{i}.{name}`` for every layer."""
    return {f"{prefix}.{i}.{name}": shape for i in range(layers) for name, shape in tensors.items()}


def safetensors_index(tensors: Shapes, itemsize: int) -> dict[str, object]:
    """A ``model.safetensors.index.json`` for ``tensors`` stored in one shard."""
    total = sum(math.prod(shape) for shape in tensors.values()) * itemsize
    return {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(tensors, "model.safetensors")}


def parameters(tensors: Shapes) -> int:
    return sum(math.prod(shape) for shape in tensors.values())
