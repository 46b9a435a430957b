"""The expectation suite's outcomes remembered per records and suite (issue 45 item 2: start-up).

Running the great-expectations suite costs little; importing great-expectations costs seconds at every ``kc train``.
What the suite says is a function of the records' facts (the columns of ``data.record_facts``), the suite's
parameters and definition, and the great-expectations version, so its outcomes are kept in the machine's cache
(``config.paths.machine_cache_dir()/validation/<key>.json``, written atomically, JSON) under a SHA-256 of exactly
those, and the same records checked by the same suite again read them there. Different records, thresholds, suite
code or library version give another key; an unreadable entry is computed again. The facts themselves are always
computed from the records as they are now.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

from kuangchao_core.config.paths import machine_cache_dir

log = logging.getLogger(__name__)
#: each outcome's fields (one dict per expectation of the suite, in its order)
FIELDS = ("name", "success", "expectation", "observed", "expected", "raised")


def outcome_key(frame: Any, params: dict[str, Any], suite_source: str) -> str:
    """SHA-256 of the facts' columns (names, dtypes, bytes), the suite's parameters and source, and the library's
    version."""
    h = hashlib.sha256()
    head = {"params": params, "gx": importlib.metadata.version("great_expectations"), "rows": len(frame)}
    h.update(json.dumps(head, sort_keys=True).encode())
    h.update(suite_source.encode())
    for column in frame.columns:
        values = frame[column].to_numpy()
        h.update(f"{column}:{values.dtype.str}:".encode())
        h.update(values.tobytes())
    return h.hexdigest()


def remembered(key: str, compute: Callable[[], list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], bool]:
    """The outcomes under ``key`` from the cache, else ``compute()``'s (then kept); and whether they were cached."""
    path = machine_cache_dir() / "validation" / f"{key}.json"
    try:
        outcomes = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(outcomes, list) and outcomes and all(_well_formed(o) for o in outcomes):
            return outcomes, True
    except (OSError, ValueError):
        pass
    outcomes = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}")
        staged.write_text(json.dumps(outcomes), encoding="utf-8")
        os.replace(staged, path)
    except OSError as exc:  # a read-only cache: the outcomes stand, the next run computes them again
        log.debug("validation outcomes not kept (%s)", exc)
    return outcomes, False


def _well_formed(outcome: Any) -> bool:
    return isinstance(outcome, dict) and set(outcome) == set(FIELDS) and isinstance(outcome["success"], bool)
