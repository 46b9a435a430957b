"""The one gate in front of everything that publishes a model: nothing diverged leaves the job.

A model is publishable only when every floating-point tensor of its weights is finite and its final training loss
(when known) is finite. :func:`check_publishable` applies both checks and raises :class:`NotPublishable` naming the
first offending tensors or the loss; :func:`publish_refusal` returns the same reason as a string (None when the model
may be published). Export (``engine.release.export_model``) and registration (``obs.model_registry.register_model``)
call it before anything is written or any alias moves; any later code that moves a registry alias calls it too.

:func:`nonfinite_names` is the tensor-level check the trainer also runs on every checkpoint it is about to write.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kuangchao_core.errors import KuangchaoError

#: weight files a published model directory may hold (HF model, PEFT adapters, sharded HF)
WEIGHT_SUFFIXES = (".safetensors",)
_SHOWN = 3  # offending tensors named in a message


class NotPublishable(KuangchaoError):
    """A model that must not be exported, registered or given an alias (non-finite weights or final loss)."""


def nonfinite_names(tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[str]:
    """The names of the floating-point tensors holding a NaN or an infinity (``name (N non-finite of M)``), in
    order; integer and boolean tensors are skipped."""
    import torch

    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    bad = []
    for name, t in items:
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            continue
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            bad.append(f"{name} ({int((~finite).sum())} non-finite of {t.numel()})")
    return bad


def _shown(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def weight_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The weight files of an exported model directory (``*.safetensors``), sorted."""
    root = Path(model_dir)
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def nonfinite_weights(model_dir: str | os.PathLike[str]) -> list[str]:
    """``file:tensor (…)`` for every weight tensor of ``model_dir`` that is not finite; read one tensor at a time."""
    from safetensors import safe_open

    bad: list[str] = []
    root = Path(model_dir)
    for path in weight_files(root):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                bad += [f"{path.relative_to(root)}:{n}" for n in nonfinite_names([(key, f.get_tensor(key))])]
    return bad


def publish_refusal(model_dir: str | os.PathLike[str] | None, final_loss: float | None) -> str | None:
    """Why the model in ``model_dir`` with final training loss ``final_loss`` must not be published, or None.

    ``model_dir`` None checks the loss only; ``final_loss`` None means unknown (not checked). A directory without
    any weight file is refused too: there is nothing to vouch for."""
    reasons = []
    if final_loss is not None:
        try:
            value = float(final_loss)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            reasons.append(f"the final training loss is {final_loss} (not finite)")
    if model_dir is not None:
        if not weight_files(model_dir):
            reasons.append(f"{model_dir} holds no weight file (*.safetensors)")
        else:
            bad = nonfinite_weights(model_dir)
            if bad:
                reasons.append(f"{len(bad)} weight tensor(s) are not finite: {_shown(bad)}")
    if not reasons:
        return None
    return "; ".join(reasons) + ": the run diverged, so its model is not published (nothing exported or registered)"


def check_publishable(model_dir: str | os.PathLike[str] | None, final_loss: float | None, what: str = "model") -> None:
    """Raise :class:`NotPublishable` (``"<what> refused: <reason>"``) when :func:`publish_refusal` gives a reason."""
    why = publish_refusal(model_dir, final_loss)
    if why is not None:
        raise NotPublishable(f"{what} refused: {why}")
