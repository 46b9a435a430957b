"""The ``model.vision`` section: a LLaVA-style vision tower and projector beside the decoder (issue 31, SPEC L3.8).

Absent (the default), the model is the text-only decoder. Present, a CLIP-style ViT encodes each image into patch
features, a two-layer MLP projects them to the decoder's width, and they replace the image placeholder tokens of the
sequence (one placeholder per feature) before the decoder runs. :func:`vision_errors` holds every check that
involves more than one field; the job config (``config.checks``) and the model's own config
(``models.vision.VisionConfig``) both run it, so each error names its ``model.vision.…`` path.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kuangchao_core.config.section import Float, Int, Section

#: activations the projector may use (transformers' ``ACT2FN`` names)
PROJECTOR_ACTS = ("gelu", "gelu_pytorch_tanh", "quick_gelu", "silu", "relu")
#: upper bounds of the tower's sizes (refused before anything is built)
VISION_LIMITS = {"image_size": 1 << 14, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_layers": 256}


class VisionSection(Section):
    """The vision tower (CLIP ViT, as transformers' ``CLIPVisionModel``) and the LLaVA projector.

    With ``model.checkpoint`` a LLaVA directory, every field but ``freeze``, ``parallel`` and
    ``tensor_parallel_size`` comes from its ``config.json`` (``vision: {}`` takes them all); a field the job sets
    must agree with it."""

    #: which vision model the tower reproduces (CLIP's; SigLIP is not built yet)
    tower: Literal["clip"] = "clip"
    image_size: Int = Field(default=32, ge=1, description="side of the square input image, in pixels")
    patch_size: Int = Field(default=8, ge=1, description="side of one square patch; must divide image_size")
    num_channels: Int = Field(default=3, ge=1, le=16)
    hidden_size: Int = Field(default=64, ge=1, description="the tower's width")
    intermediate_size: Int = Field(default=256, ge=1, description="width of each encoder layer's MLP")
    num_layers: Int = Field(default=2, ge=1)
    num_heads: Int = Field(default=4, ge=1)
    layer_norm_eps: Float = Field(default=1e-5, gt=0)
    #: activation of the tower's MLPs (CLIP: ``quick_gelu``, x·sigmoid(1.702·x))
    hidden_act: Literal["quick_gelu", "gelu"] = "quick_gelu"
    #: which hidden state feeds the projector: 0 = the embeddings after the pre-norm, k = after encoder layer k,
    #: negative counts from the end (LLaVA's ``vision_feature_layer``; -2 = the input of the last layer)
    feature_layer: Int = -2
    #: ``default`` drops the class token (one feature per patch), ``full`` keeps it (LLaVA's select strategy)
    feature_select: Literal["default", "full"] = "default"
    projector_hidden_act: Literal[PROJECTOR_ACTS] = "gelu"
    projector_bias: bool = True
    #: the placeholder token id; each image's features replace as many of them (unset: the vocabulary's last id)
    image_token_id: Int | None = Field(default=None, ge=0)
    #: the tower and projector stay at their initial (or loaded) weights: never in the optimizer, as a LoRA base
    freeze: bool = False
    #: the encoder's layout: ``data`` = replicated on every rank, each TP rank encoding its share of a micro-batch's
    #: images, features all-gathered for the TP-sharded decoder, gradients reduced over TP x DP; ``tp`` = attention
    #: (q/k/v by heads, out_proj) and MLP (fc1, fc2) split over groups of ``tensor_parallel_size`` ranks carved out
    #: of the decoder's TP group, the groups encoding disjoint shares of the images as under ``data``
    parallel: Literal["data", "tp"] = "data"
    #: ranks of the encoder's own TP group under ``parallel: tp`` (unset: the decoder's
    #: ``parallel.tensor_parallel_size``); it must divide the decoder's TP size, ``num_heads`` and
    #: ``intermediate_size``
    tensor_parallel_size: Int | None = Field(default=None, ge=1)


class ImagesSection(Section):
    """Image-text records (``data.images``, issue 31): the data gate's limits and the decode pool
    (``kuangchao_core.data.image_data``); image paths are relative to each JSON-lines file's directory."""

    #: width x height above which an image is refused before any pixel is decoded: from its header, and from the size
    #: the resize to the tower's ``image_size`` would give it (4096 x 4096)
    max_pixels: Int = Field(default=1 << 24, ge=1, le=1 << 32)
    #: long side over short side above which an image is refused from its header (the resize to the tower's size
    #: would stretch the long side as many times; issue 38)
    max_aspect_ratio: Float = Field(default=20.0, ge=1, le=1 << 32)
    #: threads decoding images (Pillow releases the GIL); 0 decodes in the caller's thread
    decode_workers: Int = Field(default=4, ge=0, le=256)


def image_tokens_per_image(v: Any) -> int:
    """Placeholders one image fills: its patches, plus the class token when ``feature_select`` is ``full``."""
    return (v.image_size // v.patch_size) ** 2 + (1 if v.feature_select == "full" else 0)


def vision_errors(v: Any, vocab_size: int | None = None, prefix: str = "model.vision") -> list[tuple[str, str]]:
    """``(path, message)`` for each size of ``v`` (a :class:`VisionSection` or the model's ``VisionConfig``) that is
    inconsistent, out of bounds, or (with ``vocab_size``) a placeholder id outside the vocabulary."""
    errs: list[tuple[str, str]] = []
    for name, limit in VISION_LIMITS.items():
        if int(getattr(v, name)) > limit:
            errs.append((f"{prefix}.{name}", f"{getattr(v, name)} is above the limit {limit}"))
    if v.hidden_size % v.num_heads:
        errs.append((f"{prefix}.num_heads", f"hidden_size {v.hidden_size} is not divisible by num_heads {v.num_heads}"))
    if v.patch_size > v.image_size or v.image_size % v.patch_size:
        errs.append(
            (f"{prefix}.patch_size", f"patch_size {v.patch_size} does not divide image_size {v.image_size} evenly")
        )
    if not -(v.num_layers + 1) <= v.feature_layer <= v.num_layers:
        errs.append(
            (
                f"{prefix}.feature_layer",
                f"{v.feature_layer} is not a hidden state of a {v.num_layers}-layer tower "
                f"(use {-(v.num_layers + 1)}..{v.num_layers})",
            )
        )
    token = v.image_token_id
    if vocab_size is not None and token is not None and not 0 <= token < vocab_size:
        errs.append((f"{prefix}.image_token_id", f"{token} is outside the vocabulary [0, {vocab_size})"))
    return errs


def encoder_tp_size(v: Any, decoder_tp: int) -> int:
    """The encoder's TP size: 1 under ``parallel: data``, else ``tensor_parallel_size`` (unset: ``decoder_tp``)."""
    if v.parallel != "tp":
        return 1
    return int(v.tensor_parallel_size or decoder_tp)


def vision_layout_errors(v: Any, decoder_tp: int, prefix: str = "model.vision") -> list[tuple[str, str]]:
    """``(path, message)`` for each way the encoder's layout (``parallel``, ``tensor_parallel_size``) of section
    ``v`` does not fit a decoder TP group of ``decoder_tp`` ranks or the tower's sizes."""
    if v.parallel != "tp":
        if v.tensor_parallel_size not in (None, 1):
            return [(f"{prefix}.tensor_parallel_size", f"only read with {prefix}.parallel: tp (it is data)")]
        return []
    errs: list[tuple[str, str]] = []
    e = encoder_tp_size(v, decoder_tp)
    if decoder_tp % e:
        errs.append(
            (
                f"{prefix}.tensor_parallel_size",
                f"{e} does not divide the decoder's parallel.tensor_parallel_size {decoder_tp} "
                "(the encoder's TP groups are carved out of the decoder's)",
            )
        )
    for name in ("num_heads", "intermediate_size"):
        if int(getattr(v, name)) % e:
            errs.append((f"{prefix}.{name}", f"{getattr(v, name)} is not divisible by the encoder's TP size {e}"))
    return errs
