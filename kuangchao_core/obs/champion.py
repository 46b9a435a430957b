"""Which registered version a fine-tune may trust: the ``champion`` alias and the evaluation it was won on.

A registered model has two aliases (:mod:`kuangchao_core.obs.model_registry` moves them):

- ``newest``: the last version registered — any run whose model passed the publish gate (MLflow reserves the alias
  name ``latest``; its own ``models:/NAME/latest`` resolves to the same newest version);
- ``champion``: moved to a new version only when its held-out metric (``tracking.champion_metric``, higher is
  better) beats the current champion's **on the same evaluation**; a tie keeps the incumbent. With no champion
  yet, the first version with the metric takes it. ``tracking.champion_min`` is a floor every champion must reach.

"The same evaluation" is the identity of the held-out set, :func:`evaluation_identity`: a sha256 over what decides
the held-out prompts and answers — for the synthetic corpus its task, ``num_eval``, seed, instruction form, packing
and tokenizer; for ``data.eval_path`` the bytes of its files (names and contents), the data format, text field,
packing and tokenizer. Each version carries it as the tag ``kuangchao.eval_set`` (with a readable
``kuangchao.eval_set_about``), its metric as ``kuangchao.eval_metric`` / ``kuangchao.eval_value``. A run evaluated
on another set, or without the metric, never moves ``champion``; nor does a champion without the tags (moved by
hand) lose it to a run — move it by hand again (``MlflowClient().set_registered_model_alias``) to change the
evaluation.

:func:`decide` compares a candidate with the current champion and returns a :class:`Decision` whose ``why`` is the
sentence the run summary shows.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALIAS_NEWEST = "newest"
ALIAS_CHAMPION = "champion"
EVAL_SET_TAG = "kuangchao.eval_set"
EVAL_ABOUT_TAG = "kuangchao.eval_set_about"
METRIC_TAG = "kuangchao.eval_metric"
VALUE_TAG = "kuangchao.eval_value"
_CHUNK = 1 << 20


def _hash_path(h: Any, root: Path) -> int:
    """Feed every file under ``root`` (names relative to it, sorted, then contents) into ``h``; returns the bytes."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    total = 0
    for path in files:
        h.update(str(path.relative_to(root) if path != root else path.name).encode() + b"\0")
        with open(path, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
                total += len(chunk)
        h.update(b"\0")
    return total


def evaluation_identity(cfg: Any) -> tuple[str | None, str]:
    """``(fingerprint, description)`` of the job's held-out evaluation (see the module docstring); the
    fingerprint is None when the job has no held-out set."""
    data = cfg.data
    if data.is_synthetic:
        syn = data.synthetic
        if syn.num_eval < 1:
            return None, "no held-out problems (data.synthetic.num_eval 0)"
        fields = {
            "kind": "synthetic",
            "task": syn.task,
            "num_eval": syn.num_eval,
            "seed": syn.seed,
            "instructions": syn.instructions,
            "packing": data.packing,
            "tokenizer": data.tokenizer,
        }
        about = f"synthetic {syn.task}, {syn.num_eval} held out (seed {syn.seed})"
        h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
        return h.hexdigest(), about
    if not data.eval_path:
        return None, "no held-out data (data.eval_path unset)"
    path = Path(data.eval_path)
    if not path.exists():
        return None, f"held-out data {path} not found"
    fields = {"kind": "files", "format": data.format, "text_field": data.text_field, "packing": data.packing}
    fields["tokenizer"] = data.tokenizer
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    size = _hash_path(h, path)
    return h.hexdigest(), f"{path.name} ({size} bytes, sha256 {h.hexdigest()[:12]})"


@dataclass(frozen=True)
class Candidate:
    """A run's model as the champion rule sees it: its metric value (None when not logged) and evaluation."""

    metric: str
    value: float | None
    eval_set: str | None
    about: str

    def tags(self) -> dict[str, str]:
        """The version tags that let a later run compare against this one."""
        tags = {METRIC_TAG: self.metric, EVAL_ABOUT_TAG: self.about}
        if self.eval_set is not None:
            tags[EVAL_SET_TAG] = self.eval_set
        if self.value is not None:
            tags[VALUE_TAG] = repr(float(self.value))
        return tags


@dataclass(frozen=True)
class Decision:
    """Whether the candidate takes ``champion``, and why (one sentence for the run summary)."""

    takes_champion: bool
    why: str


def _value(tags: dict[str, str]) -> float | None:
    try:
        value = float(tags.get(VALUE_TAG, "nan"))
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def decide(candidate: Candidate, champion: Any | None, minimum: float | None = None) -> Decision:
    """Does ``candidate`` take ``champion`` from ``champion`` (the current champion's model version, or None)?
    ``minimum``: ``tracking.champion_min``."""
    m = candidate.metric
    if candidate.eval_set is None:
        return Decision(False, f"champion stays: this run has no held-out evaluation ({candidate.about})")
    if candidate.value is None or not math.isfinite(candidate.value):
        return Decision(False, f"champion stays: this run logged no {m}")
    if minimum is not None and candidate.value < minimum:
        return Decision(False, f"champion stays: {m} {candidate.value:.4f} is below tracking.champion_min {minimum}")
    if champion is None:
        return Decision(True, f"champion moved: first champion ({m} {candidate.value:.4f} on {candidate.about})")
    tags = dict(champion.tags)
    held = f"v{champion.version}"
    if tags.get(EVAL_SET_TAG) != candidate.eval_set or tags.get(METRIC_TAG) != m:
        theirs = tags.get(EVAL_ABOUT_TAG) or "an unrecorded evaluation"
        return Decision(
            False,
            f"champion stays at {held}: it was measured on {theirs} ({tags.get(METRIC_TAG) or 'no metric'}), "
            f"this run on {candidate.about} ({m}); runs on different evaluations are not compared",
        )
    incumbent = _value(tags)
    if incumbent is None:
        return Decision(False, f"champion stays at {held}: it records no {m} to compare with")
    if candidate.value > incumbent:
        return Decision(
            True, f"champion moved from {held}: {m} {candidate.value:.4f} > {incumbent:.4f} on {candidate.about}"
        )
    return Decision(
        False, f"champion stays at {held}: {m} {candidate.value:.4f} <= {incumbent:.4f} on {candidate.about}"
    )
