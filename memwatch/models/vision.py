"""The parameters of a multimodal model's vision tower and projector, from its ``vision_config``.

Counted for the ViT towers that LLaVA-style models use (CLIP, SigLIP): a patch embedding convolution
(``channels × patch² × hidden``, with a bias for SigLIP), position embeddings (one per patch, plus a
class token for CLIP), per layer q/k/v/o projections and a two-matrix MLP, all with biases, and two
LayerNorms with biases; CLIP adds a LayerNorm before the layers, both a final one. LLaVA's projector
(``multi_modal_projector``) is two linear layers with biases, vision hidden → text hidden → text hidden.

Qwen2-VL and Qwen2.5-VL have towers of their own (``depth`` blocks of ``embed_dim``/``hidden_size``):
a 3-D patch convolution without bias (``channels × temporal_patch × patch² × width``), per block a fused
qkv and an output projection with biases, an MLP with biases (Qwen2-VL: two matrices of ``mlp_ratio ×
width`` and LayerNorms with biases; Qwen2.5-VL: gated, ``intermediate_size`` wide, RMSNorms), and a
merger that normalises, concatenates ``spatial_merge_size²`` patches and maps them through two linear
layers with biases to the text width. Other towers are not counted, and the plan says so.
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


def _qwen_vl_tower(vision: Mapping[str, Any], text_hidden: int, gated: bool) -> int:
    """Qwen2-VL (``gated`` False) or Qwen2.5-VL vision tower with its merger, in parameters."""
    width = _int(vision, "hidden_size" if gated else "embed_dim", 0)
    mlp = _int(vision, "intermediate_size", 0) if gated else int(width * float(vision.get("mlp_ratio") or 4))
    out = _int(vision, "out_hidden_size", text_hidden) if gated else _int(vision, "hidden_size", text_hidden)
    patch, frames = _int(vision, "patch_size", 14), _int(vision, "temporal_patch_size", 2)
    merged = width * _int(vision, "spatial_merge_size", 2) ** 2
    norm = width if gated else 2 * width                                     # RMSNorm, or LayerNorm with bias
    per_block = (2 * norm + width * 3 * width + 3 * width + width * width + width
                 + (2 if gated else 1) * (width * mlp + mlp) + mlp * width + width)
    merger = norm + merged * merged + merged + merged * out + out
    return _int(vision, "in_chans", 3) * frames * patch * patch * width + _int(vision, "depth", 0) * per_block + merger


def vision_parameters(raw: Mapping[str, Any], text_hidden: int) -> tuple[int, str]:
    """Tower plus projector of a multimodal config, and a note when its layout is not one counted here."""
    vision = raw.get("vision_config")
    if not isinstance(vision, Mapping):
        return 0, ""
    model_type = str(raw.get("model_type") or "")
    if model_type in ("qwen2_vl", "qwen2_5_vl") or "depth" in vision:
        return _qwen_vl_tower(vision, text_hidden, gated="out_hidden_size" in vision or model_type == "qwen2_5_vl"), ""
    kind = str(vision.get("model_type") or "")
    if kind.startswith(("clip", "siglip")) or "projector_hidden_act" in raw:
        tower = vision_tower_parameters(vision)
        return tower + projector_parameters(raw, _int(vision, "hidden_size", 0), text_hidden), ""
    return 0, f"the vision tower ({kind or 'unknown layout'}) is not counted"
