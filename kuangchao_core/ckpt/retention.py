"""Keep-last-K retention that never lets a broken directory take a slot.

Rules of :func:`apply_retention`:

- Only *intact* step directories (those that pass :func:`verify_checkpoint`) count toward ``keep_last``. The
  ``keep_last`` newest intact ones are kept; older intact ones are deleted.
- Corrupt published directories (manifest missing or not matching) are never counted and never deleted: they are
  left for inspection and logged. Delete them by hand once understood.
- Abandoned ``step_<N>.tmp-<nonce>`` directories with ``N`` <= the newest intact step are removed (a save of that
  step can no longer be in progress). Newer tmp directories are left alone.
- ``step_<N>.replaced-*`` directories (moved aside by the writer) and any other names are ignored.

Run it from one process only (rank 0), after a save has been published.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from kuangchao_core import guard_api
from kuangchao_core.ckpt.integrity import _child, _locate_task, verify_checkpoint
from kuangchao_core.ckpt.layout import LOGGER_NAME, parse_step_dir, parse_tmp_dir, task_of_dir
from kuangchao_core.ckpt.storage import Storage
from kuangchao_core.errors import CheckpointError

logger = logging.getLogger(LOGGER_NAME)


@dataclass
class RetentionResult:
    """What :func:`apply_retention` found and did (directory names inside the task directory)."""

    kept: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    removed_tmp: list[str] = field(default_factory=list)


def apply_retention(
    task_dir: str | os.PathLike[str],
    keep_last: int,
    storage: Storage | None = None,
    log: logging.Logger | None = None,
    protect: str | None = None,
) -> RetentionResult:
    """Delete intact step directories beyond the ``keep_last`` newest intact ones; see the module docstring.

    ``task_dir`` is one lineage's directory (or a pre-lineage task directory): other lineages are never looked at.
    ``protect`` names a step directory that is kept whatever its rank (the one the caller just wrote)."""
    if keep_last < 1:
        raise CheckpointError(f"checkpoint.keep_last must be >= 1, got {keep_last}; it would delete every checkpoint")
    log = log or logger
    guard_api.check("checkpoint_write", f"checkpoint:{task_of_dir(Path(task_dir).as_posix())}")
    st, key, where = _locate_task(task_dir, storage)
    names = st.list_dir(key)
    published = sorted(
        ((s, n) for n in names if (s := parse_step_dir(n)) is not None and st.is_dir(_child(key, n))), reverse=True
    )
    result = RetentionResult()
    intact: list[tuple[int, str]] = []
    for step, name in published:
        problems = verify_checkpoint(_child(key, name), storage=st)
        if problems:
            result.corrupt.append(name)
            log.warning(
                "retention: %s/%s is corrupt and is not counted (left in place): %s", where, name, "; ".join(problems)
            )
        else:
            intact.append((step, name))
    result.kept = [n for _, n in intact[:keep_last]]
    for _, name in intact[keep_last:]:
        if name == protect:
            result.kept.append(name)
            continue
        st.remove_tree(_child(key, name))
        result.deleted.append(name)
        log.info("retention: deleted %s/%s (keep_last=%d)", where, name, keep_last)
    if intact:
        newest = intact[0][0]
        for name in names:
            step = parse_tmp_dir(name)
            if step is not None and step <= newest:
                st.remove_tree(_child(key, name))
                result.removed_tmp.append(name)
                log.info("retention: removed abandoned %s/%s", where, name)
    return result
