"""Which nodes run an attempt (static, dynamic, nodes lost earlier left out) and in which rank order."""

from __future__ import annotations

import pytest

from kuangchao_core.config import config_from_dict
from kuangchao_core.sched.nodes import NodeFacts, NodeStatus, facts_variable, worker_name
from kuangchao_core.sched.placement import NodeUnavailable, choose_nodes, cluster_pool


def _node(name: str, address: str, live: bool = True, cpus: int = 2) -> NodeStatus:
    return NodeStatus(NodeFacts(name=name, address=address, ifname="eth0", cpu_count=cpus), live)


def _cfg(mode: str, nodes=None, registry="prefect://pool", dp: int = 2, tp: int = 2, nproc: int | None = 2):
    cluster = {"mode": mode, "registry": registry, "nproc_per_node": nproc}
    if nodes is not None:
        cluster["nodes"] = [{"host": h, "gpus": 0, "role": "worker"} for h in nodes]
    return config_from_dict(
        {
            "task": {"name": "p"},
            "parallel": {"data_parallel_size": dp, "tensor_parallel_size": tp},
            "cluster": cluster,
        }
    )


REGISTERED = [_node("h0", "198.18.0.10"), _node("h1", "198.18.0.11"), _node("h2", "198.18.0.12")]


def test_static_takes_exactly_its_nodes_matched_by_name_or_address():
    placed = choose_nodes(_cfg("static", ["198.18.0.12", "h0"]), REGISTERED)
    assert [(a.name, a.node_rank, a.ranks) for a in placed] == [("h0", 0, [0, 1]), ("h2", 1, [2, 3])]


def test_static_names_a_node_without_agent_or_not_live():
    with pytest.raises(NodeUnavailable) as info:
        choose_nodes(_cfg("static", ["h0", "h9"]), REGISTERED)
    assert info.value.nodes == ["h9"] and "h9: no node agent registered" in str(info.value)
    dead = [REGISTERED[0], _node("h1", "198.18.0.11", live=False)]
    with pytest.raises(NodeUnavailable, match="h1: its agent is not live"):
        choose_nodes(_cfg("static", ["h0", "h1"]), dead)
    with pytest.raises(NodeUnavailable, match="h1: lost in an earlier attempt"):
        choose_nodes(_cfg("static", ["h0", "h1"]), REGISTERED, exclude={"h1"})


def test_dynamic_takes_live_nodes_by_name_and_leaves_out_lost_ones():
    cfg = _cfg("dynamic")
    assert [a.name for a in choose_nodes(cfg, REGISTERED)] == ["h0", "h1"]
    assert [a.name for a in choose_nodes(cfg, REGISTERED, exclude={"h1"})] == ["h0", "h2"]
    half_dead = [REGISTERED[0], _node("h1", "198.18.0.11", live=False), REGISTERED[2]]
    assert [a.name for a in choose_nodes(cfg, half_dead)] == ["h0", "h2"]
    with pytest.raises(NodeUnavailable, match="world size 4 needs more live nodes"):
        choose_nodes(cfg, REGISTERED, exclude={"h1", "h2"})


def test_nodes_are_ranked_in_the_rendezvous_order_of_their_addresses():
    # torch's c10d rendezvous sorts nodes by the address they announce, as strings: .100 before .11
    registered = [_node("a", "10.0.0.11"), _node("b", "10.0.0.100")]
    placed = choose_nodes(_cfg("dynamic"), registered)
    assert [(a.name, a.ranks) for a in placed] == [("b", [0, 1]), ("a", [2, 3])]


def test_uneven_split_and_bad_registry_are_refused():
    with pytest.raises(NodeUnavailable, match="do not split world size 4 evenly"):
        choose_nodes(_cfg("dynamic", nproc=3), REGISTERED)
    with pytest.raises(NodeUnavailable, match="use prefect://POOL"):
        cluster_pool(_cfg("dynamic", registry="etcd://x"))
    assert cluster_pool(_cfg("static", ["h0", "h1"], registry=None)) == "kuangchao-nodes"


def test_registry_names_are_valid_prefect_variable_names():
    from prefect.client.schemas.actions import VariableCreate

    VariableCreate(name=facts_variable("Kuangchao Nodes", "h-0"), value={})
    assert worker_name("h0") == "kc-node-h0"


def test_elastic_replan_keeps_tp_pp_and_the_global_batch():
    from kuangchao_core.sched.elastic import shrunk_config, smaller_data_parallel

    assert smaller_data_parallel(dp=4, accum=1, per_replica=2, capacity=6) == (2, 2)
    assert smaller_data_parallel(dp=2, accum=3, per_replica=2, capacity=2) == (1, 6)
    assert smaller_data_parallel(dp=2, accum=1, per_replica=4, capacity=3) is None
    base = config_from_dict(
        {
            "task": {"name": "e"},
            "parallel": {"data_parallel_size": 2, "tensor_parallel_size": 2, "gradient_accumulation_steps": 2},
            "cluster": {
                "mode": "static",
                "nproc_per_node": 2,
                "elastic": True,
                "nodes": [{"host": "h0", "role": "worker"}, {"host": "h1", "role": "worker"}],
            },
        }
    )
    shrunk = shrunk_config(base, ["h1"], [REGISTERED[0]])
    assert (shrunk.parallel.data_parallel_size, shrunk.parallel.gradient_accumulation_steps) == (1, 4)
    assert shrunk.parallel.global_batch_size == base.parallel.global_batch_size
    assert [n.host for n in shrunk.cluster.nodes] == ["h0"] and shrunk.parallel.tensor_parallel_size == 2
    rigid = config_from_dict({**base.to_dict(), "cluster": {**base.to_dict()["cluster"], "elastic": False}})
    with pytest.raises(NodeUnavailable, match="lost h1: the remaining live nodes host 2 ranks, the job needs 4"):
        shrunk_config(rigid, ["h1"], [REGISTERED[0]])


def test_kc_node_needs_a_prefect_server_and_a_valid_name(monkeypatch):
    from typer.testing import CliRunner

    from kuangchao.cli.main import app

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    res = CliRunner().invoke(app, ["node", "list", "--pool", "p"])
    assert res.exit_code == 2 and "PREFECT_API_URL is not set" in res.output
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    res = CliRunner().invoke(app, ["node", "start", "--pool", "p", "--name", "Bad Name"])
    assert res.exit_code == 2 and "cannot name a node" in res.output
