"""Topology-aware placement (issue 11): which nodes a job gets, and which mesh rank plays each slot.

Pure functions on synthetic probe matrices; the multi-host test (``tests/test_cluster.py``) runs them on real
hosts. Every rule has its negative control (blind placement, another priority, another matrix).
"""

from __future__ import annotations

import json

import pytest

from kuangchao_core.config import config_from_dict
from kuangchao_core.engine.traffic import group_traffic, link_report
from kuangchao_core.parallel.mesh import MeshLayout
from kuangchao_core.sched.device_topology import device_chain, parse_topo_matrix
from kuangchao_core.sched.nodes import NodeFacts, NodeStatus
from kuangchao_core.sched.placement import pick_dynamic
from kuangchao_core.sched.rank_placement import (
    RankPlacement,
    apply_rank_map,
    chain_order,
    mesh_order,
    node_of_rank_from_env,
    place_ranks,
)
from kuangchao_core.sched.topology import TopologyReport


def _cfg(dp=2, tp=2, pp=1, **model):
    return config_from_dict(
        {
            "task": {"name": "placement"},
            "model": {"preset": "tiny", "num_layers": 2, **model},
            "data": {"format": "synthetic", "seq_len": 32},
            "parallel": {"data_parallel_size": dp, "tensor_parallel_size": tp, "pipeline_parallel_size": pp},
        }
    )


def _groups_inside(placement: RankPlacement, groups: list[list[int]]) -> list[bool]:
    node = placement.node_of_rank()
    return [len({node[r] for r in g}) == 1 for g in groups]


def test_traffic_formulas_follow_the_model_and_layout():
    cfg = _cfg(dp=2, tp=2)
    t = group_traffic(cfg)
    h, layers, b, s = 64, 2, cfg.parallel.micro_batch_size, 32
    act = b * s * h * 4
    assert t["tp"] == pytest.approx(4 * layers * 1 * act * 2 * (2 - 1) / 2)
    assert t["pp"] == 0.0  # no pipeline
    assert t["dp"] > 0 and group_traffic(_cfg(dp=1, tp=4))["dp"] == 0.0


def test_tp_groups_stay_inside_a_node_and_blind_placement_splits_them():
    cfg = _cfg(dp=2, tp=2)
    layout = MeshLayout(dp=2, tp=2)
    aware = place_ranks((2, 2, 1), ["a", "b"], 2, traffic=group_traffic(cfg))
    blind = place_ranks((2, 2, 1), ["a", "b"], 2, mode="blind")
    assert all(_groups_inside(aware, layout.groups("tp")))
    assert not any(_groups_inside(blind, layout.groups("tp")))  # the control: dealt out, every TP group crosses
    report = {row["node"]: row for row in link_report(aware, cfg)}
    assert report["a"]["bytes_per_step_inside"] > 0 and report["a"]["ranks"] == [0, 1]


def test_the_heaviest_group_kind_goes_innermost_whatever_its_name():
    # DP moves more than TP here (many parameters, tiny activations): DP groups must stay inside the nodes
    assert mesh_order(MeshLayout(dp=2, tp=2), {"tp": 1.0, "pp": 0.0, "dp": 10.0}) == [0, 2, 1, 3]
    placed = place_ranks((2, 2, 1), ["a", "b"], 2, traffic={"tp": 1.0, "dp": 10.0})
    assert all(_groups_inside(placed, MeshLayout(dp=2, tp=2).groups("dp")))
    assert not any(_groups_inside(placed, MeshLayout(dp=2, tp=2).groups("tp")))
    # and with TP heavier, the default mesh order
    assert mesh_order(MeshLayout(dp=2, tp=2), {"tp": 10.0, "dp": 1.0}) == [0, 1, 2, 3]


def test_nodes_are_chained_over_the_best_links():
    bw = [[None, 1.0, 9.0], [1.0, None, 8.0], [9.0, 8.0, None]]
    assert chain_order(3, bw, None) == [0, 2, 1]
    # pp2 x dp... a 3-node chain: PP neighbours land on the 9 GB/s and 8 GB/s links, never on the 1 GB/s one
    assert chain_order(3, [[None, 9.0, 1.0], [9.0, None, 8.0], [1.0, 8.0, None]], None) == [0, 1, 2]


def test_rank_map_renames_the_worker_and_is_checked():
    placed = place_ranks((2, 2, 1), ["a", "b"], 2, mode="blind")
    env = {"RANK": "1", **placed.env()}
    assert apply_rank_map(env) == placed.rank_of_slot[1] == 2
    assert env["RANK"] == "2" and env["KC_TORCH_RANK"] == "1"
    assert apply_rank_map(env) == 2  # applied once
    assert node_of_rank_from_env(4, env) == placed.node_of_rank() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="permutation"):
        apply_rank_map({"RANK": "0", "KC_RANK_MAP": json.dumps([0, 0, 1, 2])})
    assert RankPlacement.from_dict(placed.to_dict()) == placed


def _node(name: str) -> NodeStatus:
    return NodeStatus(NodeFacts(name=name, address=f"10.0.0.{ord(name[-1])}", cpu_count=2), True)


def _report(names: list[str], bw: list[list[float]], lat: list[list[float]] | None = None) -> TopologyReport:
    n = len(names)
    lat = lat or [[10.0] * n for _ in range(n)]
    return TopologyReport(
        world_size=n,
        node_of_rank=names,
        backend="gloo",
        sizes=(8, 1 << 20),
        iters=1,
        allreduce_latency_us=1.0,
        allreduce_algbw_gbps=1.0,
        allreduce_busbw_gbps=1.0,
        p2p_latency_us=lat,
        p2p_bandwidth_gbps=bw,
        nodes=names,
        node_latency_us=lat,
        node_bandwidth_gbps=bw,
    )


def test_dynamic_choice_takes_the_best_connected_pair_then_load_then_priority():
    live = [_node("n1"), _node("n2"), _node("n3")]
    # n2-n3 is the fast pair (10 GB/s); n1 reaches both at 1 GB/s
    fast = _report(["n1", "n2", "n3"], [[20, 1, 1], [1, 20, 10], [1, 10, 20]])
    assert [n.name for n in pick_dynamic(live, 2, fast)] == ["n2", "n3"]
    assert [n.name for n in pick_dynamic(live, 2, None)] == ["n1", "n2"]  # control: no matrix, by name
    # all links equal within the probe's noise: the least loaded pair wins
    # (latencies of 250 vs 150 us are the probe's scheduling noise on a busy machine, not another link class)
    lat = [[100, 250, 150], [250, 100, 180], [150, 180, 100]]
    even = _report(["n1", "n2", "n3"], [[20, 10, 11], [10, 20, 10.5], [11, 10.5, 20]], lat)
    assert [n.name for n in pick_dynamic(live, 2, even)] == ["n1", "n2"]
    assert [n.name for n in pick_dynamic(live, 2, even, loads={"n1": 2})] == ["n2", "n3"]
    # priority: high takes the fast pair even when it is busy; low avoids the busy nodes
    assert [n.name for n in pick_dynamic(live, 2, fast, loads={"n2": 1}, priority="high")] == ["n2", "n3"]
    assert [n.name for n in pick_dynamic(live, 2, fast, loads={"n2": 1}, priority="low")] == ["n1", "n3"]
    # a latency of another class (20x) does decide between equal bandwidths
    far = _report(
        ["n1", "n2", "n3"], [[20, 10, 10], [10, 20, 10], [10, 10, 20]], [[1, 200, 10], [200, 1, 200], [10, 200, 1]]
    )
    assert [n.name for n in pick_dynamic(live, 2, far)] == ["n1", "n3"]


NVSMI = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity
GPU0     X      SYS     NV12    SYS     0-31            0
GPU1    SYS      X      SYS     NV12    0-31            0
GPU2    NV12    SYS      X      SYS     0-31            0
GPU3    SYS     NV12    SYS      X      0-31            0

Legend:
  X    = Self
"""


def test_nvlink_pairs_from_nvidia_smi_become_consecutive_slots():
    parsed = parse_topo_matrix(NVSMI)
    assert parsed["gpus"] == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert parsed["nvlink_pairs"] == [[0, 2, 12], [1, 3, 12]]
    chain = device_chain(parsed["links"], 4)
    assert chain[:2] == [0, 2]  # the NVLink pair first
    placed = place_ranks((2, 2, 1), ["a"] * 1, 4, traffic={"tp": 10.0, "dp": 1.0}, device_chain=chain)
    local = placed.local_of_rank()
    assert {local[0], local[1]} == {0, 2}  # TP group [0, 1] on the NVLink pair GPU0-GPU2
    assert device_chain([], 4) == [0, 1, 2, 3]  # a CPU node: slot order


def test_kc_plan_prints_the_placement_of_a_described_cluster_and_topology_show_the_kept_probe(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kuangchao.cli.main import app
    from kuangchao_core.sched.topology import remember_report

    monkeypatch.setenv("KC_CACHE_DIR", str(tmp_path))
    runner = CliRunner()
    tiny = "configs/tiny.yaml"
    sets = ["--set", "parallel.data_parallel_size=2", "--set", "parallel.tensor_parallel_size=2"]
    out = runner.invoke(app, ["plan", "--config", tiny, *sets, "--nodes", "2", "--gpus-per-node", "2", "--json"])
    assert out.exit_code == 0, out.output
    placed = json.loads(out.output)["placement"]
    groups = {g: v for row in placed["links"] for g, v in row["groups"].items()}
    assert groups["tp[0,1]"]["crosses_nodes"] is False and placed["measured"] is False
    assert runner.invoke(app, ["plan", "--config", tiny, "--nodes", "0"]).exit_code == 2

    assert runner.invoke(app, ["topology", "show"]).exit_code == 1  # nothing measured yet
    report = _report(["node0", "node1"], [[5.0, 0.05], [0.05, 5.0]])
    remember_report(report, "f" * 64)
    shown = runner.invoke(app, ["topology", "show"])
    assert shown.exit_code == 0 and "node bandwidth" in shown.output and "ffffffff" in shown.output
    assert json.loads(runner.invoke(app, ["topology", "show", "--json"]).output)["nodes"] == ["node0", "node1"]
    # with a kept probe of the described nodes, kc plan places from the measured links
    out = runner.invoke(app, ["plan", "--config", tiny, *sets, "--nodes", "2", "--gpus-per-node", "2", "--json"])
    assert json.loads(out.output)["placement"]["measured"] is True
