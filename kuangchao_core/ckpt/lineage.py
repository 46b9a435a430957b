"""Run lineages: the checkpoints of one training run, kept apart from every other run of the same task.

::

    <checkpoint.dir>/<task.name>/run-<UTC time>-<6 hex>/lineage.json
                                                       /step_<N:08d>/ …

A lineage starts when a run trains from scratch (``resume: never``, nothing to resume, or a model/data change) and
continues when a run resumes from one of its checkpoints; every step directory of a lineage was trained by that
chain of runs, so two runs never write, discover or delete each other's steps. Lineage names begin with their UTC
creation time, so they sort oldest to newest. A task directory written before lineages existed holds its step
directories directly; it is read as the oldest lineage, ``legacy``, and never written to.

``resume`` (:func:`plan_resume`):

- ``never``: a new lineage.
- ``auto``: the newest lineage that has an intact checkpoint continues from that checkpoint, provided it trained
  the same model on the same data (:attr:`LineageKey.fingerprint`); otherwise a new lineage (the log says why). A flow run
  pins its lineage for all its attempts (``pinned``): a restarted attempt resumes inside that lineage only.
- a step directory: its lineage continues when it lies in this task's directory and is that lineage's newest
  step; else a new lineage starts from it (recorded as ``started_from``), so resuming from an older step forks
  instead of overwriting the steps after it.

Every function here takes the job's :class:`~kuangchao_core.config.settings.LineageKey` (checkpoint directory, task,
fingerprint, config hash, steps; :func:`~kuangchao_core.config.settings.lineage_key` builds it from the config).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kuangchao_core.ckpt.integrity import find_latest_intact
from kuangchao_core.ckpt.layout import LINEAGE_FILE, is_lineage_name, parse_step_dir
from kuangchao_core.config.bounded_json import read_json_object
from kuangchao_core.config.settings import LineageKey
from kuangchao_core.errors import CheckpointError, NothingToTrain

LEGACY = "legacy"


def new_lineage_id(now: float | None = None) -> str:
    """A fresh lineage name: ``run-<UTC time>-<6 random hex>``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now if now is not None else time.time()))
    return f"run-{stamp}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class Lineage:
    """One lineage of a task: its name and directory (the task directory itself for ``legacy``)."""

    name: str
    path: Path

    def info(self) -> dict[str, Any]:
        """The contents of ``lineage.json`` ({} for ``legacy`` or when unreadable)."""
        try:
            return read_json_object(self.path / LINEAGE_FILE)
        except (OSError, ValueError):
            return {}

    def steps(self) -> list[int]:
        """Published step numbers (intact or not), ascending."""
        if not self.path.is_dir():
            return []
        found = (parse_step_dir(n) for n in os.listdir(self.path) if (self.path / n).is_dir())
        return sorted(s for s in found if s is not None)


def task_dir(key: LineageKey) -> Path:
    """``<checkpoint.dir>/<task.name>``."""
    return Path(key.dir) / key.task


def lineage_dir(key: LineageKey, name: str) -> Path:
    """Where lineage ``name`` of the job's task keeps its step directories."""
    return task_dir(key) if name == LEGACY else task_dir(key) / name


def _created_ns(lin: Lineage) -> int:
    created = lin.info().get("created_ns")
    return int(created) if isinstance(created, int) else lin.path.stat().st_mtime_ns


def list_lineages(tdir: str | os.PathLike[str]) -> list[Lineage]:
    """Every lineage of a task directory, oldest first by creation time (``lineage.json``'s ``created_ns``; two runs
    may start within one second), ``legacy`` first when the directory has bare steps."""
    tdir = Path(tdir)
    if not tdir.is_dir():
        return []
    names = sorted(os.listdir(tdir))
    out = [Lineage(n, tdir / n) for n in names if is_lineage_name(n) and (tdir / n).is_dir()]
    out.sort(key=lambda lin: (_created_ns(lin), lin.name))
    if any(parse_step_dir(n) is not None for n in names):
        out.insert(0, Lineage(LEGACY, tdir))
    return out


def create_lineage(key: LineageKey, name: str, started_from: str | None = None) -> Path:
    """Create lineage ``name`` (its directory and ``lineage.json``, written atomically); returns its directory.
    An existing lineage is left as it is."""
    path = lineage_dir(key, name)
    if name == LEGACY or (path / LINEAGE_FILE).is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    record = {
        "lineage": name,
        "task": key.task,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "created_ns": time.time_ns(),
        "fingerprint": key.fingerprint,
        "config_hash": key.config_hash,
        "started_from": started_from,
    }
    tmp = path / f".{LINEAGE_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=2), encoding="utf-8")
    os.replace(tmp, path / LINEAGE_FILE)
    return path


@dataclass
class ResumePlan:
    """Where a run writes its checkpoints and what it resumes from.

    ``lineage``: the lineage name; ``new``: whether this run starts it; ``step_dir``: the checkpoint to resume from
    (None = train from step 0, or from ``model.checkpoint``); ``step``: its step (0 when none); ``reason``: one
    sentence for the log.
    """

    lineage: str
    new: bool
    step_dir: str | None
    step: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for the flow's logs, the summary and the workers' environment)."""
        return asdict(self)


def _step_of(step_dir: Path) -> int:
    step = parse_step_dir(step_dir.name)
    if step is None:
        raise CheckpointError(f"--resume {step_dir}: not a step directory (step_<N:08d>)")
    return step


def plan_resume(key: LineageKey, resume: str, pinned: str | None = None) -> ResumePlan:
    """Decide the lineage and the resume checkpoint of a run (see the module docstring)."""
    tdir = task_dir(key)
    if pinned is not None:
        lin = Lineage(pinned, lineage_dir(key, pinned))
        found = find_latest_intact(lin.path) if lin.path.is_dir() else None
        if found is not None:
            return ResumePlan(pinned, False, str(found), _step_of(found), f"continuing lineage {pinned}")
        if resume not in ("auto", "never"):
            path = Path(resume)
            return ResumePlan(pinned, not lin.path.is_dir(), str(path), _step_of(path), f"lineage {pinned}")
        return ResumePlan(pinned, not lin.path.is_dir(), None, 0, f"lineage {pinned} has no checkpoint yet")
    if resume == "never":
        name = new_lineage_id()
        return ResumePlan(name, True, None, 0, f"resume: never, so a new lineage {name}")
    if resume == "auto":
        mine = key.fingerprint
        for lin in reversed(list_lineages(tdir)):
            found = find_latest_intact(lin.path)
            if found is None:
                continue
            theirs = lin.info().get("fingerprint")
            if lin.name != LEGACY and theirs and theirs != mine:
                name = new_lineage_id()
                return ResumePlan(
                    name,
                    True,
                    None,
                    0,
                    f"the newest lineage {lin.name} trained another model or data (fingerprint differs); "
                    f"new lineage {name}",
                )
            if lin.name == LEGACY:  # never written to again: continue in a lineage of its own
                name = new_lineage_id()
                return ResumePlan(
                    name, True, str(found), _step_of(found), f"resuming {found} (pre-lineage layout) as {name}"
                )
            return ResumePlan(lin.name, False, str(found), _step_of(found), f"continuing the newest lineage {lin.name}")
        name = new_lineage_id()
        return ResumePlan(name, True, None, 0, f"no intact checkpoint of task {key.task}; new lineage {name}")
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: no such checkpoint directory")
    step = _step_of(path)
    parent = path.resolve().parent
    if is_lineage_name(parent.name) and parent.parent == tdir.resolve():
        newest = Lineage(parent.name, parent).steps()
        if newest and newest[-1] == step:
            return ResumePlan(parent.name, False, str(path), step, f"continuing lineage {parent.name} from {path}")
    name = new_lineage_id()
    return ResumePlan(name, True, str(path), step, f"starting lineage {name} from {path}")


def plan_training(
    key: LineageKey, resume: str, if_finished: str, say: Callable[[str], None] | None = None
) -> ResumePlan:
    """:func:`plan_resume` plus what a run does with a checkpoint already at or past ``train.steps``:
    ``if_finished`` ``error`` raises :class:`NothingToTrain` (before anything starts), ``restart`` plans a new
    lineage from the start, ``skip`` returns that finished plan (the caller trains nothing). ``say`` gets the
    sentences for the run's log. The one decision both ``kc train`` (its early refusal) and the flow make."""
    plan = plan_resume(key, resume)
    if say is not None:
        say(f"checkpoints: {plan.reason} (resume from {plan.step_dir or 'scratch'})")
    if plan.step >= key.steps and if_finished == "restart":
        if say is not None:
            say(f"{plan.step_dir} is finished (step {plan.step} of {key.steps}): a new lineage from the start")
        plan = plan_resume(key, "never")
    if plan.step >= key.steps and if_finished == "error":
        raise NothingToTrain(plan.step, key.steps, str(plan.step_dir))
    return plan
