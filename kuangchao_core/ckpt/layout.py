"""Names and constants of the on-disk checkpoint format (version 1).

::

    <checkpoint.dir>/<task.name>/step_<N:08d>/
        shards/rank_<r:05d>.safetensors   tensors only: param.<name>, optim.<name>.<key>
        rng/rank_<r:05d>.json             RNG states of that rank (torch CPU/CUDA, numpy, python)
        state.json                        step, scheduler, sampler, … (written by rank 0)
        manifest.json                     written last: sha256 + size of every file, versions, configs

A step directory is published by renaming ``step_<N>.tmp-<nonce>`` to ``step_<N>``; only a directory whose
name is exactly ``step_<N:08d>`` (at least 8 digits, no other spelling) is a checkpoint.
"""

from __future__ import annotations

import re

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE = "state.json"
LOGGER_NAME = "kuangchao.ckpt"

# safetensors metadata keys (the header holds string -> string; values are JSON)
META_FORMAT = "kuangchao.format_version"
META_SLICES = "kuangchao.slices"
META_EXTRA = "kuangchao.extra"

_STEP_RE = re.compile(r"^step_(\d{8,})$")
_TMP_RE = re.compile(r"^step_(\d{8,})\.tmp-([A-Za-z0-9_.-]+)$")


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
