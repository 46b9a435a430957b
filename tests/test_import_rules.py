"""The layer map holds (issue 9): which package of ``kuangchao_core`` may import which, read from the source.

Every import is counted, including those inside functions (a lazy import is still a dependency). The rules are the
ones ``docs/architecture.md`` states and each package's ``__init__`` docstring repeats:

- no core module imports ``tasks``, ``flows``, ``blocks`` or ``kuangchao`` (the CLI and SDK sit above the engine);
- a package imports only the packages below it (``ALLOWED``); there is no way up: the guard interface every layer
  calls to ask permission, with the one registry of interface names, is the leaf ``kuangchao_core.guard_api``
  beside ``errors`` (issue 28), and no package below ``perm`` imports ``perm`` (not even its old
  ``perm.guard_api`` name, kept for callers above the engine); the mesh of named axes, ``kuangchao_core.axes``
  (issue 30), is a third leaf, so the scheduler and the permission layer read the same rank formula;
- there is no import cycle among the packages, nor among the modules (a cycle between two modules of one package
  works only by the accident of which is imported first); imports under ``if TYPE_CHECKING:`` do not run and do
  not count.
- Prefect is the orchestrator's, not the engine's (issue 43 item 6): a core module imports ``prefect`` only when it
  is a launch backend (``PREFECT_LAUNCH_BACKENDS``); everything else the engine asks of Prefect it is given by its
  caller (``kuangchao_core.obs.run_hooks.RunHooks``, built in ``tasks/prefect_hooks.py``).

The checks run on the real tree and, as negative controls, on a graph with one rule broken each.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "kuangchao_core"
OUTSIDE = ("tasks", "flows", "blocks", "kuangchao")

_LEAVES = {"errors", "guard_api", "axes"}
_BASE = _LEAVES | {"config"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "guard_api": {"errors"},
    "axes": {"errors"},
    "config": _LEAVES,
    "hal": _LEAVES,
    "comm": _LEAVES | {"hal"},
    "parallel": _BASE | {"hal", "comm"},
    "models": _BASE | {"hal", "comm", "parallel"},
    "data": _BASE,
    "ckpt": _BASE | {"hal", "comm", "parallel", "models"},
    "obs": _BASE,
    "sched": _BASE | {"hal", "comm", "obs"},
    "perm": _BASE | {"hal", "comm", "parallel", "models", "data", "ckpt", "obs", "sched"},
    "engine": _BASE | {"hal", "comm", "parallel", "models", "data", "ckpt", "obs", "sched", "perm"},
    "job": _BASE | {"hal", "comm", "parallel", "models", "data", "ckpt", "obs", "sched", "perm", "engine"},
}


def _package_of(path: Path) -> str:
    rel = path.relative_to(CORE).parts
    return rel[0].removesuffix(".py")


def import_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported target -> files importing it; targets are core packages (``errors`` and ``guard_api``
    count as packages) or an outside package (``tasks`` …)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for f in sorted(CORE.rglob("*.py")):
        pkg = _package_of(f)
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                parts = node.module.split(".")
                if parts[0] == "kuangchao_core" and len(parts) > 1:
                    targets.append(parts[1])
                elif node.module == "kuangchao_core":  # ``from kuangchao_core import guard_api``
                    targets.extend(
                        a.name for a in node.names if (CORE / f"{a.name}.py").exists() or (CORE / a.name).is_dir()
                    )
                elif parts[0] in OUTSIDE:
                    targets.append(parts[0])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == "kuangchao_core" and len(parts) > 1:
                        targets.append(parts[1])
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
            elif pkg not in ALLOWED:
                out.append(f"{pkg} is a package with no rule in ALLOWED (and docs/architecture.md): {where}")
            elif target not in ALLOWED[pkg]:
                out.append(f"{pkg} imports {target}, which is not below it: {where}")
    return out


def cycles(graph) -> list[list[str]]:
    """Import cycles among packages (outside packages excluded)."""
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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST):
    """Import nodes that run (those under ``if TYPE_CHECKING:`` are skipped)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_imports(child)] if _is_import(n))
            continue
        if _is_import(node):
            yield node
        yield from _runtime_imports(node)


def _is_import(node: ast.AST) -> bool:
    return isinstance(node, ast.Import | ast.ImportFrom)


def module_graph() -> dict[str, set[str]]:
    """module -> the ``kuangchao_core`` modules it imports at run time (``from pkg import sub`` names ``pkg.sub``)."""
    files = {_module_name(f): f for f in CORE.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, f in files.items():
        for node in _runtime_imports(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level or not (node.module or "").startswith("kuangchao_core"):
                    continue
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module for a in node.names
                ]
            else:
                targets = [a.name for a in node.names]
            graph[mod] |= {t for t in targets if t in files and t != mod}
    return graph


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
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


def test_nothing_below_perm_imports_perm():
    """The permission check stands on the ground floor: only the engine and the job (above ``perm``) import
    ``perm``; every other layer asks through ``kuangchao_core.guard_api``, which imports nothing but ``errors``."""
    graph = import_graph()
    importers = {pkg: files for pkg, targets in graph.items() for t, files in targets.items() if t == "perm"}
    assert set(importers) <= {"engine", "job"}, importers
    assert set(graph["guard_api"]) <= {"errors"}, dict(graph["guard_api"])
    users = {pkg for pkg, targets in graph.items() if "guard_api" in targets}
    assert {"hal", "comm", "data", "ckpt", "obs", "config", "perm"} <= users, users  # the parser sees the leaf
    graph["hal"]["perm"].append("kuangchao_core/hal/memory.py")  # the old way up, ``perm.guard_api``
    assert "hal imports perm, which is not below it: kuangchao_core/hal/memory.py" in violations(graph)


def test_the_interface_names_are_written_once():
    """The schema and the permission layer read the registry in ``guard_api``; no other module spells the list."""
    from kuangchao_core import guard_api
    from kuangchao_core.config import KNOWN_INTERFACES
    from kuangchao_core.perm import names

    assert KNOWN_INTERFACES is guard_api.INTERFACES
    assert names.INTERFACE_KINDS is guard_api.INTERFACE_KINDS and names.INTERFACES is guard_api.INTERFACES
    spelled = {
        str(f.relative_to(ROOT))
        for f in CORE.rglob("*.py")
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8")))
        if isinstance(node, ast.Set | ast.List | ast.Tuple | ast.Dict)
        and {"checkpoint_write", "dataset_read", "metrics_read", "config_write"}
        <= {c.value for c in (node.keys if isinstance(node, ast.Dict) else node.elts) if isinstance(c, ast.Constant)}
    }
    assert spelled == {"kuangchao_core/guard_api.py"}, spelled


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


def test_no_import_cycle_among_core_modules():
    graph = module_graph()
    assert "kuangchao_core.comm.registry" in graph["kuangchao_core.comm.group"], "the parser missed an import"
    assert module_cycles(graph) == []
    graph["kuangchao_core.ckpt.index"].add("kuangchao_core.ckpt.convert")  # the index reaching the converter
    assert module_cycles(graph) == [["kuangchao_core.ckpt.convert", "kuangchao_core.ckpt.index"]]


# Core modules that may import Prefect: the node-agent launch backend, whose mechanism is Prefect itself.
PREFECT_LAUNCH_BACKENDS = {
    "kuangchao_core/sched/multinode.py",  # each node's share runs as a deployment run on that node's work queue
    "kuangchao_core/sched/node_registry.py",  # work pool and queues, agent deployment, facts as Prefect Variables
}


def _imports_prefect(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "prefect" for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and (node.module or "").split(".")[0] == "prefect"
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        first = node.args[0].value
        return name in ("import_module", "__import__") and isinstance(first, str) and first.split(".")[0] == "prefect"
    return False


def prefect_importers(sources: dict[str, str]) -> set[str]:
    """The files of ``sources`` (path -> text) that import ``prefect`` anywhere (in a function, under
    ``TYPE_CHECKING``, through ``importlib.import_module``)."""
    return {path for path, text in sources.items() if any(map(_imports_prefect, ast.walk(ast.parse(text))))}


def _core_sources() -> dict[str, str]:
    return {str(f.relative_to(ROOT)): f.read_text(encoding="utf-8") for f in sorted(CORE.rglob("*.py"))}


def test_only_the_launch_backends_of_the_core_import_prefect():
    found = prefect_importers(_core_sources())
    assert found - PREFECT_LAUNCH_BACKENDS == set(), "pass what the core needs in (RunHooks) instead"
    assert found == PREFECT_LAUNCH_BACKENDS, "a backend that no longer imports Prefect leaves the list"


def test_a_core_module_importing_prefect_is_caught():
    planted = {
        "kuangchao_core/job/lazy.py": "def f():\n    from prefect.artifacts import create_markdown_artifact\n",
        "kuangchao_core/obs/plain.py": "import prefect.context as ctx\n",
        "kuangchao_core/perm/hidden.py": "import importlib\nmod = importlib.import_module('prefect.settings')\n",
        "kuangchao_core/ckpt/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import prefect\n",
        "kuangchao_core/engine/clean.py": "import prefects_like\nfrom .prefect import x\nname = 'prefect'\n",
    }
    found = prefect_importers({**_core_sources(), **planted}) - PREFECT_LAUNCH_BACKENDS
    assert found == set(planted) - {"kuangchao_core/engine/clean.py"}, found
