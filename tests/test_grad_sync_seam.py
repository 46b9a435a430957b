"""The GradSync seam is closed (issue 28 §1): the engine never asks which optimizer it holds.

Every capability the engine uses (memory report, tensor bytes, full parameters, comm-state tensors, the
gradient-norm share …) is a method of :class:`~kuangchao_core.parallel.grad_sync.GradSync`, implemented by both
implementations; outside ``parallel/`` no module probes for one (``hasattr``, ``getattr`` with a default,
``isinstance`` against an optimizer class); ``ShardedAdamW`` uses only ZeRO's public surface; and ZeRO talks to
the communication layer through ``comm.primitives`` like the rest of ``parallel/`` (no private import shims).

The source checks run on the real tree and, as negative controls, on snippets that break each rule.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from kuangchao_core.comm import primitives
from kuangchao_core.parallel import grad_sync, zero, zero3, zero_state
from kuangchao_core.parallel.data import DataParallel
from kuangchao_core.parallel.grad_sync import GradSync, ReplicatedAdamW, ShardedAdamW
from kuangchao_core.parallel.zero import ZeroOptimizer
from kuangchao_core.parallel.zero3 import Zero3Optimizer
from kuangchao_core.parallel.zero_state import ShardedState

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "kuangchao_core"
CLASSES = (ReplicatedAdamW, ShardedAdamW, ZeroOptimizer, Zero3Optimizer, ShardedState, DataParallel)


def _public(cls) -> set[str]:
    """The public names a class defines itself (not those of ``nn.Module`` or ``object``)."""
    return {n for n in vars(cls) if not n.startswith("_")}


def _protocol_members() -> set[str]:
    own = {n for n in vars(GradSync) if not n.startswith("_")}
    return own | set(GradSync.__annotations__)


#: names only an optimizer or a grad sync answers to (generic words such as ``step`` are caught by the receiver)
CAPABILITIES = set().union(*(_public(c) for c in CLASSES)) - {"step", "trace", "prepare", "finish", "model", "mesh"}
RECEIVER_WORDS = ("sync", "optim", "zero")


def probes(source: str, where: str) -> list[str]:
    """Capability probes in ``source``: ``hasattr``/``getattr``-with-default of an optimizer or grad-sync
    capability (by its name, or on a receiver named ``*sync*``/``*optim*``), and ``isinstance`` or ``type(...) is``
    against an optimizer or grad-sync class."""
    found = []
    class_names = {c.__name__ for c in CLASSES} | {"GradSync"}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call | ast.Compare):
            continue
        if isinstance(node, ast.Compare):
            if isinstance(node.left, ast.Call) and ast.unparse(node.left.func) == "type":
                names = {ast.unparse(c).rsplit(".", 1)[-1] for c in node.comparators}
                if names & class_names:
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            continue
        func = ast.unparse(node.func)
        args = node.args
        if func == "isinstance" and len(args) == 2:
            kinds = args[1].elts if isinstance(args[1], ast.Tuple) else [args[1]]
            if {ast.unparse(k).rsplit(".", 1)[-1] for k in kinds} & class_names:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif (func == "hasattr" and len(args) == 2) or (func == "getattr" and len(args) == 3):
            name = args[1].value if isinstance(args[1], ast.Constant) else None
            receiver = ast.unparse(args[0]).lower()
            if name in CAPABILITIES or any(w in receiver for w in RECEIVER_WORDS):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_capability_probe_outside_parallel():
    found = []
    for f in sorted(CORE.rglob("*.py")):
        rel = f.relative_to(ROOT)
        if rel.parts[1] != "parallel":
            found += probes(f.read_text(encoding="utf-8"), str(rel))
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "if hasattr(self.sync, 'memory_report'): pass",
        "full = getattr(self.sync, 'full_parameters', None)",
        "comm_state = getattr(trainer.sync, 'comm_state_tensors', dict)()",
        "report = getattr(s, 'memory_report', None)",
        "if isinstance(self.sync, ShardedAdamW): pass",
        "if isinstance(opt, (grad_sync.ReplicatedAdamW, int)): pass",
        "if type(self.sync.optimizer) is Zero3Optimizer: pass",
        "if getattr(self.optimizer, 'stage', 0) == 3: pass",
    ],
)
def test_each_kind_of_probe_is_found(snippet):
    assert probes(snippet, "x.py"), snippet


def test_an_unrelated_getattr_is_not_a_probe():
    assert probes("chosen = getattr(settings, 'actions', None)\nhasattr(corpus, 'loss_floor')", "x.py") == []


@pytest.mark.parametrize("impl", [ReplicatedAdamW, ShardedAdamW])
def test_both_implementations_offer_every_method_of_the_interface(impl):
    missing = sorted(n for n in _protocol_members() if not hasattr(impl, n))
    assert missing == [], f"{impl.__name__} lacks {missing}"
    for name in ("memory_report", "tensor_bytes", "full_parameters", "comm_state_tensors", "grad_norm_sq"):
        assert name in _protocol_members(), f"GradSync does not declare {name}"
        assert name in vars(impl), f"{impl.__name__}.{name} is inherited or missing, not implemented"


@pytest.mark.parametrize("opt", [ZeroOptimizer, Zero3Optimizer])
def test_both_zero_optimizers_offer_what_sharded_adamw_calls(opt):
    tree = ast.parse(inspect.getsource(ShardedAdamW))
    called = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and ast.unparse(n.value) == "self.optimizer"
        and not isinstance(n.ctx, ast.Store)
    }
    assert called, "the parser found no call on self.optimizer"
    private = sorted(a for a in called if a.startswith("_") or a in {"optimizer", "buckets", "owned_pieces"})
    assert private == [], f"ShardedAdamW reads ZeRO's internals: {private}"
    assert sorted(a for a in called if not hasattr(opt, a)) == [], opt.__name__


def test_zero_has_one_comm_path():
    """The grad sync and ZeRO (zero, zero3, zero_state) import ``comm.primitives`` at module level, as the rest of
    parallel/ does; none of their functions imports the communication layer (a private shim)."""
    for mod in (zero, zero3, zero_state, grad_sync):
        assert mod.comm is primitives, mod.__name__
    for mod in (zero, zero3, zero_state, grad_sync):
        f = Path(mod.__file__)
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef):
                lazy = [
                    ast.unparse(n)
                    for n in ast.walk(fn)
                    if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("kuangchao_core.comm")
                ]
                assert lazy == [], f"{f.name}:{fn.name} imports the comm layer itself: {lazy}"
