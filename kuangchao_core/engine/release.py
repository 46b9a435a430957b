"""The usable result of a job: its final checkpoint exported as a Hugging Face model (or, for LoRA, PEFT adapters)
with the tokenizer files beside it, and an ``export.json`` naming the checkpoint it came from.

``export.json``: ``format`` (``hf`` or ``peft``), ``step``, ``checkpoint`` (the step directory), ``manifest_sha256``
(of its ``manifest.json``, which lists every shard's sha256 — the checkpoint's identity), ``tokenizer`` (the
``data.tokenizer`` it was trained with) and ``files``. The directory is built under a temporary name and renamed
into place, so it is either whole or absent.

Nothing diverged is exported: the built directory passes :func:`~kuangchao_core.obs.publish_gate.check_publishable`
(every weight finite, the final training loss finite — the one given, and the last loss the checkpoint recorded)
before it is renamed into place; a refused export leaves no directory and raises
:class:`~kuangchao_core.obs.publish_gate.NotPublishable` naming the offending tensors or the loss.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from kuangchao_core.ckpt.layout import MANIFEST
from kuangchao_core.errors import CheckpointError
from kuangchao_core.obs.publish_gate import check_publishable

EXPORT_RECORD = "export.json"


def checkpoint_final_loss(step_dir: str | os.PathLike[str]) -> float | None:
    """The last training loss checkpoint ``step_dir`` recorded (its ``state.json`` ``losses``), None when it has
    none or it cannot be read."""
    from kuangchao_core.ckpt.reader import read_state

    try:
        losses = read_state(step_dir).get("losses")
    except Exception:  # noqa: BLE001 - an unreadable state is "unknown", the weights are still checked
        return None
    if not isinstance(losses, list) or not losses:
        return None
    try:
        return float(losses[-1])
    except (TypeError, ValueError):
        return float("nan")


def export_model(
    step_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tokenizer: str,
    max_length: int,
    final_loss: float | None = None,
) -> dict[str, Any]:
    """Export checkpoint ``step_dir`` (any layout) into ``out_dir`` (replaced when it exists) with the tokenizer
    ``tokenizer`` (``data.tokenizer``); returns the ``export.json`` record. ``final_loss``: the run's final training
    loss, when known. Raises :class:`~kuangchao_core.obs.publish_gate.NotPublishable` (``out_dir`` untouched) when
    a weight, ``final_loss`` or the checkpoint's last recorded loss is not finite."""
    from kuangchao_core.ckpt.convert import export_hf
    from kuangchao_core.ckpt.lora_export import export_peft, lora_meta
    from kuangchao_core.data.tokenizer_export import write_tokenizer_files

    step_dir = Path(step_dir)
    manifest = step_dir / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{step_dir}: no {MANIFEST}; not a published checkpoint")
    manifest_bytes = manifest.read_bytes()
    for loss in (final_loss, checkpoint_final_loss(step_dir)):  # before anything is built
        check_publishable(None, loss, what=f"export of {step_dir}")
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fmt = "peft" if lora_meta(step_dir) is not None else "hf"
    (export_peft if fmt == "peft" else export_hf)(step_dir, tmp)
    try:
        check_publishable(tmp, None, what=f"export of {step_dir}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_tokenizer_files(tokenizer, tmp, max_length)
    record = {
        "format": fmt,
        "step": int(json.loads(manifest_bytes)["step"]),
        "checkpoint": str(step_dir.resolve()),
        "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
        "tokenizer": tokenizer,
        "files": sorted(p.name for p in tmp.iterdir() if not p.name.startswith(".")) + [EXPORT_RECORD],
    }
    (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return record
