"""The Mixtral format of a MoE Llama (issue 40 item 4): read the slices one rank holds from a Hugging Face Mixtral
directory, and write a MoE checkpoint's full parameters as one.

Attention, norms, embedding and head keep their names. Each MoE layer's router and experts are, in Mixtral's files
(what ``save_pretrained`` writes and the published checkpoints hold), ``block_sparse_moe.gate.weight`` (experts ×
hidden, Kuangchao's ``mlp.router.weight``) and, per expert ``e``, ``block_sparse_moe.experts.e.w1`` / ``w3`` /
``w2`` (``.weight``: width × hidden, width × hidden, hidden × width): expert ``e`` of Kuangchao's batched
``mlp.experts.w_gate`` / ``w_up`` (experts × hidden × width) and ``w_down`` (experts × width × hidden), transposed.
A rank reads only its experts (``Region`` along dimension 0: expert parallelism) and their rows and columns.
Safetensors and JSON only, never pickle.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kuangchao_core.errors import CheckpointError
from kuangchao_core.models.hf_moe_config import mixtral_config
from kuangchao_core.models.layout import Region

#: Kuangchao's expert weight -> Mixtral's per-expert matrix (stored transposed)
EXPERT_FILES = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
_MOE = re.compile(r"^model\.layers\.(\d+)\.mlp\.(router\.weight|experts\.(w_gate|w_up|w_down))$")


def _block(layer: str) -> str:
    return f"model.layers.{layer}.block_sparse_moe"


def mixtral_sources(name: str, experts: range) -> dict[int | None, str]:
    """The Mixtral tensor(s) holding Kuangchao parameter ``name``: ``{None: name}`` for one stored as it is,
    ``{e: per-expert name}`` for expert weights (``experts``: which to read)."""
    m = _MOE.match(name)
    if m is None:
        return {None: name}
    layer, what, weight = m.groups()
    if what == "router.weight":
        return {None: f"{_block(layer)}.gate.weight"}
    return {e: f"{_block(layer)}.experts.{e}.{EXPERT_FILES[weight]}.weight" for e in experts}


def load_mixtral_for_regions(
    hf_dir: str | os.PathLike[str],
    where: dict[str, Path],
    regions: dict[str, Region],
    dtype: torch.dtype | None = torch.float32,
) -> dict[str, torch.Tensor]:
    """Kuangchao name -> the ``regions`` slice of each parameter, read from the Mixtral directory ``hf_dir`` whose
    tensors ``where`` locates (``ckpt.hf.hf_weight_files``; only that slice of each file's tensor is read:
    ``safe_open(...).get_slice``). A tensor missing from the files or of another shape than the region's full
    tensor raises CheckpointError naming it. ``dtype`` None keeps the files'."""
    handles: dict[Path, Any] = {}

    def tensor(hf_name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        path = where.get(hf_name)
        if path is None:
            raise CheckpointError(f"{hf_dir}: tensor {hf_name} is not in the Hugging Face weights; is it a Mixtral?")
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt", device="cpu")
        sl = handles[path].get_slice(hf_name)
        got = tuple(sl.get_shape())
        if got != shape:
            raise CheckpointError(f"{path}: {hf_name} has shape {list(got)}, the model config expects {list(shape)}")
        return sl[index]

    out: dict[str, torch.Tensor] = {}
    for name, region in regions.items():
        full = Region.full(region.full_shape).local(region)
        first, count = region.offsets[0], region.shape[0]
        sources = mixtral_sources(name, range(first, first + count))
        if None in sources:
            value = tensor(sources[None], tuple(region.full_shape), full)
        else:  # one expert's matrix, transposed: its (rows, columns) are the region's (dim 2, dim 1)
            shape = (region.full_shape[2], region.full_shape[1])
            value = torch.stack([tensor(n, shape, (full[2], full[1])).T for n in sources.values()])
        out[name] = (value if dtype is None else value.to(dtype)).contiguous()
    return out


def mixtral_tensors(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full Kuangchao parameters (``params``, by name) as Mixtral's tensors, by Mixtral name."""
    out: dict[str, torch.Tensor] = {}
    for name, value in params.items():
        sources = mixtral_sources(name, range(value.shape[0]))
        if None in sources:
            out[sources[None]] = value
        else:
            out.update({n: value[e].T.contiguous() for e, n in sources.items()})
    return out


def mixtral_config_dict(cfg: Any, llama: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``config.json`` of a ``MixtralForCausalLM`` with the sizes of ``cfg`` (a LlamaConfig with ``moe``), over
    ``llama`` (its Llama ``config.json``, ``ckpt.hf.hf_config_dict``); CheckpointError naming the ``model.moe``
    field whose block Mixtral does not compute (``where``: the output, for the message)."""
    keys = mixtral_config(cfg, where)
    return {**{k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias")}, **keys}
