"""The orchestrator stays thin (issue 28 §3): the flow reads as its phases, each Prefect task wraps a core function,
the CLI uses the core, and the launcher takes one spec.

- ``flows/train.py`` is at most 150 lines and each ``tasks/*.py`` at most 60 (the work lives in
  ``kuangchao_core/job/``);
- no module of the CLI (``kuangchao/``) imports ``tasks``; only ``kuangchao/cli/train.py`` imports ``flows`` (``kc
  train`` runs the flow itself). Lazy imports inside functions count;
- ``run_workers`` takes one ``LaunchSpec``.

Each check is a function run on the real tree and, as a negative control, on a tree that breaks it.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOW_LIMIT = 150
TASK_LIMIT = 60
MAY_IMPORT_FLOWS = {"kuangchao/cli/train.py"}


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def too_long(root: Path) -> list[str]:
    """The flow module and task modules over their limits, one line each."""
    out = []
    flow = root / "flows" / "train.py"
    if _lines(flow) > FLOW_LIMIT:
        out.append(f"flows/train.py: {_lines(flow)} lines > {FLOW_LIMIT}")
    for f in sorted((root / "tasks").glob("*.py")):
        if _lines(f) > TASK_LIMIT:
            out.append(f"tasks/{f.name}: {_lines(f)} lines > {TASK_LIMIT}")
    return out


def _imported_roots(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
    return found


def cli_imports_above_the_core(root: Path) -> list[str]:
    """CLI modules that import a Prefect task module, or the flows (other than ``kc train``'s)."""
    out = []
    for f in sorted((root / "kuangchao").rglob("*.py")):
        rel = str(f.relative_to(root))
        roots = _imported_roots(f)
        if "tasks" in roots:
            out.append(f"{rel} imports tasks")
        if "flows" in roots and rel not in MAY_IMPORT_FLOWS:
            out.append(f"{rel} imports flows")
    return out


def test_the_flow_and_the_tasks_stay_within_their_line_limits():
    assert too_long(ROOT) == []


def test_the_cli_imports_the_core_never_a_task():
    assert cli_imports_above_the_core(ROOT) == []
    assert "flows" in _imported_roots(ROOT / "kuangchao" / "cli" / "train.py")  # the parser sees a lazy import


def test_the_launcher_takes_one_launch_spec():
    from kuangchao_core.sched.launch_spec import LaunchSpec
    from kuangchao_core.sched.launcher import run_workers

    params = list(inspect.signature(run_workers).parameters.values())
    assert [p.name for p in params] == ["spec"]
    assert params[0].annotation in (LaunchSpec, "LaunchSpec")


def test_the_checks_catch_a_fat_flow_a_fat_task_and_a_cli_importing_a_task(tmp_path):
    (tmp_path / "flows").mkdir()
    (tmp_path / "tasks").mkdir()
    (tmp_path / "kuangchao" / "cli").mkdir(parents=True)
    (tmp_path / "flows" / "train.py").write_text("x = 1\n" * (FLOW_LIMIT + 1))
    (tmp_path / "tasks" / "fat.py").write_text("x = 1\n" * (TASK_LIMIT + 1))
    (tmp_path / "tasks" / "thin.py").write_text("x = 1\n" * TASK_LIMIT)
    (tmp_path / "kuangchao" / "cli" / "debug.py").write_text("def f():\n    from tasks.launch import launch_workers\n")
    (tmp_path / "kuangchao" / "cli" / "other.py").write_text("import flows.train\n")
    (tmp_path / "kuangchao" / "cli" / "train.py").write_text("def f():\n    from flows.train import train_flow\n")
    assert too_long(tmp_path) == [
        f"flows/train.py: {FLOW_LIMIT + 1} lines > {FLOW_LIMIT}",
        f"tasks/fat.py: {TASK_LIMIT + 1} lines > {TASK_LIMIT}",
    ]
    assert cli_imports_above_the_core(tmp_path) == [
        "kuangchao/cli/debug.py imports tasks",
        "kuangchao/cli/other.py imports flows",
    ]
