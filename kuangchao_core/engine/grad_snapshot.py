"""Gradient snapshots for ``kc debug gradient`` (OPS.4): do the data-parallel replicas agree?

With ``KC_GRAD_SNAPSHOT_STEP=N`` in its environment a rank writes, right after optimizer step ``N`` has reduced and
clipped its gradients, ``<run_dir>/debug/grad/rank_<r>.safetensors``: every parameter (``param.<name>``) and its
gradient (``grad.<name>``), with the rank's (dp, tp, pp) coordinates in the header. Replicas — ranks with the same
tp and pp coordinates — must hold identical parameters and (after the DP reduction) identical gradients;
:func:`replica_differences` compares them and names the tensors that differ most. ZeRO shards its gradients, so
there the gradients are not compared (the parameters are).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kuangchao_core import axes

ENV_STEP = "KC_GRAD_SNAPSHOT_STEP"


def snapshot_path(run_dir: str | os.PathLike, rank: int) -> Path:
    """``<run_dir>/debug/grad/rank_<r>.safetensors``."""
    return Path(run_dir) / "debug" / "grad" / f"rank_{rank:05d}.safetensors"


def write_snapshot(run_dir: str | os.PathLike, rank: int, model, coords: dict[str, int], step: int) -> Path:
    """Write this rank's parameters and gradients (see the module docstring)."""
    from safetensors.torch import save_file

    tensors = {}
    for name, p in model.named_parameters():
        tensors[f"param.{name}"] = p.detach().cpu().contiguous().clone()
        if p.grad is not None:
            tensors[f"grad.{name}"] = p.grad.detach().cpu().contiguous().clone()
    path = snapshot_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"rank": str(rank), "coords": json.dumps(dict(coords)), "step": str(step)}
    save_file(tensors, str(path), metadata=meta)
    return path


class SnapshotStep:
    """The step whose gradients ``kc debug gradient`` asked for (``$KC_GRAD_SNAPSHOT_STEP`` in a run directory's
    worker, ``$KC_RUN_DIR``; 0: none), read from ``env`` (default ``os.environ``) when a run starts."""

    def __init__(self, env: Any = None):
        env = os.environ if env is None else env
        self.run_dir = env.get("KC_RUN_DIR")
        self.step = int(env.get(ENV_STEP, "0") or 0) if self.run_dir else 0

    def after_step(self, step: int, rank: int, sync: Any, model: Any, coords: dict[str, int]) -> None:
        """At the asked step only: write this rank's reduced gradients, before the next step changes them
        (collective under ZeRO-3, which gathers the full parameters)."""
        if self.step != step:
            return
        with sync.full_parameters():
            write_snapshot(self.run_dir, rank, model, coords, step)


def load_snapshots(folder: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """``{rank: {"coords", "step", "tensors"}}`` from a folder of snapshots."""
    from safetensors import safe_open

    out = {}
    for path in sorted(Path(folder).glob("rank_*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            out[int(meta["rank"])] = {
                "coords": json.loads(meta["coords"]),
                "step": int(meta["step"]),
                "tensors": {k: f.get_tensor(k) for k in f.keys()},
            }
    return out


def replica_differences(snapshots: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every tensor that differs between replicas, largest first: ``{"tensor", "ranks", "max_abs", "rel"}`` (the
    max absolute difference, and it relative to the tensor's largest magnitude)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, snap in snapshots.items():  # replicas: the same coordinates on every axis but the data axes
        at = snap["coords"]
        groups.setdefault(tuple(at[a.name] for a in axes.TABLE if not a.data and a.name in at), []).append(rank)
    found = []
    for ranks in groups.values():
        ranks = sorted(ranks)
        first = snapshots[ranks[0]]["tensors"]
        for other in ranks[1:]:
            theirs = snapshots[other]["tensors"]
            for name, value in first.items():
                if name not in theirs:
                    continue
                diff = (value.double() - theirs[name].double()).abs().max().item()
                if diff > 0:
                    scale = max(value.double().abs().max().item(), 1e-30)
                    found.append({"tensor": name, "ranks": [ranks[0], other], "max_abs": diff, "rel": diff / scale})
    return sorted(found, key=lambda d: -d["rel"])
