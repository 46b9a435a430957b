"""The Hugging Face LLaVA format (``LlavaForConditionalGeneration`` with a CLIP vision tower), both ways (issue 31).

- :func:`load_hf_llava_config` reads a local LLaVA ``config.json`` into the decoder's ``LlamaConfig`` and the
  tower's ``VisionConfig``; :func:`load_hf_llava_weights` reads its safetensors into the names of
  :class:`~kuangchao_core.models.vlm.VisionLanguageModel`, accepting the three spellings transformers uses (the
  hub's ``vision_tower.vision_model.*``, what transformers 5 saves, ``vision_tower.*``, and its in-memory
  ``model.language_model.*`` / ``model.vision_tower.*`` / ``lm_head.*``).
- :func:`write_hf_llava_dir` writes full tensors and the ``config.json`` that transformers loads, in the hub's
  spelling (read by transformers 4 and 5 alike). Safetensors and JSON only, never pickle.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kuangchao_core.ckpt.hf import EXPORT_DTYPES, SINGLE_FILE, hf_config_dict, hf_weight_files
from kuangchao_core.config.bounded_json import read_json_file
from kuangchao_core.errors import CheckpointError, ConfigError
from kuangchao_core.models.layout import Region
from kuangchao_core.models.llama import LlamaConfig, llama_config_from_hf
from kuangchao_core.models.vision import VisionConfig, vision_config
from kuangchao_core.models.vlm import VisionLanguageModel

#: transformers' ``CLIPVisionConfig`` defaults, for the keys a ``vision_config`` leaves out
CLIP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
#: the tower LLaVA builds when ``vision_config`` is absent altogether (LLaVA-1.5's CLIP ViT-L/14 at 336 px)
LLAVA_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 336,
    "patch_size": 14,
}
#: ``model.vision`` field -> the CLIP vision ``config.json`` key
VISION_KEYS = {
    "image_size": "image_size",
    "patch_size": "patch_size",
    "num_channels": "num_channels",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "layer_norm_eps": "layer_norm_eps",
    "hidden_act": "hidden_act",
}
#: how a stored name becomes ours, applied in order
_RENAMES = [
    (re.compile(r"^model\.language_model\."), "language_model.model."),
    (re.compile(r"^lm_head\."), "language_model.lm_head."),
    (re.compile(r"^model\.(vision_tower|multi_modal_projector)\."), r"\1."),
    (re.compile(r"^vision_tower\.vision_model\."), "vision_tower."),
]
#: buffers some checkpoints carry that are not parameters (recomputed, never read)
_BUFFERS = ("position_ids", "rotary_emb.inv_freq")
_TIED, _EMBED = "language_model.lm_head.weight", "language_model.model.embed_tokens.weight"


def _err(path: Path, msg: str) -> ConfigError:
    return ConfigError([("model.checkpoint", f"{path}: {msg}")])


def load_hf_llava_config(directory: str | os.PathLike[str]) -> tuple[LlamaConfig, VisionConfig]:
    """The decoder's and the tower's configs of a local LLaVA directory (``config.json``, never the hub)."""
    path = Path(directory)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise _err(path, "no config.json; give a local Hugging Face LLaVA model directory")
    try:
        raw = read_json_file(path)
    except (OSError, ValueError) as exc:
        raise _err(path, f"cannot read it ({exc})") from None
    if not isinstance(raw, dict) or raw.get("model_type") != "llava":
        kind = raw.get("model_type") if isinstance(raw, dict) else type(raw).__name__
        raise _err(path, f"model_type {kind!r}; a LLaVA model ('llava') is needed")
    vis_raw = raw.get("vision_config")
    if not isinstance(vis_raw, (dict, type(None))):
        raise _err(path, "vision_config must be an object")
    text = llama_config_from_hf(raw, path)  # its text_config (models.llava_config.decoder_config)
    vis_raw = {**CLIP_DEFAULTS, **(LLAVA_VISION_DEFAULTS if vis_raw is None else vis_raw)}
    if vis_raw.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise _err(path, f"vision tower {vis_raw.get('model_type')!r}; only CLIP's ('clip_vision_model') loads")
    layer = raw.get("vision_feature_layer", -2)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise _err(path, f"vision_feature_layer {layer!r}: only one layer (an integer) is supported")
    fields = {name: vis_raw[key] for name, key in VISION_KEYS.items()}
    fields.update(
        feature_layer=layer,
        feature_select=raw.get("vision_feature_select_strategy", "default"),
        projector_hidden_act=raw.get("projector_hidden_act", "gelu"),
        projector_bias=raw.get("multimodal_projector_bias", True),
        image_token_id=raw.get("image_token_index", raw.get("image_token_id", 32000)),
    )
    try:
        vision = vision_config(fields, text.vocab_size)
    except ConfigError as exc:
        raise _err(path, f"its vision settings do not load ({exc})") from None
    return text, vision


def _our_name(name: str) -> str:
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


def vlm_full_shapes(cfg: LlamaConfig, vision: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> full shape of the VLM these configs build (on the meta device, no memory)."""
    with torch.device("meta"):
        model = VisionLanguageModel(cfg, vision)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def load_hf_llava_weights_for_layout(
    hf_dir: str | os.PathLike[str],
    regions: dict[str, Region],
    cfg: LlamaConfig,
    vision: VisionConfig,
    dtype: torch.dtype | None = torch.float32,
) -> dict[str, torch.Tensor]:
    """Our name -> the slice ``regions[name]`` of that parameter (the part of the full tensor a rank holds, as the
    trainer records it), read from the LLaVA directory with ``safe_open(...).get_slice``: a rank reads only what it
    holds. ``dtype`` None keeps the stored dtype. A tensor no parameter takes (another architecture's), a shape that
    is not the configs' or a wanted parameter missing from the files raises CheckpointError naming it; a tied
    decoder's absent ``lm_head`` is read from the embedding."""
    shapes = vlm_full_shapes(cfg, vision)
    stored: dict[str, tuple[str, Path]] = {}
    for name, file in hf_weight_files(hf_dir).items():
        ours = _our_name(name)
        if ours in shapes:
            stored[ours] = (name, file)
        elif not name.endswith(_BUFFERS):
            raise CheckpointError(f"{file}: tensor {name} is not a parameter of a CLIP LLaVA model")
    if cfg.tie_embeddings and _TIED not in stored and _EMBED in stored:
        stored[_TIED] = stored[_EMBED]
    missing = [n for n in regions if n not in stored]
    if missing:
        raise CheckpointError(f"{hf_dir}: {len(missing)} parameters are not in the weights, e.g. {missing[:3]}")
    out: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for ours, region in regions.items():
            name, file = stored[ours]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            piece = handles[file].get_slice(name)
            shape = tuple(piece.get_shape())
            if shape != shapes[ours] or shape != tuple(region.full_shape):
                raise CheckpointError(
                    f"{file}: {name} has shape {list(shape)}, the config expects {list(shapes[ours])}"
                )
            tensor = piece[Region.full(shape).local(region)]
            out[ours] = (tensor if dtype is None else tensor.to(dtype)).contiguous()
    return out


def load_hf_llava_weights(
    hf_dir: str | os.PathLike[str], cfg: LlamaConfig, vision: VisionConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Every parameter of the LLaVA directory, whole, by our name, as ``dtype`` (errors as
    :func:`load_hf_llava_weights_for_layout`); a tied decoder's ``lm_head`` is the embedding."""
    regions = {n: Region.full(s) for n, s in vlm_full_shapes(cfg, vision).items()}
    out = load_hf_llava_weights_for_layout(hf_dir, regions, cfg, vision, dtype)
    if cfg.tie_embeddings and _TIED not in out:
        out[_TIED] = out[_EMBED]
    return out


def load_hf_llava(hf_dir: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> VisionLanguageModel:
    """A :class:`VisionLanguageModel` holding the LLaVA directory's weights (one process, every tensor whole)."""
    cfg, vision = load_hf_llava_config(hf_dir)
    model = VisionLanguageModel(cfg, vision).to(dtype)
    model.load_state_dict(load_hf_llava_weights(hf_dir, cfg, vision, dtype), strict=True)
    return model


def hf_llava_config_dict(cfg: LlamaConfig, vision: VisionConfig, dtype: str = "fp32") -> dict[str, Any]:
    """The ``config.json`` of a transformers ``LlavaForConditionalGeneration`` with these sizes."""
    text = hf_config_dict(cfg, dtype)
    text.pop("architectures")
    vis = {key: getattr(vision, name) for name, key in VISION_KEYS.items()}
    vis.update(model_type="clip_vision_model", attention_dropout=0.0, projection_dim=vision.hidden_size)
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": text,
        "vision_config": vis,
        "image_token_index": vision.image_token_id,
        "image_seq_length": vision.tokens_per_image,
        "vision_feature_layer": vision.feature_layer,
        "vision_feature_select_strategy": vision.feature_select,
        "projector_hidden_act": vision.projector_hidden_act,
        "multimodal_projector_bias": vision.projector_bias,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": EXPORT_DTYPES[dtype][1],
    }


def _stored_name(ours: str) -> str:
    """Our name in the hub's spelling (``vision_tower.vision_model.*``; the rest is spelt alike)."""
    return "vision_tower.vision_model." + ours[len("vision_tower.") :] if ours.startswith("vision_tower.") else ours


def write_hf_llava_dir(
    tensors: dict[str, torch.Tensor],
    cfg: LlamaConfig,
    vision: VisionConfig,
    out_dir: str | os.PathLike[str],
    dtype: str = "fp32",
) -> Path:
    """Write full parameters ``tensors`` (our names, e.g. a VisionLanguageModel's ``state_dict()``; each rounded once
    to ``dtype``, ``EXPORT_DTYPES``) and the ``config.json`` into ``out_dir``, each file atomically; a tied
    decoder's ``lm_head`` is left to the embedding. Returns ``out_dir``."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {dtype!r}: use one of {', '.join(EXPORT_DTYPES)}")
    shapes = vlm_full_shapes(cfg, vision)
    if cfg.tie_embeddings:
        shapes.pop("language_model.lm_head.weight", None)  # named_parameters lists a tied weight once anyway
    missing = [n for n in shapes if n not in tensors]
    if missing:
        raise CheckpointError(f"export: {len(missing)} parameters missing, e.g. {missing[:3]}")
    ordered = {_stored_name(n): tensors[n].detach().to(EXPORT_DTYPES[dtype][0]).contiguous() for n in shapes}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{SINGLE_FILE}.tmp"
    save_file(ordered, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / SINGLE_FILE)
    cfg_tmp = out / ".config.json.tmp"
    body = json.dumps(hf_llava_config_dict(cfg, vision, dtype), indent=2, sort_keys=True) + "\n"
    cfg_tmp.write_text(body, encoding="utf-8")
    os.replace(cfg_tmp, out / "config.json")
    return out
