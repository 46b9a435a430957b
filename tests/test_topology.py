"""Topology probe: real Gloo processes, the node matrix, the fingerprint, and Prefect caching across flow runs."""

from __future__ import annotations

import json

import pytest

from kuangchao_core.config import config_from_dict
from kuangchao_core.errors import CommError
from kuangchao_core.sched import topology as T
from kuangchao_core.sched.local_probe import probe_topology

SIZES = (8, 1 << 16)


def _cfg(**sections):
    return config_from_dict({"task": {"name": "topo"}, "model": {"preset": "tiny"}, **sections})


def test_probe_measures_every_pair_with_real_gloo(tmp_path):
    log = tmp_path / "probes.jsonl"
    rep = probe_topology(3, sizes=SIZES, iters=3, node_of_rank=["a", "a", "b"], log_path=log)
    assert rep.world_size == 3 and rep.backend == "gloo" and rep.nodes == ["a", "b"]
    for i in range(3):
        assert rep.p2p_latency_us[i][i] is None and rep.p2p_bandwidth_gbps[i][i] is None
        for j in range(3):
            if i != j:
                assert rep.p2p_latency_us[i][j] == rep.p2p_latency_us[j][i] > 0
                assert rep.p2p_bandwidth_gbps[i][j] == rep.p2p_bandwidth_gbps[j][i] > 0
    assert rep.allreduce_latency_us > 0
    assert rep.allreduce_busbw_gbps == pytest.approx(rep.allreduce_algbw_gbps * 2 * 2 / 3)
    # node a<->b is the best of the cross-node rank pairs; node a's diagonal is the intra-node pair (0, 1)
    lat = rep.p2p_latency_us
    assert rep.node_latency_us[0][1] == min(lat[0][2], lat[1][2])
    assert rep.node_latency_us[0][0] == lat[0][1]
    assert rep.node_latency_us[1][1] is None  # a single rank on node b: nothing intra-node to measure
    assert rep.node_bandwidth_gbps[0][1] == max(rep.p2p_bandwidth_gbps[0][2], rep.p2p_bandwidth_gbps[1][2])
    md = rep.to_markdown()
    assert "node latency" in md and "| r2 |" in md
    assert T.TopologyReport.from_dict(json.loads(json.dumps(rep.to_dict()))) == rep
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["probe_id"] == rep.probe_id


def test_assemble_folds_ranks_by_node():
    def rank(r, lat, bw):
        return {
            "rank": r,
            "hostname": "h",
            "backend": "gloo",
            "allreduce_small_s": 1e-4 * (r + 1),
            "allreduce_large_s": 0.01,
            "large_bytes": 10**7,
            "row_latency_s": lat,
            "row_bandwidth_Bps": bw,
        }

    per_rank = [  # 4 ranks on 2 nodes: (0,1) on n0, (2,3) on n1
        rank(0, {1: 1e-6, 2: 9e-6, 3: 8e-6}, {1: 9e9, 2: 1e9, 3: 2e9}),
        rank(1, {2: 7e-6, 3: 10e-6}, {2: 1.5e9, 3: 1e9}),
        rank(2, {3: 2e-6}, {3: 8e9}),
        rank(3, {}, {}),
    ]
    rep = T.assemble_report(per_rank, SIZES, 3, ["n0", "n0", "n1", "n1"])
    assert rep.nodes == ["n0", "n1"]
    assert [pytest.approx(row) for row in ([1.0, 7.0], [7.0, 2.0])] == rep.node_latency_us
    assert [pytest.approx(row) for row in ([9.0, 2.0], [2.0, 8.0])] == rep.node_bandwidth_gbps
    assert rep.allreduce_latency_us == pytest.approx(400.0)  # the slowest rank bounds a collective
    assert rep.allreduce_algbw_gbps == pytest.approx(1.0)
    assert rep.allreduce_busbw_gbps == pytest.approx(1.5)
    with pytest.raises(CommError, match="one node name per rank"):
        T.assemble_report(per_rank, SIZES, 3, ["n0"])


def test_fingerprint_is_stable_and_tracks_the_cluster():
    a = T.cluster_fingerprint(_cfg())
    assert a == T.cluster_fingerprint(_cfg()) and len(a) == 64
    assert a != T.cluster_fingerprint(_cfg(parallel={"data_parallel_size": 2}))
    static = _cfg(
        cluster={"mode": "static", "nodes": [{"host": "n1", "gpus": 1}, {"host": "n2", "gpus": 1}]},
        parallel={"data_parallel_size": 2},
    )
    facts = T.cluster_facts(static)
    assert facts["hosts"] == ["n1", "n2"] and facts["world_size"] == 2 and facts["gpus_per_node"] == [1, 1]
    assert T.cluster_fingerprint(static) != T.cluster_fingerprint(_cfg(parallel={"data_parallel_size": 2}))


def test_task_result_is_cached_by_cluster_fingerprint(prefect_api, tmp_path):
    import asyncio

    from prefect import flow
    from prefect.client.orchestration import get_client

    from tasks.probe_topology import probe_topology as probe_topology_task

    log = tmp_path / "probes.jsonl"

    runs = []  # this test's flow runs: the session's Prefect server also holds other tests' artifacts

    @flow
    def probe(cfg):
        from prefect.runtime import flow_run

        runs.append(flow_run.get_id())
        return probe_topology_task(cfg, world_size=2, sizes=SIZES, iters=3, log_path=str(log))

    def measured() -> list[str]:
        return [json.loads(x)["probe_id"] for x in log.read_text().splitlines()] if log.exists() else []

    cfg = _cfg()
    first = probe(cfg)
    assert measured() == [first["probe_id"]]
    second = probe(_cfg())  # a new flow run on the same cluster: served from the cache, nothing measured
    assert measured() == [first["probe_id"]]
    assert second == first
    changed = probe(_cfg(parallel={"data_parallel_size": 2}))  # another fingerprint: measured again
    assert measured() == [first["probe_id"], changed["probe_id"]] and changed["probe_id"] != first["probe_id"]

    async def artifacts():
        async with get_client() as c:
            return [a for a in await c.read_artifacts() if a.key == "kc-topology" and str(a.flow_run_id) in runs]

    arts = asyncio.run(artifacts())
    assert len(arts) == 2 and all("node latency" in a.data and "fingerprint" in a.data for a in arts)
