"""The Hugging Face Llama format: read the slices one rank needs from an HF directory (fine-tuning start).

- :func:`load_hf_weights_for_layout` reads a local directory holding ``config.json`` and ``model.safetensors``
  (or shards listed in ``model.safetensors.index.json``, each entry a regular file inside the directory:
  :func:`weight_file`) and returns, by HF parameter name, only the slices a
  :class:`~kuangchao_core.models.layout.TargetLayout` rank holds, read with ``safe_open(...).get_slice``.
- :func:`hf_config_dict` is the ``config.json`` that ``transformers.LlamaForCausalLM`` reads for a model config
  (the export in :mod:`kuangchao_core.ckpt.convert` writes it). Safetensors and JSON only, never pickle.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kuangchao_core.ckpt.hf_moe import load_mixtral_for_regions, mixtral_config_dict, mixtral_tensors
from kuangchao_core.config.bounded_json import read_json_file
from kuangchao_core.errors import CheckpointError, ConfigError
from kuangchao_core.models.layout import Region, TargetLayout

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _as_llama_config(model_cfg: Any):
    from kuangchao_core.models.llama import LlamaConfig, config_from_model_section

    return model_cfg if isinstance(model_cfg, LlamaConfig) else config_from_model_section(model_cfg)


def hf_weight_files(hf_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it, from the index file or the single/only files present.

    Every file is checked by :func:`weight_file` before anything opens it: inside the model directory, regular."""
    d = Path(hf_dir)
    if not d.is_dir():
        raise ConfigError([("model.checkpoint", f"{d} is not a directory; give a local Hugging Face model directory")])
    index = d / INDEX_FILE
    if os.path.lexists(index):  # a FIFO or a link too: weight_file refuses them
        index = weight_file(d, INDEX_FILE, str(index))
        try:
            weight_map = read_json_file(index)["weight_map"]
            items = list(weight_map.items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: cannot read its weight_map ({exc})") from None
        files: dict[str, Path] = {}
        for name, fname in items:
            if fname not in files:
                files[fname] = weight_file(d, fname, f"{index}: weight_map[{name!r}]")
        return {name: files[fname] for name, fname in items}
    listed = [d / SINGLE_FILE] if os.path.lexists(d / SINGLE_FILE) else sorted(d.glob("*.safetensors"))
    if not listed:
        raise ConfigError(
            [("model.checkpoint", f"{d} holds no *.safetensors weights (pickle .bin files are not read); convert them")]
        )
    out: dict[str, Path] = {}
    for f in listed:
        f = weight_file(d, f.name, str(f))
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for name in h.keys():
                out[name] = f
    return out


def model_root(hf_dir: Path) -> Path:
    """Where a model directory's files may lead: the directory itself, or for a Hugging Face Hub cache snapshot
    (``…/models--org--name/snapshots/<revision>``, whose files link to ``../../blobs/``) that repository's folder."""
    real = hf_dir.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def weight_file(hf_dir: Path, name: Any, where: str) -> Path:
    """The real path of file ``name`` of model directory ``hf_dir``, checked without opening it: a relative name
    with no ``..``, whose symbolic links (if any) stay inside :func:`model_root`, naming a regular file (a FIFO
    would block the reader, a device never end). Raises CheckpointError naming ``where`` (the entry) otherwise."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{where}: {name!r} is not a file name")
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts or os.path.isabs(name):
        raise CheckpointError(f"{where}: {name!r} is not a file inside the model directory {hf_dir} (no '..', no /)")
    path = hf_dir / rel
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # missing, or a loop of links
        raise CheckpointError(f"{where}: {path} cannot be read ({exc.__class__.__name__}: {exc})") from None
    root = model_root(hf_dir)
    if not real.is_relative_to(root):
        raise CheckpointError(f"{where}: {path} leads outside the model directory {root} (to {real})")
    mode = os.lstat(real).st_mode  # resolved: no link left; a stat never opens, so a FIFO cannot block here
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{where}: {path} is not a regular file (a pipe, device, socket or directory)")
    return real


def load_hf_weights_for_layout(
    hf_dir: str | os.PathLike[str],
    model_cfg: Any,
    target_layout: TargetLayout | None = None,
    dtype: torch.dtype = torch.float32,
    regions: dict[str, Region] | None = None,
) -> dict[str, torch.Tensor]:
    """HF name -> this rank's slice of each parameter it owns under ``target_layout`` (tp1/pp1 when None).

    ``model_cfg``: a LlamaConfig or the job's ``model`` section. Shapes in the files must match it; extra tensors
    (``lm_head.weight`` of a tied model, rotary buffers) are ignored; a parameter missing from the files raises
    CheckpointError naming it. A MoE model reads a Mixtral directory (:mod:`kuangchao_core.ckpt.hf_moe`), the
    slices ``regions`` names when given (the experts of this rank under expert parallelism), by Kuangchao name.
    """
    cfg = _as_llama_config(model_cfg)
    layout = target_layout or TargetLayout()
    if cfg.moe is not None:
        return load_mixtral_for_regions(hf_dir, hf_weight_files(hf_dir), regions or layout.param_slices(cfg), dtype)
    wanted = layout.param_slices(cfg)
    where = hf_weight_files(hf_dir)
    handles: dict[Path, Any] = {}
    out: dict[str, torch.Tensor] = {}
    for name, region in wanted.items():
        path = where.get(name)
        if path is None:
            raise CheckpointError(
                f"{hf_dir}: parameter {name} is not in the Hugging Face weights; is it a Llama model?"
            )
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt", device="cpu")
        sl = handles[path].get_slice(name)
        shape = tuple(sl.get_shape())
        if shape != tuple(region.full_shape):
            raise CheckpointError(
                f"{path}: {name} has shape {list(shape)}, the model config expects {list(region.full_shape)}"
            )
        local = Region.full(shape).local(region)
        out[name] = sl[local].to(dtype).contiguous()
    return out


#: the weights' dtype an export may ask for (``kc checkpoint convert --dtype``) -> (torch dtype, HF's name)
EXPORT_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "fp32": (torch.float32, "float32"),
    "bf16": (torch.bfloat16, "bfloat16"),
    "fp16": (torch.float16, "float16"),
}


def hf_config_dict(cfg: Any, dtype: str = "fp32") -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``LlamaForCausalLM`` with the sizes of ``cfg`` and weights in
    ``dtype`` (:data:`EXPORT_DTYPES`)."""
    cfg = _as_llama_config(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": EXPORT_DTYPES[dtype][1],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
    }


def write_hf_dir(tensors: dict[str, torch.Tensor], cfg, out_dir: str | os.PathLike[str], dtype: str = "fp32") -> Path:
    """Write full parameters ``tensors`` (HF names, in :func:`full_shapes` order; each rounded once to ``dtype``,
    :data:`EXPORT_DTYPES`) and the ``config.json`` of ``cfg`` into ``out_dir``, each file atomically (a MoE model
    as a Mixtral: :mod:`kuangchao_core.ckpt.hf_moe`). Returns ``out_dir``."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {dtype!r}: use one of {', '.join(EXPORT_DTYPES)}")
    from kuangchao_core.models.tp_llama import full_shapes

    out = Path(out_dir)
    ordered = {n: tensors[n].to(EXPORT_DTYPES[dtype][0]).contiguous() for n in full_shapes(cfg)}
    config = hf_config_dict(cfg, dtype)
    if cfg.moe is not None:  # a Mixtral (refused before anything is written when its block is not Mixtral's)
        config, ordered = mixtral_config_dict(cfg, config, str(out)), mixtral_tensors(ordered)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{SINGLE_FILE}.tmp"
    save_file(ordered, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / SINGLE_FILE)
    cfg_tmp = out / ".config.json.tmp"
    cfg_tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(cfg_tmp, out / "config.json")
    return out
