"""The parallel mesh (SPEC L3.4): TP innermost, then PP, then DP; sizes validated with every number shown."""

from __future__ import annotations

import pytest
import torch

from tests.mp import run_distributed


def test_layout_dp2_tp2_pp2():
    from kuangchao_core.parallel.mesh import mesh_layout

    layout = mesh_layout({"dp": 2, "tp": 2, "pp": 2}, world_size=8)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    desc = layout.describe()
    assert desc["tp_groups"]["tp3"] == [6, 7]
    assert desc["pp_groups"]["pp1"] == [1, 3]
    assert desc["dp_groups"]["dp2"] == [2, 6]
    assert desc["sizes"] == {"dp": 2, "tp": 2, "pp": 2, "world_size": 8}
    for rank in range(8):
        assert layout.rank_of(layout.coords_of(rank)) == rank
    # every rank in exactly one group of each kind
    for groups in (layout.groups("tp"), layout.groups("pp"), layout.groups("dp")):
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_layout_tp_is_innermost_for_uneven_sizes():
    from kuangchao_core.parallel.mesh import mesh_layout

    layout = mesh_layout({"dp": 1, "tp": 4, "pp": 2})
    assert layout.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("dp") == [[r] for r in range(8)]


def test_bad_sizes_refused_with_every_number():
    from kuangchao_core.errors import PlanError
    from kuangchao_core.parallel.mesh import mesh_layout

    with pytest.raises(PlanError) as info:
        mesh_layout({"dp": 2, "tp": 3, "pp": 2}, world_size=8)
    text = str(info.value)
    for needle in ("data_parallel_size 2", "tensor_parallel_size 3", "pipeline_parallel_size 2", "= 12", "8"):
        assert needle in text
    with pytest.raises(PlanError, match="tensor_parallel_size.*got 0"):
        mesh_layout({"dp": 1, "tp": 0, "pp": 1})


def _mesh_body(rank, world_size):
    from kuangchao_core.comm import primitives as comm
    from kuangchao_core.comm.registry import all_groups
    from kuangchao_core.parallel.mesh import ParallelMesh
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    install_guard(AllowAll())
    mesh = ParallelMesh.from_config(
        {
            "data_parallel_size": 2,
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 1,
            "backend": "gloo",
            "timeout_ms": 60_000,
        }
    )
    sums = {}
    for kind, group in (("tp", mesh.tp_group), ("pp", mesh.pp_group), ("dp", mesh.dp_group)):
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, group=group)
        sums[kind] = t.item()
    names = [g.name for g in all_groups() if g.name != "world"]
    return {
        "coords": mesh.coords,
        "tp": mesh.tp_group.ranks,
        "dp": mesh.dp_group.ranks,
        "pp": mesh.pp_group.ranks,
        "sums": sums,
        "names": names,
        "mine": mesh.describe()["mine"],
    }


def test_mesh_builds_groups_on_four_processes():
    results = run_distributed(_mesh_body, 4)
    for rank, res in enumerate(results):
        dp_idx, tp_idx = rank // 2, rank % 2
        assert res["coords"] == {"dp": dp_idx, "cp": 0, "pp": 0, "tp": tp_idx}
        assert res["tp"] == [dp_idx * 2, dp_idx * 2 + 1]
        assert res["dp"] == [tp_idx, tp_idx + 2]
        assert res["pp"] == [rank]
        # the collective really ran over the named group's members
        assert res["sums"] == {"tp": float(sum(res["tp"])), "pp": float(rank), "dp": float(sum(res["dp"]))}
        # canonical names (kind + sorted ranks), the ones capability tokens list
        assert res["names"] == ["tp[0,1]", "tp[2,3]", "pp[0]", "pp[1]", "pp[2]", "pp[3]", "dp[0,2]", "dp[1,3]"]
        assert res["mine"] == {
            "tp": f"tp{res['tp']}".replace(" ", ""),
            "pp": f"pp[{rank}]",
            "dp": f"dp{res['dp']}".replace(" ", ""),
        }


def _mismatch_body(rank, world_size):
    from kuangchao_core.errors import PlanError
    from kuangchao_core.parallel.mesh import ParallelMesh

    try:
        ParallelMesh(dp=1, tp=4, pp=1)
    except PlanError as exc:
        return str(exc)
    return None


def test_mesh_refuses_world_size_mismatch():
    for text in run_distributed(_mismatch_body, 2):
        assert text is not None and "tensor_parallel_size 4" in text and "world size is 2" in text


def test_token_group_layout_matches_the_mesh():
    from kuangchao_core.parallel.mesh import mesh_layout
    from kuangchao_core.perm.layout import group_layout, group_name

    for dp, tp, pp in [(2, 2, 2), (1, 4, 2), (2, 1, 4), (4, 2, 1)]:
        layout = mesh_layout({"dp": dp, "tp": tp, "pp": pp})
        expected = {"world": list(range(dp * tp * pp)), "host": list(range(dp * tp * pp))}
        for kind, groups in (("tp", layout.groups("tp")), ("pp", layout.groups("pp")), ("dp", layout.groups("dp"))):
            expected.update({group_name(kind, g): sorted(g) for g in groups})
        assert {k: sorted(v) for k, v in group_layout(layout.sizes).items()} == expected


def _cp_mesh_body(rank, world_size):
    from kuangchao_core.comm import primitives as comm
    from kuangchao_core.comm.registry import all_groups
    from kuangchao_core.parallel.mesh import ParallelMesh
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    install_guard(AllowAll())
    sizes = {"context_parallel_size": 2, "tensor_parallel_size": 2, "backend": "gloo", "timeout_ms": 60_000}
    mesh = ParallelMesh.from_config(sizes)
    t = torch.tensor([float(rank)])
    comm.all_reduce(t, group=mesh.cp_group)
    names = [g.name for g in all_groups() if g.name != "world"]
    return {
        "cp_rank": mesh.cp_rank,
        "cp": mesh.cp_group.ranks,
        "sum": t.item(),
        "names": names,
        "mine": mesh.describe()["mine"],
    }


def test_mesh_builds_cp_groups_after_the_others():
    """Issue 30: dp1 x cp2 x tp2 — CP groups join ranks one TP group apart, built last on every rank."""
    for rank, res in enumerate(run_distributed(_cp_mesh_body, 4)):
        cp_idx, tp_idx = rank // 2, rank % 2  # rank = cp_idx * tp + tp_idx
        assert res["cp_rank"] == cp_idx and res["cp"] == [tp_idx, tp_idx + 2]
        assert res["sum"] == float(2 * tp_idx + 2)  # the all-reduce ran over exactly the CP group
        assert res["names"] == [
            *("tp[0,1]", "tp[2,3]", "pp[0]", "pp[1]", "pp[2]", "pp[3]"),
            *("dp[0]", "dp[1]", "dp[2]", "dp[3]", "cp[0,2]", "cp[1,3]", "dp_cp[0,2]", "dp_cp[1,3]"),
        ]
        assert res["mine"]["cp"] == f"cp[{tp_idx},{tp_idx + 2}]"
