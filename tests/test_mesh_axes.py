"""The mesh of named axes (issue 30): one rank formula for every layer, a ``cp`` axis, and a scan that keeps it one.

- ``kuangchao_core.axes`` maps every rank to its coordinates and back at layouts with and without CP, and its groups
  partition the world along each axis (checked against the formula written out here, in the test);
- the three-axis layouts keep their groups, names and construction order (the lists other tests pin);
- the ``cp`` axis: config field validated by path, tokens grant its groups, placement keeps it inside DP,
  ``kc plan`` shows its groups, training refuses it before launch (its path is not built yet);
- no module of ``kuangchao_core`` but ``axes`` maps ranks to coordinates (an AST scan), with a negative control
  that feeds the scan the duplicated formulas the code used to hold.
"""

from __future__ import annotations

import ast
import re
from itertools import product
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kuangchao_core.axes import GRID, SIZE_KEYS, MeshAxes, group_name, validated
from kuangchao_core.config import config_from_dict
from kuangchao_core.errors import ConfigError, PlanError

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "kuangchao_core"
LAYOUTS = [(1, 1, 1, 1), (2, 1, 2, 2), (1, 2, 1, 1), (2, 2, 1, 2), (2, 2, 2, 2), (3, 2, 1, 4), (1, 4, 2, 1)]


def _reference_rank(d: int, c: int, p: int, t: int, cp: int, pp: int, tp: int) -> int:
    """The formula issue 30 states (dp, cp, pp, tp; innermost last), written independently of the module."""
    return d * (cp * pp * tp) + c * (pp * tp) + p * tp + t


@pytest.mark.parametrize("dp,cp,pp,tp", LAYOUTS)
def test_every_rank_round_trips_and_matches_the_stated_formula(dp, cp, pp, tp):
    axes = MeshAxes(dp=dp, cp=cp, pp=pp, tp=tp)
    assert axes.world_size == dp * cp * pp * tp
    seen = []
    for d, c, p, t in product(range(dp), range(cp), range(pp), range(tp)):
        rank = axes.rank_of(dp=d, cp=c, pp=p, tp=t)
        assert rank == _reference_rank(d, c, p, t, cp, pp, tp)
        assert axes.coords_of(rank) == {"dp": d, "cp": c, "pp": p, "tp": t}
        seen.append(rank)
    assert sorted(seen) == list(range(axes.world_size))
    with pytest.raises(ValueError):
        axes.coords_of(axes.world_size)
    with pytest.raises(ValueError):
        axes.rank_of(tp=tp)


def test_the_reference_comparison_catches_another_axis_order(monkeypatch):
    """The negative control of the round trip: with CP and PP swapped in the order the formula differs."""
    import kuangchao_core.axes as axes_module

    axes = MeshAxes(dp=2, cp=2, pp=2, tp=2)
    assert axes.rank_of(cp=1) == _reference_rank(0, 1, 0, 0, 2, 2, 2) == 4
    monkeypatch.setattr(axes_module, "AXES", ("dp", "pp", "cp", "tp", "ep"))
    monkeypatch.setattr(axes_module, "GRID", ("dp", "pp", "cp", "tp"))  # the axes the rank formula reads
    assert axes.rank_of(cp=1) == 2 != _reference_rank(0, 1, 0, 0, 2, 2, 2)


@pytest.mark.parametrize("dp,cp,pp,tp", LAYOUTS)
def test_groups_partition_the_world_along_each_axis(dp, cp, pp, tp):
    axes = MeshAxes(dp=dp, cp=cp, pp=pp, tp=tp)
    for axis in GRID:  # the axes of the rank formula (an axis within another: tests/test_expert_parallel_mesh.py)
        groups = axes.groups(axis)
        assert len(groups) == axes.world_size // axes.sizes[axis]
        assert sorted(r for g in groups for r in g) == list(range(axes.world_size))  # disjoint and covering
        for g in groups:
            coords = [axes.coords_of(r) for r in g]
            assert [c[axis] for c in coords] == list(range(axes.sizes[axis]))  # in order along the axis
            assert all({k: v for k, v in c.items() if k != axis} == {k: v for k, v in coords[0].items() if k != axis}
                       for c in coords)  # fmt: skip
            for r in g:
                assert axes.group_of(axis, r) == g
        # construction order: the other axes' positions in AXES order, the outermost slowest
        firsts = [axes.coords_of(g[0]) for g in groups]
        keys = [tuple(c[a] for a in GRID if a != axis) for c in firsts]
        assert keys == sorted(keys)


def test_three_axis_layouts_keep_their_groups_names_and_build_order():
    from kuangchao_core.parallel.mesh import MeshLayout

    axes = MeshAxes(dp=2, pp=2, tp=2)
    assert axes.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axes.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axes.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axes.active() == ("tp", "pp", "dp")  # no cp groups at cp 1: the mesh builds what it always built
    assert axes.indexed_groups("dp")["dp2"] == [2, 6]
    assert list(axes.named_groups()) == [
        *("tp[0,1]", "tp[2,3]", "tp[4,5]", "tp[6,7]"),
        *("pp[0,2]", "pp[1,3]", "pp[4,6]", "pp[5,7]"),
        *("dp[0,4]", "dp[1,5]", "dp[2,6]", "dp[3,7]"),
    ]
    assert group_name("dp", [4, 0]) == "dp[0,4]"
    assert MeshLayout(dp=2, tp=2, pp=2).describe().keys() == {"sizes", "tp_groups", "pp_groups", "dp_groups"}


def test_a_cp_layout_builds_cp_groups_last_and_names_them():
    from kuangchao_core.parallel.mesh import MeshLayout
    from kuangchao_core.perm.layout import group_layout, groups_of_rank

    layout = MeshLayout(dp=2, tp=2, pp=1, cp=2)
    assert layout.kinds() == ("tp", "pp", "dp", "cp", "dp_cp")  # dp_cp: the replicas gradients are reduced over
    assert layout.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # inside dp: dp groups stride cp*pp*tp = 4
    assert layout.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]  # one per tp position, dp outermost
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    desc = layout.describe()
    assert desc["sizes"] == {"dp": 2, "tp": 2, "pp": 1, "cp": 2, "world_size": 8}
    assert desc["cp_groups"] == {"cp0": [0, 2], "cp1": [1, 3], "cp2": [4, 6], "cp3": [5, 7]}
    assert layout.coords_of(6) == {"dp": 1, "cp": 1, "pp": 0, "tp": 0}
    tokens = group_layout({"dp": 2, "tp": 2, "cp": 2})
    assert tokens["cp[4,6]"] == [4, 6] and groups_of_rank(tokens, 6) == [
        *("cp[4,6]", "dp[2,6]", "dp_cp[0,2,4,6]", "host", "pp[6]", "tp[6,7]", "world"),
    ]
    assert not any(
        n.startswith(("cp", "dp_cp")) for n in group_layout({"dp": 2, "tp": 2})
    )  # cp 1: none built or granted


def test_sizes_are_validated_by_field_path():
    with pytest.raises(PlanError) as info:
        validated({"dp": 1, "cp": 0, "pp": 1, "tp": 1})
    assert info.value.errors == [("parallel.context_parallel_size", "must be an integer >= 1, got 0")]
    with pytest.raises(PlanError, match=r"context_parallel_size 2 x .* = 8 processes, but the world size is 4"):
        validated({"dp": 2, "cp": 2, "pp": 1, "tp": 2}, world_size=4)
    cfg = {"task": {"name": "cp"}, "parallel": {"context_parallel_size": 0}}
    with pytest.raises(ConfigError) as info:
        config_from_dict(cfg)
    assert any(path == "parallel.context_parallel_size" for path, _ in info.value.errors)
    cfg["parallel"] = {"context_parallel_size": 2, "data_parallel_size": 3, "tensor_parallel_size": 2}
    par = config_from_dict(cfg).parallel
    assert par.world_size == 12 and MeshAxes.from_parallel(par) == MeshAxes(dp=3, cp=2, tp=2)


def test_placement_keeps_cp_inside_a_node_before_dp():
    from kuangchao_core.sched.rank_placement import mesh_order, place_ranks

    axes = MeshAxes(dp=2, cp=2)
    traffic = {"dp": 10.0, "cp": 1.0}  # DP moves more bytes, yet the CP ring stays on the node's links
    placed = place_ranks((2, 1, 1, 2), ["a", "b"], 2, traffic=traffic)
    node = placed.node_of_rank()
    assert all(len({node[r] for r in g}) == 1 for g in axes.groups("cp"))
    assert all(len({node[r] for r in g}) == 2 for g in axes.groups("dp"))
    # the control: by bytes alone (no CP-inside-DP rule) DP would take the node and every CP group cross
    by_bytes = axes.ranks_in_order(["cp", "pp", "tp", "dp"])
    assert mesh_order(axes, traffic) != by_bytes
    slot_node = {r: i // 2 for i, r in enumerate(by_bytes)}
    assert all(len({slot_node[r] for r in g}) == 2 for g in axes.groups("cp"))
    # TP, heavier still, stays innermost: a tp2 x cp2 x dp2 job on 4-slot nodes keeps TP and CP inside
    placed = place_ranks((2, 2, 1, 2), ["a", "b"], 4, traffic={"tp": 100.0, "dp": 10.0, "cp": 1.0})
    node = placed.node_of_rank()
    grid = MeshAxes(dp=2, cp=2, tp=2)
    assert all(len({node[r] for r in g}) == 1 for axis in ("tp", "cp") for g in grid.groups(axis))


def _cfg(cp: int, **parallel):
    return config_from_dict(
        {
            "task": {"name": "cp-plan"},
            "model": {"preset": "tiny", "num_layers": 2},
            "data": {"format": "synthetic", "seq_len": 32},
            "parallel": {"context_parallel_size": cp, "tensor_parallel_size": 2, **parallel},
        }
    )


def test_kc_plan_shows_cp_groups_and_refuses_only_what_cp_cannot_run_with(monkeypatch):
    from kuangchao_core.engine import plan as plan_module
    from kuangchao_core.engine.plan import check_plan, explain_plan, format_plan, raise_for_plan
    from kuangchao_core.engine.traffic import group_traffic

    cfg = _cfg(2)
    assert check_plan(cfg) == []  # a layout the planner can describe
    plan = explain_plan(cfg)
    assert plan["sizes"]["cp"] == 2 and plan["groups"]["cp_groups"] == {"cp0": [0, 2], "cp1": [1, 3]}
    assert plan["ranks"][3]["coords"] == {"dp": 0, "tp": 1, "pp": 0, "cp": 1}
    text = format_plan(plan)
    assert "CP groups: cp0=[0, 2]  cp1=[1, 3]" in text and "dp=1 x cp=2 x tp=2" in text
    assert group_traffic(cfg)["cp"] > 0 and "cp" not in group_traffic(_cfg(1))
    raise_for_plan(cfg, device_memory=2**40)  # the trainer runs cp2 (tests/test_engine_cp.py): not refused
    # what CP cannot run with is refused before launch, each by its field
    bad = config_from_dict(
        {
            "task": {"name": "cp-plan"},
            "model": {"preset": "tiny", "num_layers": 2},
            "data": {"format": "synthetic", "seq_len": 30},
            "parallel": {"context_parallel_size": 2, "tensor_parallel_size": 2},
            "train": {"compile": True},
        }
    )
    with pytest.raises(PlanError) as info:
        raise_for_plan(bad, device_memory=2**40)
    paths = dict(info.value.errors)
    assert set(paths) == {"data.seq_len", "train.compile"}, info.value.errors
    assert "divisible by 4" in paths["data.seq_len"]
    sp = _cfg(2, sequence_parallel=True, tensor_parallel_size=4, data_parallel_size=1)
    sp = sp.model_copy(update={"data": sp.data.model_copy(update={"seq_len": 12})})  # 6 positions per CP rank
    with pytest.raises(PlanError, match="each CP rank holds 6 positions"):
        raise_for_plan(sp, device_memory=2**40)
    monkeypatch.setattr(plan_module, "unbuilt_problems", lambda cfg: [])  # control: without the check it passes
    raise_for_plan(bad, device_memory=2**40)
    from kuangchao.cli.train import refuse_early  # kc train's check before any Prefect run starts

    cp2 = ["parallel.context_parallel_size=2", "parallel.data_parallel_size=1", "train.compile=true"]
    monkeypatch.undo()
    with pytest.raises(PlanError, match="train.compile with context_parallel_size 2"):
        refuse_early(str(ROOT / "configs" / "tiny.yaml"), cp2, None, "skip")
    from kuangchao.cli.main import app

    res = CliRunner().invoke(
        app,
        [
            "plan",
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            *("--set", "parallel.context_parallel_size=2", "--set", "cluster.nproc_per_node=4"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "CP groups: cp0=[0, 1]" in res.output and "kc train would refuse this plan" not in res.output


# --- one rank formula: a scan of the source -------------------------------------------------------------------

#: the grid's sizes as code names them, each with its axis
_AXIS_OF = {"dp": "dp", "cp": "cp", "pp": "pp", "tp": "tp", **{key: axis for axis, key in SIZE_KEYS.items()}}
#: a coordinate along one axis (``cp_rank``, ``tp_idx``): arithmetic inside one axis (a ring's next member) is fine
_COORD = re.compile(r"^(dp|cp|pp|tp)_(rank|idx|index|i)$")


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _global_rank_in(node: ast.AST) -> bool:
    """Whether ``node`` reads a global rank (a name with ``rank`` in it that is not one axis's coordinate)."""
    names = (_name(n) for n in ast.walk(node))
    return any(n and "rank" in n.lower() and not _COORD.match(n) for n in names)


def _size_axes(node: ast.AST) -> set[str] | None:
    """The axes of ``tp``, ``self.pp``, ``par.tensor_parallel_size``, ``(pp * tp)`` (a grid size or a product of
    sizes); None for anything else."""
    if _name(node) in _AXIS_OF:
        return {_AXIS_OF[_name(node)]}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        left, right = (_size_axes(x) if not isinstance(x, ast.Constant) else set() for x in (node.left, node.right))
        return None if left is None or right is None or not left | right else left | right
    return None


def _factors(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return [*_factors(node.left), *_factors(node.right)]
    return [node]


def _terms(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [*_terms(node.left), *_terms(node.right)]
    return [node]


def _is_stride_sum(node: ast.AST) -> bool:
    """``d * (pp * tp) + p * tp + t``, ``dp_rank * cp + cp_rank``: a sum of coordinates scaled by the sizes of other
    axes (strides of two or more axes, or one axis's coordinate times another axis's size)."""
    strides: set[str] = set()
    crossed = False
    scaled = []
    for term in _terms(node):
        factors = _factors(term)
        sizes = [axes for f in factors if (axes := _size_axes(f)) is not None]
        if len(factors) < 2 or not sizes:
            continue
        scaled.append(term)
        strides |= set().union(*sizes)
        coords = {m.group(1) for f in factors if (m := _COORD.match(_name(f) or ""))}
        crossed = crossed or bool(coords - set().union(*sizes))
    rest = [t for t in _terms(node) if t not in scaled and not isinstance(t, ast.Constant)]
    return bool(scaled and rest) and (len(strides) >= 2 or crossed)


def rank_formulas(source: str) -> list[str]:
    """Expressions of ``source`` that map ranks to mesh coordinates or back: a global rank divided by grid sizes
    (``rank // (pp * tp)``, ``rank % tp``, ``divmod(rank, tp)``) or coordinates scaled by grid sizes and summed
    (:func:`_is_stride_sum`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv | ast.Mod):
            hit = _global_rank_in(node.left) and _size_axes(node.right) is not None
        elif isinstance(node, ast.Call) and _name(node.func) == "divmod" and len(node.args) == 2:
            hit = _global_rank_in(node.args[0]) and _size_axes(node.args[1]) is not None
        else:
            hit = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and _is_stride_sum(node)
        if hit:
            found.append(ast.unparse(node))
    return found


def test_only_the_axes_module_maps_ranks_to_coordinates():
    found = {
        str(f.relative_to(ROOT)): hits
        for f in sorted(CORE.rglob("*.py"))
        if (hits := rank_formulas(f.read_text(encoding="utf-8")))
    }
    assert set(found) <= {"kuangchao_core/axes.py"}, found


def test_the_scan_finds_a_duplicated_rank_formula():
    """The negative control: the formulas ``parallel/mesh.py``, ``sched/rank_placement.py`` and
    ``sched/perf_groups.py`` held before issue 30, and new ones a CP change could add, are each found."""
    duplicated = [
        "def rank_of(dp_idx, pp_idx, tp_idx, tp, pp):\n    return dp_idx * (pp * tp) + pp_idx * tp + tp_idx",
        "def coords_of(rank, tp, pp):\n    return rank // (pp * tp), rank % tp, (rank // tp) % pp",
        "def _mesh_rank(dp_i, pp_i, tp_i, tp, pp):\n    return dp_i * (pp * tp) + pp_i * tp + tp_i",
        "def rank(d, p, t):\n    return d * tp * pp + p * tp + t",
        "cp_rank = (self.rank // (self.pp * self.tp)) % self.cp",
        "rest, tp_rank = divmod(rank, par.tensor_parallel_size)",
        "replica = dp_rank * cp + cp_rank",
        "rank = (d * cp + c) * pp * tp + t",
    ]
    for source in duplicated:
        assert rank_formulas(source), source
    # and what the code legitimately does with the same names is not a rank formula
    clean = [
        "if model.num_heads % tp:\n    pass",
        "flops = 2 * h * (heads // tp) * d + 2 * h * kv_local * d",
        "node = slot // self.nproc",
        "chunk = m * self.dp_size + self.dp_rank",
        "world = dp * tp * pp",
        "peer = (cp_rank + 1) % cp",  # a ring's next member: arithmetic inside one axis
        "chunk = j * cp + cp_rank",
        "start = tp_rank * (seq // tp)",
    ]
    assert [s for s in clean if rank_formulas(s)] == []


def test_kc_plan_counts_a_cp_rank_s_share_of_the_activations_and_zero_state():
    """A CP rank holds s/cp tokens of each sequence (activations halve at cp2) and ZeRO shards over dp×cp; the
    control: dp2 on as many ranks keeps every rank's activations (each holds whole sequences)."""
    from kuangchao_core.engine.memory_model import estimate_ranks

    def rank0(cp: int, dp: int = 1) -> dict:
        return estimate_ranks(_cfg(cp, data_parallel_size=dp, zero_stage=1), [0])[0]["memory_bytes"]

    one, cp2, dp2 = rank0(1), rank0(2), rank0(1, dp=2)
    assert cp2["activations_estimate"] == one["activations_estimate"] / 2
    assert cp2["optimizer"] == dp2["optimizer"] == one["optimizer"] / 2
    assert dp2["activations_estimate"] == one["activations_estimate"]


def test_traffic_counts_the_gradient_reduction_over_dp_cp_and_s_over_cp_tokens():
    """At cp2 the gradients are all-reduced over the dp×cp replicas (as many bytes per member as dp2 moves) and TP
    moves the activations of s/2 tokens; control: one replica reduces nothing."""
    from kuangchao_core.engine.traffic import _bytes_of, group_traffic

    one, cp2, dp2 = group_traffic(_cfg(1)), group_traffic(_cfg(2)), group_traffic(_cfg(1, data_parallel_size=2))
    assert one["dp"] == 0 and cp2["dp"] == dp2["dp"] > 0
    assert cp2["tp"] == one["tp"] / 2 == dp2["tp"] / 2
    assert _bytes_of(cp2, "dp_cp", 2) == cp2["dp"] and _bytes_of(cp2, "dp", 2) == 0  # on the dp_cp groups
    assert _bytes_of(dp2, "dp", 1) == dp2["dp"]
