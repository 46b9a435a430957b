"""Issue 32 §5: node facts and the tree topology parsed from ``scontrol``'s own output — lines captured from the test
cluster (Slurm 22.05, ``tests/data/slurm/``) and GPU node lines in the same format (typed ``Gres`` such as
``gpu:h100:8(S:0-1)``, drained, down and allocated nodes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kuangchao_core.sched.slurm import facts as F

DATA = Path(__file__).resolve().parent / "data" / "slurm"


def _nodes(name: str, topology: F.Topology | None = None) -> list[F.NodeFacts]:
    topo = topology or F.Topology()
    lines = (DATA / name).read_text().splitlines()
    return [F.parse_node(line, topo.switch_of(line.split()[0].split("=")[1])) for line in lines if line.strip()]


def test_the_labs_nodes_and_tree_topology_as_scontrol_printed_them():
    topo = F.parse_topology((DATA / "show_topology_lab.txt").read_text())
    assert topo.leaves == {"s1": ["n1", "n2"], "s2": ["n3"]}  # the spine s0 (Level=1) is not a leaf
    assert topo.parents == {"s1": "s0", "s2": "s0"}
    nodes = _nodes("show_node_lab.txt", topo)
    assert [(n.name, n.addr, n.cpus, n.gpus, n.memory_mb, n.state, n.switch) for n in nodes] == [
        ("n1", "198.18.73.11", 2, 0, 1000, "IDLE", "s1"),
        ("n2", "198.18.73.12", 2, 0, 1000, "IDLE", "s1"),
        ("n3", "198.18.73.13", 2, 0, 1000, "IDLE", "s2"),
    ]
    assert all(n.idle and n.partitions == ("debug",) and n.features == () and n.reason is None for n in nodes)
    assert F.summary(nodes) == "3 of 3 nodes idle: 3 with 2 CPUs, 0 GPUs"
    assert F.switch_fit(nodes, 2, 1) == (True, ["s1"])
    assert F.switch_fit(nodes, 3, 1) == (False, ["s1"])
    assert F.switch_fit(nodes, 3, 2) == (True, ["s1", "s2"])

    (drained,) = _nodes("show_node_lab_drained.txt", topo)
    assert drained.state == "IDLE+DRAIN" and drained.base_state == "IDLE" and drained.flags == {"DRAIN"}
    assert not drained.idle and drained.reason == "busy_test [root@2026-12-03T12:07:00]"
    after = [drained, *nodes[1:]]
    assert F.summary(after) == "2 of 3 nodes idle: 2 with 2 CPUs, 0 GPUs; 1 IDLE+DRAIN"
    assert F.idle_by_switch(after) == {"s1": ["n2"], "s2": ["n3"]}
    assert F.switch_fit(after, 2, 1) == (False, ["s1"])  # two idle nodes, but under two leaf switches


def test_gpu_nodes_typed_and_untyped_gres_and_states():
    a01, a02, b01, c01 = _nodes("show_node_gpu_synthetic.txt")
    assert (a01.cpus, a01.cpus_alloc, a01.gpus, a01.gpus_alloc, a01.gpu_types) == (192, 16, 8, 2, ("h100",))
    assert (a01.state, a01.idle, a01.features, a01.partitions) == ("MIXED", False, ("h100", "ib", "nvlink"),
                                                                   ("gpu", "gpu-long"))  # fmt: skip
    assert a01.memory_mb == 2048000 and a01.addr == "10.20.1.1" and a01.switch is None
    # two gres entries of one type (one per socket) add up; the NIC is not a GPU
    assert (a02.gpus, a02.gpu_types, a02.state, a02.idle) == (8, ("nvidia_h100_80gb_hbm3",), "IDLE+DRAIN", False)
    assert a02.reason == "ECC errors on GPU 3 [admin@2026-12-02T17:00:00]"
    assert (b01.gpus, b01.gpu_types, b01.base_state, b01.idle) == (8, (), "DOWN", False)
    assert "NOT_RESPONDING" in b01.flags and b01.addr == "gpu-b01"
    assert (c01.gpus, c01.state, c01.idle, c01.cpus_alloc) == (0, "ALLOCATED", False, 64)
    assert (
        F.summary([a01, a02, b01, c01])
        == "0 of 4 nodes idle; 1 ALLOCATED, 1 DOWN+NOT_RESPONDING, 1 IDLE+DRAIN, 1 MIXED"
    )
    assert a01.line() == "gpu-a01 (10.20.1.1): MIXED, 192 CPUs, 8 GPUs (h100), 2048000 MB, features h100,ib,nvlink"
    doc = json.loads(json.dumps(a02.to_dict()))
    assert doc["gpus"] == 8 and doc["idle"] is False and doc["features"] == ["h100", "ib"]


@pytest.mark.parametrize(
    "gres, expected",
    [
        ("(null)", (0, ())),
        ("gpu:8", (8, ())),
        ("gpu:h100:8(S:0-1)", (8, ("h100",))),
        ("gpu:h100:8(S:0,1)", (8, ("h100",))),  # the comma inside the socket list is not an item's end
        ("gpu:a100:4,gpu:v100:2,nic:1", (6, ("a100", "v100"))),
        ("gpu:h100:8(IDX:0-7),shard:h100:64", (8, ("h100",))),
        ("mps:100", (0, ())),
        ("gpu", (1, ())),
    ],
)
def test_gres_strings(gres, expected):
    assert F.parse_gres(gres) == expected


def test_state_marks_and_flags():
    def node(state: str) -> F.NodeFacts:
        return F.NodeFacts("x", "x", 1, state=state)

    assert node("IDLE").idle and node("IDLE+PLANNED").idle
    assert not node("IDLE*").idle and node("IDLE*").flags == {"NOT_RESPONDING"}
    assert not node("IDLE+POWERED_DOWN").idle and not node("MIXED").idle and not node("DOWN").idle
    assert node("ALLOCATED+DRAIN").base_state == "ALLOCATED"


def test_host_list_expressions():
    assert F.expand_hostlist("n[1-3,7]") == ["n1", "n2", "n3", "n7"]
    assert F.expand_hostlist("n1,n2") == ["n1", "n2"]
    assert F.expand_hostlist("gpu[01-03]-a,login") == ["gpu01-a", "gpu02-a", "gpu03-a", "login"]
    assert F.expand_hostlist("r[1-2]n[08-10]") == ["r1n08", "r1n09", "r1n10", "r2n08", "r2n09", "r2n10"]
    assert F.expand_hostlist("") == []


def test_a_line_that_is_no_node_record_is_refused_by_name():
    with pytest.raises(F.SlurmRefused, match="not a node record"):
        F.parse_node("No nodes in the system")
    assert F.parse_topology("No topology information available\n") == F.Topology()
