"""Issue 32 §5 on the real Slurm cluster: a Slurm job probes the links between the nodes it was granted and places
its ranks with the placement every path uses (``sched/rank_placement.place_from_report``).

Three nodes, one rank each, a 3-stage pipeline (pp3: the only group kind that moves bytes). Node ``n2``'s links are
shaped to 100 Mbit/s (``tc tbf`` on both ends of its veth, as DESIGN.md §5 shapes the bench's hosts), so ``n1–n3`` is
the one fast link. Slurm's (rendezvous) order ``n1, n2, n3`` would put both stage boundaries on a slow link; the
placement chains the nodes from the rendezvous node over the fastest measured link: stage 0 on ``n1``, stage 1 on
``n3``, stage 2 on ``n2``. The test asserts that the measured matrix shows the shaped links, that the recorded
placement is what the placement code makes of that matrix and not Slurm's order (the negative control: without the
measured links the same code keeps Slurm's order), that each node's worker ran the mesh rank the placement gave it,
and that the losses are the one-process reference's (helpers of ``tests/test_slurm.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kuangchao_core.sched.rank_placement import place_from_report
from kuangchao_core.sched.topology import TopologyReport
from tests.conftest_prefect import TINY
from tests.reference_runs import one_process_reference
from tests.test_slurm import STEPS, _assert_losses, _finish, _overrides, _slurm, _start_train, _summary

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

#: n2's links: 100 Mbit/s = 0.0125 GB/s, against several hundred MB/s over an unshaped veth here
SLOW = "100mbit"
#: the most a probe can measure over them: its 1 MiB message passes a full 256 KiB token bucket at once, the rest at
#: the rate (``slurm_lab.shape_node``), so 1 MiB / (768 KiB / 12.5 MB/s) = 0.0167 GB/s
SLOW_MAX_GBPS = (1 << 20) / ((768 << 10) / 12.5e6) / 1e9
LAYOUT = {
    "model.num_layers": 3,
    "parallel.data_parallel_size": 1,
    "parallel.tensor_parallel_size": 1,
    "parallel.micro_batch_size": 2,
    "parallel.gradient_accumulation_steps": 3,
}


def test_a_slurm_job_places_pipeline_neighbours_on_its_fastest_measured_link(
    prefect_api, slurm_cluster, tmp_path_factory
):
    lab = slurm_cluster
    work, store = tmp_path_factory.mktemp("slurm-place"), tmp_path_factory.mktemp("slurm-place-mlflow")
    base = _overrides(work, "kc-slurm-place", store, **LAYOUT)
    reference = one_process_reference(TINY, base + [f"checkpoint.dir={work / 'ref-ckpt'}"], STEPS, 3)
    overrides = base + [f"{k}={v}" for k, v in _slurm(lab, nodes=3, tasks=1).items()]
    lab.shape_node("n2", SLOW)
    try:
        proc = _start_train(
            lab, work, overrides + ["parallel.pipeline_parallel_size=3"], {"PREFECT_API_URL": prefect_api}
        )
        try:
            code, output = _finish(proc, work)
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        lab.shape_node("n2", None)
    assert code == 0, output[-5000:]
    summary = _summary(output)
    _assert_losses(store, summary, reference)  # the rank map kept every stage's work: the one-process losses
    run_dir = Path(summary["run_dir"])
    slurm = run_dir / "attempt_0/slurm"
    assert "-m kuangchao_core.sched.probe_worker" in (slurm / "job.sbatch").read_text()

    # the probe measured the shaped links: every link of n2 is slow, n1–n3 is not
    placed = json.loads((slurm / "placement.json").read_text())
    assert placed["measured"] is True and placed["warning"] is None, placed
    topo = TopologyReport.from_dict(placed["topology"])
    bw = dict(zip(["n1", "n2", "n3"], topo.submatrix(["n1", "n2", "n3"]), strict=True))
    assert bw["n1"][1] <= SLOW_MAX_GBPS and bw["n2"][2] <= SLOW_MAX_GBPS, bw  # the tbf shaping
    assert bw["n1"][2] > 4 * max(bw["n1"][1], bw["n2"][2]), bw

    # the placement is the placement code's answer to that matrix: pipeline neighbours on the fast link
    plan = placed["placement"]
    assert plan["nodes"] == ["n1", "n2", "n3"], "nodes in the rendezvous order (by NodeAddr)"
    traffic = plan["traffic_bytes_per_step"]
    assert traffic["pp"] > 0 and traffic.get("tp", 0) == 0 and traffic.get("dp", 0) == 0
    same_code = place_from_report((1, 1, 3), plan["nodes"], 1, traffic=traffic, topology=topo)
    assert plan["rank_of_slot"] == same_code.rank_of_slot == [0, 2, 1], plan  # n1: stage 0, n2: stage 2, n3: stage 1
    # negative control: Slurm's plain order is the identity, and so is the same code without the measured links
    assert place_from_report((1, 1, 3), plan["nodes"], 1, traffic=traffic).rank_of_slot == [0, 1, 2]

    # each node's worker ran the mesh rank the placement gave it: torchrun's rank (Slurm's slot) -> the mesh rank
    for slot, (node, rank) in enumerate((("n1", 0), ("n2", 2), ("n3", 1))):
        log = (run_dir / f"attempt_0/nodes/{node}/launcher.log").read_text()
        played = set(re.findall(r'^\[rank(\d+)\]:\{.*"module_id": "worker-(\d+)"', log, re.MULTILINE))
        assert played == {(str(slot), str(rank))}, (node, played, log[-2000:])

    # recorded as on the other paths, and said in the job's log
    record = json.loads((run_dir / "placement.attempt_0.json").read_text())
    assert record["placement"] == plan and record["measured"] is True
    assert [row["node"] for row in record["links"]] == ["n1", "n2", "n3"]
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    logged = json.loads(
        Path(client.download_artifacts(summary["mlflow_run_id"], "placement/attempt_0.json")).read_text()
    )
    assert logged["placement"] == plan
    states = (slurm / "states.log").read_text()
    addr = lab.node_addr
    said = (
        f"placement of attempt 0 (topology, measured links): n1 ({addr['n1']}): ranks [0]; "
        f"n2 ({addr['n2']}): ranks [2]; n3 ({addr['n3']}): ranks [1]"
    )
    assert said in states, states
    assert said in next(iter(slurm.glob("batch-*.out"))).read_text()
