"""The layer map holds (issue 9): which package of ``kuangchao_core`` may import which, read from the source.

Every import is counted, including those inside functions (a lazy import is still a dependency). The rules are the
ones ``docs/architecture.md`` states and each package's ``__init__`` docstring repeats:

- no core module imports ``tasks``, ``flows``, ``blocks`` or ``kuangchao`` (the CLI and SDK sit above the engine);
- a package imports only the packages below it (``ALLOWED``); the one way up is the guard interface
  ``kuangchao_core.perm.guard_api``, which every layer calls to ask permission;
- there is no import cycle among the packages.

The checks run on the real tree and, as negative controls, on a graph with one rule broken each.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "kuangchao_core"
GUARD = "perm.guard_api"
OUTSIDE = ("tasks", "flows", "blocks", "kuangchao")

_BASE = {"errors", "config"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors"},
    "hal": {"errors"},
    "comm": {"errors", "hal"},
    "parallel": _BASE | {"hal", "comm"},
    "models": _BASE | {"hal", "comm", "parallel"},
    "data": _BASE,
    "ckpt": _BASE | {"hal", "comm", "parallel", "models"},
    "obs": _BASE,
    "sched": _BASE | {"hal", "comm", "obs"},
    "perm": _BASE | {"hal", "comm", "parallel", "models", "data", "ckpt", "obs", "sched"},
    "engine": _BASE | {"hal", "comm", "parallel", "models", "data", "ckpt", "obs", "sched", "perm"},
}


def _package_of(path: Path) -> str:
    rel = path.relative_to(CORE).parts
    return rel[0].removesuffix(".py")


def import_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported target -> files importing it; targets are core packages, ``perm.guard_api`` or an
    outside package (``tasks`` …)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for f in sorted(CORE.rglob("*.py")):
        pkg = _package_of(f)
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                parts = node.module.split(".")
                if parts[0] == "kuangchao_core" and len(parts) > 1:
                    names = {a.name for a in node.names}
                    is_guard = node.module == "kuangchao_core.perm.guard_api" or (
                        node.module == "kuangchao_core.perm" and names == {"guard_api"}
                    )
                    targets.append(GUARD if is_guard else parts[1])
                elif parts[0] in OUTSIDE:
                    targets.append(parts[0])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == "kuangchao_core" and len(parts) > 1:
                        targets.append(GUARD if alias.name == "kuangchao_core.perm.guard_api" else parts[1])
                    elif parts[0] in OUTSIDE:
                        targets.append(parts[0])
            for t in targets:
                if t != pkg:
                    graph[pkg][t].append(str(f.relative_to(ROOT)))
    return graph


def violations(graph) -> list[str]:
    """Every broken rule, one line each naming the files."""
    out = []
    for pkg, targets in sorted(graph.items()):
        for target, files in sorted(targets.items()):
            where = ", ".join(sorted(set(files))[:3])
            if target in OUTSIDE:
                out.append(f"{pkg} imports {target} (outside the engine): {where}")
            elif target == GUARD:
                continue
            elif pkg not in ALLOWED:
                out.append(f"{pkg} is a package with no rule in ALLOWED (and docs/architecture.md): {where}")
            elif target not in ALLOWED[pkg]:
                out.append(f"{pkg} imports {target}, which is not below it: {where}")
    return out


def cycles(graph) -> list[list[str]]:
    """Import cycles among packages (the guard interface and outside packages excluded)."""
    edges = {p: {t for t in ts if t in ALLOWED and t != p} for p, ts in graph.items()}
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    return found


def test_every_package_has_a_rule_and_a_layer_docstring():
    packages = {p.name for p in CORE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages - {"errors"} <= set(ALLOWED), packages - set(ALLOWED)
    for name in packages:
        doc = ast.get_docstring(ast.parse((CORE / name / "__init__.py").read_text(encoding="utf-8"))) or ""
        assert "May import:" in doc, f"kuangchao_core/{name}/__init__.py does not say what it may import"


def test_the_tree_keeps_the_layer_rules():
    graph = import_graph()
    assert graph["engine"], "the parser found no imports at all"
    assert violations(graph) == []


def test_no_import_cycle_among_core_packages():
    assert cycles(import_graph()) == []


def test_a_broken_rule_is_reported():
    graph = import_graph()
    graph["hal"]["engine"].append("kuangchao_core/hal/context.py")  # a lower layer reaching up
    graph["ckpt"]["tasks"].append("kuangchao_core/ckpt/writer.py")  # the engine importing a Prefect task
    found = violations(graph)
    assert "hal imports engine, which is not below it: kuangchao_core/hal/context.py" in found
    assert any(v.startswith("ckpt imports tasks (outside the engine)") for v in found)
    clean = import_graph()
    assert cycles(clean) == []
    clean["parallel"]["ckpt"].append("kuangchao_core/parallel/zero.py")  # ckpt imports parallel: now a cycle
    found = cycles(clean)
    assert found and all(c[0] == c[-1] and "ckpt" in c and "parallel" in c for c in found), found
