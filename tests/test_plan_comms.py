"""``kc plan``'s communicators (``engine.plan_comms``) against the groups the engine really builds.

Four Gloo ranks build the mesh as the worker does (``ParallelMesh.from_config``, and the vision tower's
``encoder_layout``); each rank reports every group it is a member of, by name, with its ranks and whether it runs
on the world's process group. The plan must list exactly those for that rank, for dp2×tp2, pp2×tp2, dp4 with the
hierarchical all-reduce over two nodes, and a vision tower split in two inside a TP group of four. Control: the
plan of the hierarchical layout computed without the hierarchy (a listing that forgot the subgroups) is refused
by the same comparison. The estimate's arithmetic is checked against NCCL's default buffer sizes.
"""

from __future__ import annotations

import pytest

from kuangchao_core.config import config_from_dict
from kuangchao_core.engine.plan_comms import MIB, communicators, nccl_estimate
from tests.mp import run_distributed

HIER_NODES = [0, 0, 1, 1]
LAYOUTS = {
    "dp2_tp2": ({"data_parallel_size": 2, "tensor_parallel_size": 2}, None, None),
    "pp2_tp2": ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, None, None),
    "dp4_hierarchical": ({"data_parallel_size": 4, "hierarchical_allreduce": "auto"}, HIER_NODES, None),
    "tp4_vision_tp2": ({"tensor_parallel_size": 4}, None, {"parallel": "tp", "tensor_parallel_size": 2}),
}


def _cfg(parallel: dict, vision: dict | None):
    model = {"preset": "tiny", "num_heads": 4, "num_kv_heads": 4}
    if vision is not None:
        model["vision"] = vision
    return config_from_dict(
        {
            "task": {"name": "comms"},
            "model": model,
            "data": {"format": "synthetic", "seq_len": 32},
            # the worker's world and mesh share parallel.timeout_ms; tests/mp.py's world has 120 s
            "parallel": {"micro_batch_size": 1, "backend": "gloo", "timeout_ms": 120_000, **parallel},
            "train": {"device": "cpu"},
            "cluster": {"nproc_per_node": 4},
        }
    )


def _built(rank: int, world_size: int, parallel: dict, nodes, vision: dict | None) -> list[tuple]:
    from kuangchao_core import guard_api
    from kuangchao_core.comm import init_distributed, registry, world_group
    from kuangchao_core.comm.group import host_group
    from kuangchao_core.engine.vlm_layout import encoder_layout
    from kuangchao_core.parallel.mesh import ParallelMesh

    guard_api.install_guard(guard_api.AllowAll())
    init_distributed("gloo")
    cfg = _cfg(parallel, vision)
    world, host = world_group(), host_group()
    mesh = ParallelMesh.from_config(cfg.parallel, rank, world_size, node_of_rank=nodes)
    if vision is not None:
        encoder_layout(cfg.model.vision, mesh)
    out = []
    for g in registry.all_groups():
        if g.is_member:
            shares = g is not world and g.pg is world.pg
            out.append((g.name, tuple(g.ranks), shares))
    assert host.pg is world.pg  # a Gloo job's host group is the world's
    return sorted(out)


def _planned(cfg, nodes, rank: int) -> list[tuple]:
    entries = communicators(cfg, node_of_rank=nodes)["ranks"][rank]["communicators"]
    return sorted((c["name"], tuple(c["ranks"]), c["communicator"] == "world's") for c in entries)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_plan_lists_the_groups_each_rank_builds(layout):
    parallel, nodes, vision = LAYOUTS[layout]
    built = run_distributed(_built, world_size=4, args=(parallel, nodes, vision))
    cfg = _cfg(parallel, vision)
    for rank in range(4):
        assert [list(x[:2]) for x in built[rank]] == [list(x[:2]) for x in _planned(cfg, nodes, rank)], rank
        assert built[rank] == _planned(cfg, nodes, rank), rank
    names = {name for name, _, _ in built[0]}
    if layout == "dp4_hierarchical":
        assert {"dpn[0,1]", "dpx[0,2]"} <= names and ("dp[0,1,2,3]", (0, 1, 2, 3), True) in built[0]
        # control: the same layout listed without its hierarchy misses the subgroups the engine built
        flat = _cfg({**parallel, "hierarchical_allreduce": "off"}, vision)
        assert built[0] != _planned(flat, nodes, 0)
    if layout == "tp4_vision_tp2":
        assert {"vtp[0,1]", "vshare[0,2]", "tp[0,1,2,3]"} <= names


def test_nccl_bytes_follow_the_estimate_for_each_own_communicator():
    cfg = _cfg({"data_parallel_size": 2, "tensor_parallel_size": 2}, None).model_copy(deep=True)
    cfg.parallel.backend = "nccl"
    est = nccl_estimate({})
    # NCCL's defaults: SIMPLE 4 MiB, LL 8·512·8·16 B = 512 KiB, LL128 120·640·8·8 B = 4.6875 MiB per connection
    assert est["buffer_bytes"] == {"simple": 4 * MIB, "ll": 512 * 1024, "ll128": 4915200}
    assert est["per_communicator_bytes"] == 16 * 2 * (4 * MIB + 512 * 1024 + 4915200)
    comms = communicators(cfg, env={})
    r0 = comms["ranks"][0]
    own = [c["name"] for c in r0["communicators"] if c["nccl_bytes"]]
    assert own == ["world", "tp[0,1]", "dp[0,2]"]  # pp[0] has one rank, the host group is Gloo
    assert r0["nccl_bytes"] == 3 * est["per_communicator_bytes"]
    smaller = communicators(cfg, env={"NCCL_BUFFSIZE": str(MIB), "NCCL_MAX_NCHANNELS": "4"})
    assert smaller["estimate"]["per_communicator_bytes"] == 4 * 2 * (MIB + 512 * 1024 + 4915200)
