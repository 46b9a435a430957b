"""Names and constants of the on-disk checkpoint format (version 2; version 1 is still read).

::

    <checkpoint.dir>/<task.name>/<lineage>/step_<N:08d>/      (lineage: run-<UTC time>-<6 hex>, see ckpt.lineage)
        shards/rank_<r:05d>.safetensors   tensors only: param.<name>, optim.<name>.<key>
        rng/rank_<r:05d>.json             RNG states of that rank (torch CPU/CUDA, numpy, python)
        state.json                        step, scheduler, sampler, … (written by rank 0)
        manifest.json                     written last: sha256 + size of every file, versions, configs,
                                          and (version 2) each shard's tensor table: name -> dtype, shape

A step directory is published by renaming ``step_<N>.tmp-<nonce>`` to ``step_<N>``; only a directory whose
name is exactly ``step_<N:08d>`` (at least 8 digits, no other spelling) is a checkpoint. Task directories written
before lineages hold their step directories directly; they are still read.
"""

from __future__ import annotations

import re

#: the manifest format this kuangchao writes. Version 2 adds ``tensor_table`` (per shard, per tensor the dtype
#: and shape of its safetensors header), checked by ``verify_checkpoint``; version 1 steps verify by hash only.
FORMAT_VERSION = 2
#: the manifest formats this kuangchao reads
READ_FORMAT_VERSIONS = (1, 2)
#: the manifest key of the per-shard tensor table (format version 2)
TENSOR_TABLE = "tensor_table"
MANIFEST = "manifest.json"
STATE = "state.json"
LOGGER_NAME = "kuangchao.ckpt"
LINEAGE_FILE = "lineage.json"

# safetensors metadata keys (the header holds string -> string; values are JSON)
META_FORMAT = "kuangchao.format_version"
META_SLICES = "kuangchao.slices"
META_EXTRA = "kuangchao.extra"

_STEP_RE = re.compile(r"^step_(\d{8,})$")
_TMP_RE = re.compile(r"^step_(\d{8,})\.tmp-([A-Za-z0-9_.-]+)$")
_LINEAGE_RE = re.compile(r"^run-\d{8}T\d{6}Z-[0-9a-f]{6}$")


def is_lineage_name(name: str) -> bool:
    """Whether ``name`` is a lineage directory name (``run-<UTC time>-<6 hex>``)."""
    return bool(_LINEAGE_RE.match(name))


def task_of_dir(directory: str) -> str:
    """The task of a task or lineage directory (path or storage key): its name, or its parent's for a lineage."""
    parts = [p for p in directory.replace("\\", "/").split("/") if p]
    if len(parts) >= 2 and is_lineage_name(parts[-1]):
        return parts[-2]
    return parts[-1] if parts else ""


def task_of_step_dir(step_dir: str) -> str:
    """The task a step directory (path or storage key) belongs to, through its lineage directory if it has one."""
    parts = [p for p in step_dir.replace("\\", "/").split("/") if p]
    return task_of_dir("/".join(parts[:-1])) if len(parts) >= 2 else ""


def step_dir_name(step: int) -> str:
    """``step_<N:08d>``."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step_{step:08d}"


def tmp_dir_name(step: int, nonce: str) -> str:
    """The name a step directory has while it is being written."""
    return f"{step_dir_name(step)}.tmp-{nonce}"


def shard_name(rank: int) -> str:
    """Relative path of the tensor shard of ``rank``."""
    return f"shards/rank_{rank:05d}.safetensors"


def rng_name(rank: int) -> str:
    """Relative path of the RNG state file of ``rank``."""
    return f"rng/rank_{rank:05d}.json"


def parse_step_dir(name: str) -> int | None:
    """The step of a published step directory name, or None for anything else (tmp dirs, backups, typos)."""
    m = _STEP_RE.match(name)
    if not m:
        return None
    step = int(m.group(1))
    return step if step_dir_name(step) == name else None


def parse_tmp_dir(name: str) -> int | None:
    """The step of an in-progress (or abandoned) ``step_<N>.tmp-<nonce>`` directory, else None."""
    m = _TMP_RE.match(name)
    return int(m.group(1)) if m else None
