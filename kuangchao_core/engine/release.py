"""The usable result of a job: its final checkpoint exported as a Hugging Face model (or, for LoRA, PEFT adapters)
with the tokenizer files beside it, and an ``export.json`` naming the checkpoint it came from.

``export.json``: ``format`` (``hf`` or ``peft``), ``step``, ``checkpoint`` (the step directory), ``manifest_sha256``
(of its ``manifest.json``, which lists every shard's sha256 — the checkpoint's identity), ``tokenizer`` (the
``data.tokenizer`` it was trained with) and ``files``. The directory is built under a temporary name and renamed
into place, so it is either whole or absent.
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

EXPORT_RECORD = "export.json"


def export_model(
    step_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], tokenizer: str, max_length: int
) -> dict[str, Any]:
    """Export checkpoint ``step_dir`` (any layout) into ``out_dir`` (replaced when it exists) with the tokenizer
    ``tokenizer`` (``data.tokenizer``); returns the ``export.json`` record."""
    from kuangchao_core.ckpt.convert import export_hf
    from kuangchao_core.ckpt.lora_export import export_peft, lora_meta
    from kuangchao_core.data.tokenizer_export import write_tokenizer_files

    step_dir = Path(step_dir)
    manifest = step_dir / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{step_dir}: no {MANIFEST}; not a published checkpoint")
    manifest_bytes = manifest.read_bytes()
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fmt = "peft" if lora_meta(step_dir) is not None else "hf"
    (export_peft if fmt == "peft" else export_hf)(step_dir, tmp)
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
