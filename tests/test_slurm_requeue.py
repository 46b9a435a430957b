"""A Slurm node lost mid-run (issue 32 §4), on a real Slurm cluster: the flow names the node, resubmits the job
without it (``--exclude``) and resumes from the newest checkpoint, every step once in MLflow; with too few usable
nodes left the job is re-planned onto fewer (``cluster.elastic``).

The cluster is this module's ``slurm_cluster`` (``tests/conftest_slurm.py``: nodes ``n1..n3``, partition
``debug``); a node dies by :meth:`SlurmLab.kill_node` (its slurmd and every process in its namespace, SIGKILL).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kuangchao_core.config import load_config
from kuangchao_core.errors import KuangchaoError
from tests.conftest_prefect import TINY
from tests.reference_runs import one_process_reference
from tests.test_slurm import STEPS, _assert_losses, _finish, _overrides, _slurm, _start_train, _summary, _wait

#: micro-batches per step on each of the two data-parallel replicas: steps slow enough (about a second each) that
#: the node dies between the checkpoint of step 4 and the end
ACCUM = 8

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """The module's MLflow store directory."""
    return tmp_path_factory.mktemp("slurm-requeue-mlflow")


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory, store) -> list[float]:
    """The dp2×tp2 job's losses from one process (the same global batch: 2 × ACCUM micro-batches of 2 per step)."""
    tmp = tmp_path_factory.mktemp("slurm-requeue-ref")
    return one_process_reference(
        TINY, _overrides(tmp, "kc-slurm-requeue-ref", store) + [f"checkpoint.dir={tmp / 'ckpt'}"], STEPS, 2 * ACCUM
    )


def _slurm_cfg(lab, tmp_path: Path, **extra):
    overrides = _overrides(tmp_path, "kc-slurm-elastic", tmp_path, **_slurm(lab), **extra)
    return load_config(TINY, overrides)


def test_with_too_few_usable_nodes_left_the_job_is_replanned_onto_fewer(slurm_cluster, tmp_path):
    """``config_for_attempt`` reads the partition's usable nodes from ``sinfo``: one spare left keeps the layout;
    none left shrinks dp2×tp2 on 2 nodes to dp1×tp2 on 1 with doubled accumulation (elastic), or says what is
    missing (not elastic)."""
    from kuangchao_core.sched.elastic import config_for_attempt

    lab = slurm_cluster
    assert sorted(n for n, s in lab.node_state().items() if s == "idle") == ["n1", "n2", "n3"]
    elastic = _slurm_cfg(lab, tmp_path, **{"cluster.elastic": "true"})
    assert config_for_attempt(elastic, ["n2"]) is elastic, "n1 and n3 are left: the same job"
    shrunk = config_for_attempt(elastic, ["n2", "n3"])
    assert shrunk.cluster.slurm.nodes == 1 and shrunk.cluster.slurm.tasks_per_node == 2
    par = shrunk.parallel
    assert (par.data_parallel_size, par.tensor_parallel_size, par.gradient_accumulation_steps) == (1, 2, 2)
    rigid = _slurm_cfg(lab, tmp_path)
    with pytest.raises(KuangchaoError, match=r"lost n2, n3: the usable nodes of the partition host 2 ranks"):
        config_for_attempt(rigid, ["n2", "n3"])


def test_a_node_killed_mid_run_is_left_out_and_the_job_finishes_every_step_once(
    prefect_api, slurm_cluster, tmp_path, store, one_process_losses
):
    lab = slurm_cluster
    overrides = _overrides(
        tmp_path,
        "kc-slurm-requeue",
        store,
        **_slurm(lab),
        **{"cluster.max_restarts": 2, "parallel.gradient_accumulation_steps": ACCUM},
    )
    proc = _start_train(lab, tmp_path, overrides, {"PREFECT_API_URL": prefect_api})
    ckpt = tmp_path / "ckpt" / "kc-slurm-requeue"
    try:
        submitted = _wait(lambda: list(tmp_path.glob("runs/*/*/attempt_0/slurm/submit.json")), 300, "the sbatch")
        run_dir = submitted[0].parents[2]
        first_job = json.loads(submitted[0].read_text())["job_id"]
        _wait(lambda: list(ckpt.glob("*/step_00000004/manifest.json")), 400, "the checkpoint of step 4")
        assert lab.kill_node("n2") > 0
        killed = time.monotonic()
        _wait(lambda: "node n2 lost" in (run_dir / "attempt_0/slurm/states.log").read_text(), 60, "n2 named lost")
        took = time.monotonic() - killed
        code, output = _finish(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, output[-5000:]
    assert took <= 20.0, f"n2 named lost {took:.1f} s after it died"
    summary = _summary(output)
    assert summary["attempts"] == 2 and summary["restart_causes"][0].startswith("attempt 0: node n2: lost"), summary
    assert Path(summary["run_dir"]) == run_dir

    # the second job left the dead node out and ran on the survivor and the spare, from the checkpoint of step 4
    script = (run_dir / "attempt_1/slurm/job.sbatch").read_text()
    assert "#SBATCH --exclude=n2" in script and "#SBATCH --nodes=2" in script, script
    second_job = json.loads((run_dir / "attempt_1/slurm/submit.json").read_text())["job_id"]
    assert second_job != first_job
    assert sorted(p.name for p in (run_dir / "attempt_1/nodes").iterdir()) == ["n1", "n3"]
    states = (run_dir / "attempt_1/slurm/states.log").read_text()
    assert f"Slurm job {second_job}: RUNNING on n[1,3]" in states, states
    # scancel ended the first job (sacct: CANCELLED, not NODE_FAIL from Slurm's own timeout); squeue may still list
    # it COMPLETING while the dead node cannot confirm, never running
    first_state = lab.run(["sacct", "-n", "-X", "-P", "-j", str(first_job), "-o", "State"]).stdout.strip()
    assert first_state.startswith("CANCELLED"), f"the first job was cancelled: {first_state!r}"
    queued = dict(line.split() for line in lab.run(["squeue", "-h", "-o", "%i %T"]).stdout.splitlines())
    assert queued.get(str(first_job), "COMPLETING") == "COMPLETING", queued
    _assert_losses(store, summary, one_process_losses)  # steps 1-8 once each: 5-8 from the resumed job
