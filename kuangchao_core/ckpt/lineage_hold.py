"""Holding a run's lineage, and the step it resumes from, before anything trains.

The resume step is chosen before the lease wait (:func:`~kuangchao_core.ckpt.lineage.plan_training`), but only the
lease holder's retention (``checkpoint.keep_last``) may delete a lineage's steps. So the step is re-chosen once the
lease decision is made:

- the lease taken (the lineage's earlier writer gone, its writers fenced): the lineage's newest intact step now,
  which nobody else may delete any more;
- the lease held by a live run (the run forks a new lineage): the step is pinned against that run's retention by
  hard-linking its files (a copy where links are not possible) into the new lineage as its first step, verified
  there. A step deleted between the choice and the link is replaced by its lineage's newest intact step; when none
  is left the fork is removed again and the run fails naming the lineage, rather than leaving an empty lineage.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kuangchao_core.ckpt.integrity import find_latest_intact, verify_checkpoint
from kuangchao_core.ckpt.layout import parse_step_dir
from kuangchao_core.ckpt.lineage import ResumePlan, create_lineage, lineage_dir, new_lineage_id
from kuangchao_core.ckpt.lineage_lease import Lease, LeaseHeld, release_lease, take_lease
from kuangchao_core.errors import CheckpointError

_PIN_TRIES = 3


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # another file system, or links not allowed: a copy holds the step just as well
        shutil.copy2(src, dst, follow_symlinks=False)


def _pin_step(source: Path, fork: Path) -> Path | None:
    """Link ``source`` into ``fork`` under its own name; the pinned step, or None when ``source`` vanished or does
    not verify as linked (its writer deleted it meanwhile)."""
    tmp = fork / f".{source.name}.tmp-pin-{os.getpid()}"
    try:
        shutil.copytree(source, tmp, symlinks=True, copy_function=_link_or_copy)
        if verify_checkpoint(tmp):
            raise FileNotFoundError(source)
        os.replace(tmp, fork / source.name)
        return fork / source.name
    except (OSError, shutil.Error):
        shutil.rmtree(tmp, ignore_errors=True)
        return None


def _fork(key: Any, plan: ResumePlan, owner: str, say: Callable[[str], None], held: LeaseHeld, kw: dict) -> tuple:
    name = new_lineage_id()
    fork = create_lineage(key, name, started_from=plan.step_dir)
    lease = take_lease(fork, owner, say=say, **kw)
    if plan.step_dir is None:
        say(f"{held}; this run forks a new lineage {name} from scratch instead")
        return ResumePlan(name, True, None, 0, f"{plan.reason}; forked as {name} (lineage busy)"), lease
    source: Path | None = Path(plan.step_dir)
    for _ in range(_PIN_TRIES):
        pinned = _pin_step(source, fork) if source is not None else None
        if pinned is not None:
            step = parse_step_dir(pinned.name) or 0
            say(f"{held}; this run forks a new lineage {name} from {source} (pinned as {pinned}) instead")
            reason = f"{plan.reason}; forked as {name} from {source} (lineage busy)"
            return ResumePlan(name, True, str(pinned), step, reason), lease
        source = find_latest_intact(Path(plan.step_dir).parent)  # the live run's retention removed it: its newest
    release_lease(lease)
    shutil.rmtree(fork, ignore_errors=True)
    raise CheckpointError(
        f"lineage {plan.lineage} is being written by run {held.record.get('owner')} and its steps (first "
        f"{plan.step_dir}) were deleted while this run tried to fork from them ({_PIN_TRIES} tries); nothing was "
        "forked: run again, or resume from a step that is kept"
    )


def hold_lineage(
    key: Any, plan: ResumePlan, owner: str, say: Callable[[str], None], **kw: Any
) -> tuple[ResumePlan, Lease]:
    """Take the lease of ``plan``'s lineage for run ``owner`` (waiting for a live holder as
    :func:`~kuangchao_core.ckpt.lineage_lease.take_lease` does). When the holder stays alive, the run does not share
    its lineage: it forks a new lineage from the same checkpoint (pinned against the holder's retention), says so, and
    returns that plan; the resume step is re-chosen once the lease is decided. Returns ``(plan, lease)``; ``kw``
    goes to ``take_lease``. ``key``: the job's :class:`~kuangchao_core.config.settings.LineageKey`."""
    path = lineage_dir(key, plan.lineage)
    try:
        lease = take_lease(path, owner, say=say, **kw)
    except LeaseHeld as held:
        return _fork(key, plan, owner, say, held, kw)
    if plan.step_dir is not None and Path(plan.step_dir).parent == path:  # held now: its newest step stays
        found = find_latest_intact(path)
        if found is None:
            release_lease(lease)
            raise CheckpointError(f"lineage {plan.lineage}: {plan.step_dir} and every other step of it are gone")
        if str(found) != plan.step_dir:
            say(f"lineage {plan.lineage}: {plan.step_dir} is gone or no longer the newest; resuming from {found}")
            step = parse_step_dir(found.name) or 0
            return ResumePlan(plan.lineage, plan.new, str(found), step, f"{plan.reason}; then {found}"), lease
    return plan, lease
