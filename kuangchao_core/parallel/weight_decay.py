"""Which parameters AdamW's decoupled weight decay applies to (``optimizer.weight_decay_exclude``).

Decay pulls a weight towards zero; on a norm's scale (initialised to one) or a token embedding (whose rows for
rare tokens get few gradients) it fights the model rather than regularising it, so both are excluded by default,
as most recipes do. ``norm`` names every 1-D parameter (the RMSNorm scales; the models here have no biases),
``embedding`` the token embedding (and a head tied to it).

Sharded optimizers keep one AdamW param group over flat buffers, so they run it with ``weight_decay = 0`` and apply
the decay themselves to the decayed ranges first: ``p *= 1 - lr * wd`` is what AdamW does before its update, so
the result equals a plain AdamW with two param groups.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

KINDS = ("norm", "embedding")


def decays(name: str, shape: Sequence[int], exclude: Iterable[str]) -> bool:
    """Whether parameter ``name`` of ``shape`` gets weight decay when the kinds ``exclude`` are excluded."""
    skip = set(exclude)
    if "norm" in skip and len(shape) == 1:
        return False
    if "embedding" in skip and "embed_tokens" in name:
        return False
    return True


def param_groups(
    named: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float, exclude: Iterable[str]
) -> list[dict]:
    """AdamW param groups: the decayed parameters with ``weight_decay``, the others with 0 (empty groups left out)."""
    skip = list(exclude)
    decayed, plain = [], []
    for name, p in named:
        (decayed if decays(name, p.shape, skip) else plain).append(p)
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


@torch.no_grad()
def apply_decay(ranges: Iterable[torch.Tensor], lr: float, weight_decay: float) -> None:
    """Decoupled decay of flat parameter ranges, as AdamW applies it before its update: ``p *= 1 - lr * wd``."""
    if weight_decay == 0:
        return
    factor = 1 - lr * weight_decay
    for r in ranges:
        r.mul_(factor)
