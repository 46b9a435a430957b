"""The output contract of every benchmark script (issue 42: benchmarks that cannot rot).

A script in ``benchmarks/`` or ``benchmarks/gpu/`` declares its result's top-level keys as a literal tuple,
``RESULT_KEYS = ("ratio_vs_peer", ...)``, takes ``--smoke`` (tiny sizes, one round, seconds on a CPU) and ends with
:func:`emit`, which prints ``RESULT {json}`` as its last line after checking that the result has exactly the
declared keys, so a real run and a smoke run cannot print different keys (a section left out by a flag is a key
whose value says so, ``{"skipped": why}``). ``tests/test_bench_smoke.py`` runs every script's smoke mode and checks
the keys against the declaration.

With ``KC_BENCH_JSON`` set to a directory, :func:`emit` also writes ``<name>.json`` there: the result with the
machine, the date, the commit and the command that produced it; ``tools/bench_tables.py`` renders those files
into ``benchmarks/RESULTS.md`` (``make bench``).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
JSON_DIR_ENV = "KC_BENCH_JSON"
#: the files of benchmarks/gpu/ that are sections of check.py (it imports and runs them; the key of its result that
#: holds each one's figures): not scripts of their own for the smoke test and ``make bench``
SECTIONS = {"gpu/attention_check.py": "packed_attention", "gpu/memory_check.py": "bytes_per_rank",
            "gpu/engine_check.py": "engine"}  # fmt: skip


class ResultKeysError(ValueError):
    """A benchmark's result does not have the keys its ``RESULT_KEYS`` declares."""


def bench_name(script: str | Path) -> str:
    """The name of a script's JSON file and table: its path under ``benchmarks/`` without ``.py``, ``/`` as ``-``
    (``dp_vs_ddp``, ``gpu-check``)."""
    path = Path(script).resolve()
    try:
        rel = path.relative_to(BENCH_DIR)
    except ValueError:
        rel = Path(path.name)
    return rel.with_suffix("").as_posix().replace("/", "-")


def check_keys(result: dict, keys: Iterable[str], where: str = "the benchmark") -> None:
    """Raise :class:`ResultKeysError` naming the missing and unexpected keys unless ``result``'s top-level keys are
    exactly ``keys``."""
    declared = list(keys)
    missing = [k for k in declared if k not in result]
    extra = [k for k in result if k not in declared]
    if missing or extra:
        raise ResultKeysError(f"{where}: RESULT keys differ from RESULT_KEYS: missing {missing}, not declared {extra}")


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU model and cores, memory, GPU (if any), Python and torch."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages * size / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    torch = sys.modules.get("torch")
    if torch is None:  # a script whose ranks import torch in their own processes: the installed version
        try:
            info["torch"] = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            pass
    else:
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}"
    info.setdefault("gpu", None)
    info["load_avg_1m"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return info


def _commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def _shown(script: str) -> str:
    path = Path(script).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def emit(result: dict, keys: Iterable[str], smoke: bool = False, script: str | None = None) -> None:
    """Check ``result``'s keys against ``keys`` (the script's ``RESULT_KEYS``), print ``RESULT {json}`` and, with
    ``KC_BENCH_JSON`` set, write the record ``tools/bench_tables.py`` renders (``smoke``: the run was a smoke run,
    which the renderer keeps out of RESULTS.md)."""
    script = script or sys.argv[0]
    check_keys(result, keys, where=Path(script).name)
    line = json.dumps(result, default=str)
    out_dir = os.environ.get(JSON_DIR_ENV)
    if out_dir:
        record = {
            "benchmark": bench_name(script),
            "command": " ".join([_shown(script), *sys.argv[1:]]),
            "smoke": bool(smoke),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": _commit(),
            "machine": machine(),
            "result": json.loads(line),
        }
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"{bench_name(script)}.json").write_text(json.dumps(record, indent=1) + "\n")
    print("RESULT " + line, flush=True)
