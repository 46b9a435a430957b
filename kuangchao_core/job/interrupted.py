"""The one line of a job interrupted by Ctrl-C or SIGTERM (issue 45 §1; the signals: :mod:`kuangchao_core.sched.interrupt`).

``interrupted at step S; last checkpoint step C; resume with: kc train --config … --resume auto``: S is the last step
the ranks reported, C the newest published checkpoint of the run's lineage (a step directory is published whole by
a rename, so one that is there is complete; hashing it would take minutes on a large model, and ``--resume auto``
verifies it anyway), or the checkpoint the run resumed from when it was interrupted before its lineage was held.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kuangchao_core.ckpt.layout import parse_step_dir
from kuangchao_core.sched import interrupt


def newest_published_step(lineage_dir: str | None) -> int | None:
    """The step of the newest published checkpoint under ``lineage_dir`` (its ``manifest.json`` there), or None."""
    if not lineage_dir or not Path(lineage_dir).is_dir():
        return None
    steps = [
        step
        for p in Path(lineage_dir).iterdir()
        if (step := parse_step_dir(p.name)) is not None and (p / "manifest.json").is_file()
    ]
    return max(steps) if steps else None


def interrupted_line(record: dict[str, Any], config_path: str, overrides: list[str]) -> str:
    """The line, from what the flow noted of its run (``record``: :func:`kuangchao_core.obs.prefect_watch.note`)."""
    saved = newest_published_step(record.get("lineage_dir"))
    if saved is None:
        saved = record.get("resume_step")
    step = interrupt.last_step()
    if step is not None and saved is not None:
        step = max(step, saved)  # killed ranks: their last steps' report may not have left them, their checkpoint did
    return interrupt.line(step, saved, config_path, overrides)
