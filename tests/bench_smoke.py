"""The benchmark scripts' smoke contract, checked (issue 42): what ``tests/test_bench_smoke.py`` runs per script.

A *script* is every ``*.py`` of ``benchmarks/`` and ``benchmarks/gpu/`` whose name does not start with ``_``
(``_ratios.py`` and the like are helpers the scripts import: the test imports each of them instead). A script:

- declares its top-level result keys as a literal tuple ``RESULT_KEYS = (...)`` (read here without importing it);
- prints ``RESULT {json}`` only through ``benchmarks/_results.emit``, which refuses a result whose keys differ
  from ``RESULT_KEYS`` (so the real run cannot print other keys than the smoke run);
- runs with ``--smoke`` alone, in seconds on a CPU, exit status 0, its last ``RESULT`` line carrying those keys.

:data:`SECTIONS` (``benchmarks/_results.py``) names the files of ``benchmarks/gpu/`` that are sections of ``check.py`` (imported and run by it;
their keys are inside check.py's result), and :data:`RUN_ELSEWHERE` the scripts whose smoke run is another test's
(``tests/test_gpu_check.py`` runs ``check.py --smoke`` with the session's Prefect server and checks its figures):
those tests call :func:`assert_smoke_result` on the run they make.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._results import SECTIONS

__all__ = ["SECTIONS", "assert_smoke_result", "check_script", "declared_keys", "helpers", "scripts"]

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
FOLDERS = (BENCH, BENCH / "gpu")

#: scripts whose smoke run is made by another test: "file::test" (that test calls assert_smoke_result)
RUN_ELSEWHERE = {"gpu/check.py": "test_gpu_check.py::test_gpu_check_smoke_runs_every_section_with_sane_figures"}


def scripts(folders=FOLDERS) -> list[Path]:
    """Every benchmark script of ``folders`` (not the ``_`` helpers), sorted."""
    return sorted(p for d in folders for p in d.glob("*.py") if not p.name.startswith("_"))


def helpers(folders=FOLDERS) -> list[Path]:
    """The ``_`` helper modules of ``folders``."""
    return sorted(p for d in folders for p in d.glob("_*.py"))


def rel(path: Path) -> str:
    """``path`` under ``benchmarks/`` (``dp_vs_ddp.py``, ``gpu/check.py``); the bare name outside it."""
    return path.relative_to(BENCH).as_posix() if path.is_relative_to(BENCH) else path.name


def declared_keys(path: Path) -> tuple[str, ...]:
    """The literal ``RESULT_KEYS`` of the script at ``path``; an error naming the script when there is none, when
    it is not a literal, or when the script prints a ``RESULT`` line by itself instead of through ``emit``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "print":
            for node in (n for arg in call.args for n in ast.walk(arg)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("RESULT "):
                    raise AssertionError(f"{rel(path)}:{node.lineno} prints a RESULT line itself: use _results.emit")
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "RESULT_KEYS" for t in node.targets):
            keys = _literal_keys(node.value, tree)
            if keys is None:
                raise AssertionError(f"{rel(path)}: RESULT_KEYS is not a tuple of strings")
            return keys
    raise AssertionError(f"{rel(path)}: no RESULT_KEYS = (...) at module level (see benchmarks/_results.py)")


def _literal_keys(value: ast.expr, tree: ast.Module) -> tuple[str, ...] | None:
    """A tuple of string constants, ``*FIELDS`` (the ratio fields of ``benchmarks/_ratios.py``) allowed in it."""
    if not isinstance(value, (ast.Tuple, ast.List)):
        return None
    out: list[str] = []
    for elt in value.elts:
        if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
            out.append(elt.value)
        elif isinstance(elt, ast.Starred) and getattr(elt.value, "id", None) == "FIELDS":
            out.extend(_ratio_fields())
        else:
            return None
    return tuple(out)


def _ratio_fields() -> tuple[str, ...]:
    tree = ast.parse((BENCH / "_ratios.py").read_text(encoding="utf-8"))
    for node in tree.body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if getattr(target, "id", None) == "FIELDS":
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("benchmarks/_ratios.py has no FIELDS")


def last_result(stdout: str) -> dict | None:
    """The last ``RESULT {json}`` line of ``stdout``, parsed; None without one."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :]) if lines else None


def assert_smoke_result(path: Path, result: dict | None, output: str = "") -> None:
    """``result`` (the smoke run's last RESULT) exists and has exactly the script's declared keys."""
    keys = declared_keys(path)
    assert result is not None, f"{rel(path)} --smoke printed no RESULT line:\n{output[-3000:]}"
    missing, extra = sorted(set(keys) - set(result)), sorted(set(result) - set(keys))
    assert not missing and not extra, f"{rel(path)} --smoke: RESULT keys missing {missing}, not declared {extra}"


def run_smoke(path: Path, json_dir: Path | None = None, timeout_s: float = 240, env: dict | None = None):
    """``python SCRIPT --smoke`` as a user runs it (one thread, this checkout first on the path): returns
    ``(completed process, seconds)``; with ``json_dir``, ``KC_BENCH_JSON`` points there."""
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    if json_dir is not None:
        run_env["KC_BENCH_JSON"] = str(json_dir)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(path), "--smoke"], cwd=ROOT, env=run_env, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip
    return proc, time.perf_counter() - t0


def check_script(path: Path, json_dir: Path | None = None, timeout_s: float = 240) -> dict:
    """Run ``path``'s smoke mode and check it against the contract (see the module docstring); its result."""
    declared_keys(path)  # before the run: a script without the declaration fails at once
    proc, _ = run_smoke(path, json_dir, timeout_s)
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, f"{rel(path)} --smoke exited {proc.returncode}:\n{output}"
    result = last_result(proc.stdout)
    assert_smoke_result(path, result, output)
    return result
