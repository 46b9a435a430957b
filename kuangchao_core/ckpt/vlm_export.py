"""A vision-language checkpoint as a transformers LLaVA directory (``kc checkpoint convert --format hf``, issue 31).

The checkpoint holds what the job trained, in any layout: the decoder under ``language_model.`` and the tower and
projector as whole tensors. What it did not train — a frozen encoder (``model.vision.freeze``), the tower layers the
features do not depend on — is read again from the LLaVA directory the job started from (``vision_base`` in the
manifest: its path and identity) or else drawn again from the job's seed (``vision_seed``), as the trainer drew it
(:func:`~kuangchao_core.models.vlm.init_vision_from_seed`), and the whole is written by
:func:`~kuangchao_core.ckpt.hf_llava.write_hf_llava_dir`.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kuangchao_core.ckpt.hf_llava import load_hf_llava_weights_for_layout, vlm_full_shapes, write_hf_llava_dir
from kuangchao_core.errors import CheckpointError
from kuangchao_core.models.layout import Region
from kuangchao_core.models.vision import VisionTower, vision_config
from kuangchao_core.models.vlm import LlavaProjector, init_vision_from_seed


def seeded_encoder(vision: Any, text_hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """The tower's and projector's initial weights for ``seed`` (our names), as the trainer drew them."""
    parts = SimpleNamespace(
        vision_tower=VisionTower(vision),
        multi_modal_projector=LlavaProjector(
            vision.hidden_size, text_hidden, vision.projector_hidden_act, vision.projector_bias
        ),
    )
    init_vision_from_seed(parts, seed)  # type: ignore[arg-type]
    return {
        f"{prefix}.{n}": p.detach()
        for prefix in ("vision_tower", "multi_modal_projector")
        for n, p in getattr(parts, prefix).named_parameters()
    }


def export_hf_llava(
    tensors: dict[str, torch.Tensor], manifest: dict[str, Any], cfg: Any, out_dir: str | os.PathLike[str], dtype="fp32"
) -> Path:
    """Write the LLaVA directory of a checkpoint's full parameters ``tensors`` (its ``manifest``, its decoder config
    ``cfg``) into ``out_dir``."""
    if manifest.get("lora") is not None:
        raise CheckpointError("a vision-language checkpoint with LoRA adapters: merged export is not built yet")
    vision = vision_config(manifest["model"]["vision"], cfg.vocab_size)
    tensors = dict(tensors)
    shapes = vlm_full_shapes(cfg, vision)
    missing = [n for n in shapes if n not in tensors]
    if any(not n.startswith(("vision_tower.", "multi_modal_projector.")) for n in missing):
        raise CheckpointError(f"parameters missing from the checkpoint: {missing[:5]}")
    if missing and manifest.get("vision_base") is not None:
        tensors.update(pretrained_encoder(manifest["vision_base"], cfg, vision, missing))
    elif missing:
        if "vision_seed" not in manifest:
            raise CheckpointError(f"untrained encoder parameters {missing[:3]} and no vision_seed in the manifest")
        seeded = seeded_encoder(vision, cfg.hidden_size, int(manifest["vision_seed"]))
        tensors.update({n: seeded[n] for n in missing})
    return write_hf_llava_dir(tensors, cfg, vision, out_dir, dtype)


def pretrained_encoder(base: dict[str, Any], cfg: Any, vision: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """The encoder parameters ``names`` (our names, whole, fp32) from the LLaVA directory a job started from
    (``base``: its ``source`` and ``sha256``, :func:`~kuangchao_core.models.lora.base_identity`); a directory
    that is gone or changed since raises CheckpointError."""
    from kuangchao_core.models.lora import base_identity

    source = str(base.get("source", ""))
    if not Path(source).is_dir():
        raise CheckpointError(
            f"the job started from the LLaVA directory {source}, which is not here; export where it is"
        )
    if base_identity(source, 0, cfg)["sha256"] != base.get("sha256"):
        raise CheckpointError(f"the LLaVA directory {source} the job started from has changed since")
    shapes = vlm_full_shapes(cfg, vision)
    return load_hf_llava_weights_for_layout(source, {n: Region.full(shapes[n]) for n in names}, cfg, vision)
