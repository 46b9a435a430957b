"""LoRA: low-rank adapters on the Llama projections, split like their base layers under tensor parallelism.

Every base parameter is frozen (no gradient, no optimizer state). Each targeted projection keeps its base weight
under its own name and gains two trainable sub-modules, ``lora_A`` (rank × in) and ``lora_B`` (out × rank), so the
names are PEFT's (``model.layers.0.self_attn.q_proj.lora_A.weight``). A forward hook adds
``scaling · B(A(dropout(x)))``, ``scaling = alpha / rank``, to the projection's output, as PEFT's ``Linear`` does.

Under TP an adapter follows its base layer:

- column-parallel base (q/k/v/gate/up, output rows split): ``B`` holds the same rows as the base weight, ``A`` is
  replicated. Each rank's ``A`` gradient covers only its own output rows, so it is summed over the TP group
  (:func:`sum_grad_over_tp`); replicated key/value heads sum ``B``'s gradient over the ranks sharing the head, as
  their base weight does.
- row-parallel base (o/down, input columns split): ``A`` holds the same columns as the base weight; ``A x`` is
  summed over the TP group (one all-reduce of rank-wide activations) and ``B`` is replicated — its input and output
  gradients are the same on every rank, so its gradient needs no reduction. Under sequence parallelism the sum is
  reduce-scattered along the sequence as the base's is, so ``B`` sees this rank's positions only and its gradient
  is summed over the TP group.

:func:`adapter_region` gives each adapter's slice of its full tensor from its base weight's slice, so checkpoints,
resharding and the gradient norm treat adapters like any other parameter.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kuangchao_core.models.layout import Region
from kuangchao_core.parallel.sequence import reduce_scatter_to_sequence, sum_weight_grad_over_tp
from kuangchao_core.parallel.tensor import (
    ReplicatedHeadsLinear,
    RowParallelLinear,
    _ReplicatedColumnLinear,
    reduce_from_tp_region,
)

#: the seed offset of the adapters' initialisation (its own stream: the base's draws are unchanged by LoRA)
_INIT_STREAM = 0x10A


@dataclass(frozen=True)
class LoraSettings:
    """``model.lora``: rank, alpha, dropout and the projection roles adapted."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        """The factor on ``B @ A`` (PEFT's ``lora_alpha / r``)."""
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, section: Any) -> LoraSettings | None:
        """From the job's ``model.lora`` (None when unset)."""
        if section is None:
            return None
        return cls(int(section.rank), float(section.alpha), float(section.dropout), tuple(section.targets))

    def to_dict(self) -> dict[str, Any]:
        """JSON form (checkpoint metadata)."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}


class LoraFactor(nn.Module):
    """One adapter matrix (``lora_A`` or ``lora_B``), a module with a ``weight`` so the names are PEFT's."""

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, cols))


def sum_grad_over_tp(weight: torch.Tensor, group) -> torch.Tensor:
    """``weight`` whose gradient is summed over ``group`` in backward (identity for one rank): a weight every TP rank
    holds whole but whose gradient each rank computes only in part
    (:func:`~kuangchao_core.parallel.sequence.sum_weight_grad_over_tp`)."""
    return sum_weight_grad_over_tp(weight, group)


def _kind(layer: nn.Module) -> str:
    if isinstance(layer, RowParallelLinear):
        return "row"
    if isinstance(layer, ReplicatedHeadsLinear):
        return "replicated"
    return "column"  # column-parallel or a plain nn.Linear (no TP)


def _lora_delta(settings: LoraSettings, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    group = getattr(layer, "group", None)
    a, b = layer.lora_A.weight, layer.lora_B.weight
    if settings.dropout > 0.0 and layer.training:
        x = F.dropout(x, settings.dropout, training=True)
    kind = _kind(layer)
    if kind == "row" and layer.sequence_parallel:  # the sum reduce-scattered along s: B sees a shard, like a norm
        return (
            F.linear(reduce_scatter_to_sequence(F.linear(x, a), group), sum_grad_over_tp(b, group)) * settings.scaling
        )
    if kind == "row":  # x: this rank's input columns
        return F.linear(reduce_from_tp_region(F.linear(x, a), group), b) * settings.scaling
    u = F.linear(x, sum_grad_over_tp(a, group))
    if kind == "replicated":
        out = _ReplicatedColumnLinear.apply(u, b, group, layer.slot, layer.num_slots)
    else:
        out = F.linear(u, b)
    return out * settings.scaling


def _add_lora(settings: LoraSettings, layer: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output + _lora_delta(settings, layer, args[0])


def adapter_region(name: str, base: Region, rank: int) -> Region:
    """The slice of adapter ``name`` (``….lora_A.weight`` or ``….lora_B.weight``) a rank holds, from the slice
    ``base`` of its projection's weight: ``A`` (rank × in) follows the base's input columns, ``B`` (out × rank) its
    output rows."""
    out_full, in_full = base.full_shape
    if name.endswith("lora_A.weight"):
        return Region((rank, in_full), (0, base.offsets[1]), (rank, base.shape[1]))
    return Region((out_full, rank), (base.offsets[0], 0), (base.shape[0], rank))


def adapter_names(base_name: str) -> tuple[str, str]:
    """``….q_proj.weight`` -> the names of its ``lora_A`` and ``lora_B`` weights."""
    prefix = base_name.removesuffix("weight")
    return f"{prefix}lora_A.weight", f"{prefix}lora_B.weight"


def is_target(name: str, settings: LoraSettings) -> bool:
    """Whether base parameter ``name`` is the weight of a projection ``settings`` adapts."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in settings.targets and name.startswith("model.")


def lora_regions(base_regions: dict[str, Region], settings: LoraSettings) -> dict[str, Region]:
    """Adapter name -> its Region, for every targeted base weight in ``base_regions`` (this rank's)."""
    out: dict[str, Region] = {}
    for name, region in base_regions.items():
        if is_target(name, settings):
            for adapter in adapter_names(name):
                out[adapter] = adapter_region(adapter, region, settings.rank)
    return out


@torch.no_grad()
def attach_lora(model: nn.Module, settings: LoraSettings, base_regions: dict[str, Region], seed: int) -> None:
    """Freeze every parameter of ``model`` and add adapters to the targeted projections ``base_regions`` names.

    ``A`` is drawn as PEFT draws it (uniform in ±1/sqrt(in): Kaiming-uniform with a = sqrt(5)) one full tensor at a
    time, in name order, from a CPU generator seeded from ``seed``, each rank keeping its slice, so every layout
    starts from the same adapters; ``B`` starts at zero (the adapted model equals the base at step 0)."""
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator(device="cpu").manual_seed(int(seed) + _INIT_STREAM)
    modules = dict(model.named_modules())
    hook = functools.partial(_add_lora, settings)
    for name in sorted(base_regions):
        if not is_target(name, settings):
            continue
        region = base_regions[name]
        layer = modules[name.removesuffix(".weight")]
        a_name, b_name = adapter_names(name)
        a_region = adapter_region(a_name, region, settings.rank)
        b_region = adapter_region(b_name, region, settings.rank)
        bound = 1.0 / math.sqrt(a_region.full_shape[1])
        full_a = torch.empty(a_region.full_shape).uniform_(-bound, bound, generator=gen)
        layer.lora_A = LoraFactor(*a_region.shape)
        layer.lora_A.weight.copy_(full_a[Region.full(a_region.full_shape).local(a_region)])
        layer.lora_B = LoraFactor(*b_region.shape)
        layer.register_forward_hook(hook)


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the parameters the optimizer updates (all of them without LoRA, the adapters with it)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


# ---------------------------------------------------------------------- the base's identity


@functools.lru_cache(maxsize=8)
def _files_digest(paths_and_stats: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for path, _, _ in paths_and_stats:
        h.update(Path(path).name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def base_identity(checkpoint: str | None, seed: int, model_config: Any) -> dict[str, Any]:
    """What the adapters were trained on: the sha256 of a Hugging Face base's ``config.json`` and weight files, or,
    for a base initialised from the seed, of the seed and the model's shape. Saved with every LoRA checkpoint and
    compared when one is resumed or merged. ``checkpoint``: the job's ``model.checkpoint`` (None: from the seed)."""
    if checkpoint:
        d = Path(checkpoint)
        files = [d / "config.json", *sorted(d.glob("*.safetensors"))]
        stats = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())
        return {"source": str(d), "sha256": _files_digest(stats)}
    from dataclasses import asdict

    shape = json.dumps(asdict(model_config), sort_keys=True)
    digest = hashlib.sha256(f"init-from-seed:{int(seed)}:{shape}".encode()).hexdigest()
    return {"source": f"seed:{int(seed)}", "sha256": digest}
