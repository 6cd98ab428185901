"""The parameters of a multimodal model's vision tower and projector, from its ``vision_config``.

Counted for the ViT towers that LLaVA-style models use (CLIP, SigLIP): a patch embedding convolution
(``channels × patch² × hidden``, with a bias for SigLIP), position embeddings (one per patch, plus a
class token for CLIP), per layer q/k/v/o projections and a two-matrix MLP, all with biases, and two
LayerNorms with biases; CLIP adds a LayerNorm before the layers, both a final one. LLaVA's projector
(``multi_modal_projector``) is two linear layers with biases, vision hidden → text hidden → text hidden.
The text model's weights are counted separately from ``text_config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _int(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


def vision_tower_parameters(vision: Mapping[str, Any]) -> int:
    """Parameters of a CLIP- or SigLIP-style vision tower."""
    hidden = _int(vision, "hidden_size", 0)
    if not hidden:
        return 0
    width = _int(vision, "intermediate_size", 4 * hidden)
    layers = _int(vision, "num_hidden_layers", 0)
    patch, image = _int(vision, "patch_size", 14), _int(vision, "image_size", 224)
    channels = _int(vision, "num_channels", 3)
    clip = "siglip" not in str(vision.get("model_type") or "")
    patches = (image // patch) ** 2
    embeddings = channels * patch * patch * hidden + (0 if clip else hidden)       # conv (SigLIP: with bias)
    embeddings += (patches + 1) * hidden + hidden if clip else patches * hidden    # positions (+ class token)
    per_layer = 4 * (hidden * hidden + hidden) + 2 * hidden * width + width + hidden + 4 * hidden
    norms = (2 if clip else 1) * 2 * hidden                                         # pre (CLIP) and post
    return embeddings + layers * per_layer + norms


def projector_parameters(raw: Mapping[str, Any], vision_hidden: int, text_hidden: int) -> int:
    """LLaVA's two-layer projector; other multimodal families: one vision → text linear layer."""
    if "projector_hidden_act" in raw:
        return vision_hidden * text_hidden + text_hidden + text_hidden * text_hidden + text_hidden
    return vision_hidden * text_hidden


def vision_parameters(raw: Mapping[str, Any], text_hidden: int) -> int:
    """Tower plus projector of a multimodal config; 0 when it has no ``vision_config``."""
    vision = raw.get("vision_config")
    if not isinstance(vision, Mapping):
        return 0
    tower = vision_tower_parameters(vision)
    if not tower:
        return 0
    return tower + projector_parameters(raw, _int(vision, "hidden_size", 0), text_hidden)
