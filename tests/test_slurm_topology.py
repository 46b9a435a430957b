"""Issue 32 §5 on the real Slurm cluster (``slurm_tree_cluster``: n1..n3 under Slurm's tree topology, leaf switches
``s1: n1, n2`` and ``s2: n3``): a job with ``cluster.slurm.switches: 1``, submitted as ``kc train`` submits it (the
batch script :mod:`kuangchao_core.sched.slurm.job` writes, the ``sbatch`` line of ``script.sbatch_argv``), waits
for two nodes under one leaf switch rather than take the two idle nodes under two; ``nodes.json`` and
``kc doctor`` show the facts.
"""

from __future__ import annotations

import json
import time

import pytest

from kuangchao_core.config import load_config
from kuangchao_core.sched.slurm import commands, facts, job, script
from kuangchao_core.sched.slurm.doctor_checks import slurm_checks
from tests.conftest_prefect import TINY

pytestmark = pytest.mark.timeout(240)


def _cfg(lab, **slurm):
    settings = {"partition": lab.partition, "nodes": 2, "slurm_conf": str(lab.conf), **slurm}
    dp = f"parallel.data_parallel_size={settings['nodes']}"
    overrides = ["cluster.mode=slurm", "cluster.nproc_per_node=null", dp]
    return load_config(TINY, overrides + [f"cluster.slurm.{k}={v}" for k, v in settings.items()])


def _job(lab, job_id: str) -> dict[str, str]:
    return commands.show_job(job_id, lab.env) or {}


def _idle(lab) -> list[str]:
    return [n.name for n in facts.read_nodes(lab.env) if n.idle]


def _until(what: str, ready, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = ready()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout_s:g} s")


def test_one_leaf_switch_asked_waits_for_it_instead_of_spanning_two_and_the_facts_say_where(
    slurm_tree_cluster, tmp_path
):
    lab = slurm_tree_cluster
    cfg = _cfg(lab, switches=1, switches_wait="4:00")
    run_dir = tmp_path / "run"
    path, text = job.write_attempt(cfg, run_dir, 0, ["--config", str(tmp_path / "none.yaml")], {}, tokens=False)
    assert "#SBATCH --switches=1@4:00" in text and "#SBATCH --nodes=2" in text
    argv = script.sbatch_argv(cfg, path, lab.env)

    lab.run(["scontrol", "update", "nodename=n1", "state=drain", "reason=kc-topology-test"])
    job_id = None
    try:
        # n2 and n3 are free: a 2-node job that asks no switch takes them at once, across s1 and s2
        control = lab.run(["sbatch", "--parsable", "-N2", "--job-name=kc-any-switch", "--wrap=true"]).stdout.strip()
        nodes = _until("the control job ran", lambda: _job(lab, control).get("NodeList", "").replace("(null)", ""), 30)
        assert nodes == "n[2-3]"
        _until("n2 and n3 idle again", lambda: _idle(lab) == ["n2", "n3"], 30)

        doctor = {c.name: c for c in slurm_checks(_cfg(lab, switches=1))}["slurm_node_facts"]
        assert doctor.ok, doctor
        assert doctor.detail.startswith("debug: 2 of 3 nodes idle: 2 with 2 CPUs, 0 GPUs; 1 IDLE+DRAIN;")
        assert "2 nodes under 1 leaf switch(es) (cluster.slurm.switches): not idle now (at most 1 under s1)" in (
            doctor.detail
        )

        # the job asking one leaf switch: the scheduler looks at it and leaves it pending on n2 + n3
        job_id = commands.submit(argv, lab.env)
        info = _until(
            "the scheduler looked at the job", lambda: (i := _job(lab, job_id)).get("Reason") != "None" and i, 30
        )
        assert (info["JobState"], info["Reason"], info["NodeList"]) == ("PENDING", "Resources", ""), info
        assert info["Switches"] == "1@00:04:00"
        assert _idle(lab) == ["n2", "n3"], "two idle nodes, left alone: they sit under two leaf switches"
    finally:
        lab.run(["scontrol", "update", "nodename=n1", "state=resume"])
    try:
        lab.run(["sbatch", "--hold", "--job-name=kc-nudge", "--wrap=true"])  # a submission runs the scheduler now
        info = _until("the job ran", lambda: (i := _job(lab, job_id))["JobState"] == "RUNNING" and i, 60)
        assert info["NodeList"] == "n[1-2]", info  # both under s1
        said: list[str] = []
        out = script.slurm_dir(run_dir, 0)
        found = facts.record_attempt_nodes(out, commands.hostnames(info["NodeList"], lab.env), lab.env, said.append)
    finally:
        lab.run(["scancel", "--name=kc-nudge"])
        lab.run(["scancel", job_id])
    assert [f.name for f in found] == ["n1", "n2"]
    doc = json.loads((out / "nodes.json").read_text())
    assert doc["switches"] == ["s1"]
    assert [(n["name"], n["addr"], n["cpus"], n["switch"]) for n in doc["nodes"]] == [
        ("n1", lab.node_addr["n1"], 2, "s1"),
        ("n2", lab.node_addr["n2"], 2, "s1"),
    ]
    assert said == [
        f"Slurm node n1 ({lab.node_addr['n1']}): {found[0].state}, 2 CPUs, 0 GPUs, 1000 MB, switch s1",
        f"Slurm node n2 ({lab.node_addr['n2']}): {found[1].state}, 2 CPUs, 0 GPUs, 1000 MB, switch s1",
        "Slurm nodes under 1 leaf switch(es): s1",
    ]
