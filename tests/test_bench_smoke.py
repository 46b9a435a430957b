"""Every benchmark script runs: its ``--smoke`` mode, one test per script of ``benchmarks/`` and ``benchmarks/gpu/``
(collected from the folders, so a new script is covered without a line here), with the keys it declares; every
``_`` helper imports; the checker itself fails a script without ``--smoke`` or with other keys (issue 42).

The contract is ``tests/bench_smoke.py``'s docstring. Each smoke run also writes its result file (``KC_BENCH_JSON``)
and that file is rendered into a copy of RESULTS.md, so the renderer handles every script's result.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from tests.bench_smoke import (
    BENCH,
    RUN_ELSEWHERE,
    SECTIONS,
    check_script,
    declared_keys,
    helpers,
    rel,
    scripts,
)

ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "tools"))

import bench_tables  # noqa: E402

from benchmarks._results import bench_name  # noqa: E402


def _params():
    out = []
    for path in scripts():
        out.append(pytest.param(path, id=rel(path), marks=pytest.mark.timeout(300)))
    return out


def test_the_folders_hold_the_scripts_this_test_is_about():
    names = {rel(p) for p in scripts()}
    assert {"dp_vs_ddp.py", "scaling_model.py", "agree.py", "gpu/check.py"} <= names, names
    assert not any(Path(n).name.startswith("_") for n in names)
    assert set(SECTIONS) | set(RUN_ELSEWHERE) <= names


@pytest.mark.parametrize("script", _params())
def test_each_benchmark_smoke_run_prints_the_keys_it_declares(script: Path, tmp_path):
    name = rel(script)
    if name in SECTIONS:  # a section of gpu/check.py: its figures are under that key of check.py's result
        check = BENCH / "gpu" / "check.py"
        imported = {n.module for n in ast.walk(ast.parse(check.read_text())) if isinstance(n, ast.ImportFrom)}
        assert script.stem in imported, f"gpu/check.py no longer imports its section {name}"
        assert SECTIONS[name] in declared_keys(check)
        return
    if name in RUN_ELSEWHERE:  # another test makes the smoke run and checks it with the same function
        file, test = RUN_ELSEWHERE[name].split("::")
        tree = ast.parse((ROOT / "tests" / file).read_text())
        body = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == test), None)
        assert body is not None, f"{RUN_ELSEWHERE[name]} is gone: {name}'s smoke run is no test's"
        calls = {getattr(c.func, "id", None) for c in ast.walk(body) if isinstance(c, ast.Call)}
        assert "assert_smoke_result" in calls, f"{RUN_ELSEWHERE[name]} does not check the keys of {name}"
        declared_keys(script)
        return
    json_dir = tmp_path / "json"
    result = check_script(script, json_dir=json_dir)
    assert [p.name for p in json_dir.glob("*.json")] == [f"{bench_name(script)}.json"]
    record = json.loads((json_dir / f"{bench_name(script)}.json").read_text())
    assert record["result"] == result and record["smoke"] is True
    assert record["machine"]["cores"] >= 1 and record["date"] and record["command"].endswith("--smoke")
    copy = tmp_path / "RESULTS.md"
    shutil.copy(BENCH / "RESULTS.md", copy)
    assert bench_tables.render(json_dir, copy, allow_smoke=True) == [record["benchmark"]]
    assert f"<!-- bench:{record['benchmark']} -->" in copy.read_text()


@pytest.mark.parametrize("helper", helpers(), ids=lambda p: rel(p))
def test_each_helper_module_imports(helper: Path):
    spec = importlib.util.spec_from_file_location(f"kc_bench_helper_{helper.stem}", helper)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    sys.path.insert(0, str(helper.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(helper.parent))
        del sys.modules[spec.name]
    assert module.__doc__, f"{rel(helper)} has no docstring"


SCRIPT = """
    import argparse, sys
    sys.path.insert(0, {bench!r})
    from _results import emit
    RESULT_KEYS = {declared}
    ap = argparse.ArgumentParser()
    {smoke_flag}
    args = ap.parse_args()
    emit({result}, {keys}, smoke=True)
    {extra}
"""
GOOD = {"declared": '("ratio", "n")', "smoke_flag": 'ap.add_argument("--smoke", action="store_true")',
        "result": '{"ratio": 1.0, "n": 1}', "keys": "RESULT_KEYS", "extra": ""}  # fmt: skip


def _write(folder: Path, name: str, **change) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(SCRIPT.format(bench=str(BENCH), **{**GOOD, **change})))
    return path


def test_negative_controls_a_script_without_smoke_or_with_other_keys_fails_the_check(tmp_path):
    assert check_script(_write(tmp_path, "good.py")) == {"ratio": 1.0, "n": 1}  # the positive control
    no_smoke = _write(tmp_path, "no_smoke.py", smoke_flag="")
    assert [p.name for p in scripts([tmp_path])] == ["good.py", "no_smoke.py"]  # a new file is collected
    with pytest.raises(AssertionError, match="exited 2(.|\\n)*unrecognized arguments: --smoke"):
        check_script(no_smoke)
    # emits other keys than it declares: _results.emit refuses at run time (a real run would fail the same way)
    other = _write(tmp_path, "other_keys.py", result='{"ratio": 1.0, "blocks": 1}')
    with pytest.raises(AssertionError, match="exited 1(.|\\n)*missing \\['n'\\], not declared \\['blocks'\\]"):
        check_script(other)
    # hands emit keys of its own instead of its RESULT_KEYS: the test's comparison with the declaration catches it
    own = _write(tmp_path, "own_keys.py", result='{"ratio": 1.0}', keys='("ratio",)')
    with pytest.raises(AssertionError, match="RESULT keys missing \\['n'\\]"):
        check_script(own)
    undeclared = _write(tmp_path, "undeclared.py", declared="tuple(KEYS)")
    with pytest.raises(AssertionError, match="RESULT_KEYS is not a tuple of strings"):
        check_script(undeclared)
    printed = _write(tmp_path, "printed.py", extra='print("RESULT {}")')
    with pytest.raises(AssertionError, match="prints a RESULT line itself"):
        check_script(printed)
