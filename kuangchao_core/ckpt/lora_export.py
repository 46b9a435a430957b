"""Export a LoRA checkpoint: PEFT's adapter format, or the base with the adapters merged in (Hugging Face Llama).

A LoRA checkpoint holds only the adapters (``param.….lora_A.weight``/``lora_B.weight``, any layout) and, in its
manifest, the adapters' settings and the identity of the frozen base (:func:`~kuangchao_core.models.lora.base_identity`).

- :func:`export_peft` writes ``adapter_model.safetensors`` (PEFT's names: ``base_model.model.<name>``) and
  ``adapter_config.json``, which ``peft.PeftModel.from_pretrained`` loads onto ``transformers.LlamaForCausalLM``.
- :func:`export_merged` rebuilds the base (its Hugging Face directory, checked against the recorded sha256, or the
  seed it was initialised from), adds ``alpha/rank · B @ A`` to every adapted weight and writes a plain Hugging
  Face directory.

Safetensors and JSON only; every file is written to a temporary name and renamed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kuangchao_core.ckpt.hf import write_hf_dir
from kuangchao_core.ckpt.index import PARAM, CheckpointIndex, model_config_of_checkpoint
from kuangchao_core.ckpt.integrity import read_manifest
from kuangchao_core.errors import CheckpointError

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def lora_meta(step_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest's ``lora`` entry (settings, base identity), or None for a fully trained checkpoint."""
    meta = read_manifest(Path(step_dir)).get("lora")
    return meta if isinstance(meta, dict) else None


def _adapters(step_dir: Path) -> dict[str, torch.Tensor]:
    index = CheckpointIndex.open(step_dir)
    try:
        out = {
            key[len(PARAM) :]: index.read(key).to(torch.float32).contiguous()
            for key in index.keys()
            if key.startswith(PARAM) and ".lora_" in key
        }
    finally:
        index.close()
    if not out:
        raise CheckpointError(f"{step_dir}: no LoRA adapters in the checkpoint")
    return out


def _write_atomic(out: Path, name: str, write) -> None:
    tmp = out / f".{name}.tmp"
    write(tmp)
    os.replace(tmp, out / name)


def adapter_config(meta: dict[str, Any], base_path: str | None) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for the adapters ``meta`` describes."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(meta["rank"]),
        "lora_alpha": float(meta["alpha"]),
        "lora_dropout": float(meta["dropout"]),
        "target_modules": sorted(meta["targets"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": base_path,
        "revision": None,
    }


def export_peft(step_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write the adapters of LoRA checkpoint ``step_dir`` (any layout) in PEFT's format into ``out_dir``."""
    step_dir = Path(step_dir)
    meta = lora_meta(step_dir)
    if meta is None:
        raise CheckpointError(f"{step_dir}: not a LoRA checkpoint (its manifest has no lora entry)")
    tensors = {PEFT_PREFIX + name: t for name, t in sorted(_adapters(step_dir).items())}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = meta.get("base", {}).get("source", "")
    base_path = None if str(source).startswith("seed:") else source
    _write_atomic(out, ADAPTER_FILE, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    text = json.dumps(adapter_config(meta, base_path), indent=2, sort_keys=True) + "\n"
    _write_atomic(out, ADAPTER_CONFIG, lambda p: p.write_text(text, encoding="utf-8"))
    return out


def base_weights(meta: dict[str, Any], cfg: Any) -> dict[str, torch.Tensor]:
    """The full fp32 base weights the adapters were trained on, checked against the recorded sha256."""
    from kuangchao_core.models.lora import base_identity

    base = meta.get("base") or {}
    source = str(base.get("source", ""))
    if source.startswith("seed:"):
        from kuangchao_core.models.llama import LlamaForCausalLM

        model = LlamaForCausalLM(cfg)
        model.init_weights(int(source.removeprefix("seed:")))
        found = base_identity(None, int(source.removeprefix("seed:")), cfg)
        weights = {n: p.detach() for n, p in model.named_parameters()}
    else:
        from kuangchao_core.ckpt.hf import load_hf_weights_for_layout

        if not Path(source).is_dir():
            raise CheckpointError(f"the adapters' base {source} is not a directory here; merge where it is")
        found = base_identity(source, 0, cfg)
        weights = load_hf_weights_for_layout(source, cfg)
    if found["sha256"] != base.get("sha256"):
        raise CheckpointError(
            f"the base at {source} has sha256 {found['sha256'][:12]}, the adapters were trained on "
            f"{str(base.get('sha256'))[:12]}: it changed since"
        )
    return weights


def export_merged(step_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str = "fp32") -> Path:
    """Write the base with the adapters of ``step_dir`` merged in (``W + alpha/rank · B @ A``, computed in fp64)
    as a Hugging Face Llama directory (``model.safetensors`` + ``config.json``)."""
    step_dir = Path(step_dir)
    meta = lora_meta(step_dir)
    if meta is None:
        raise CheckpointError(f"{step_dir}: not a LoRA checkpoint (its manifest has no lora entry)")
    cfg = model_config_of_checkpoint(read_manifest(step_dir))
    weights = {n: t.to(torch.float32).clone() for n, t in base_weights(meta, cfg).items()}
    adapters = _adapters(step_dir)
    scaling = float(meta["alpha"]) / int(meta["rank"])
    for name in list(weights):
        a = adapters.get(name.removesuffix("weight") + "lora_A.weight")
        b = adapters.get(name.removesuffix("weight") + "lora_B.weight")
        if a is not None and b is not None:
            delta = (b.double() @ a.double()) * scaling
            weights[name] = (weights[name].double() + delta).to(torch.float32)
    return write_hf_dir(weights, cfg, out_dir, dtype)
