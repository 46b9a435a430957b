"""Issue 32 §7: ``kc doctor`` checks the Slurm path — its commands, the controller, the partition, idle nodes or the
expected wait — on a real Slurm cluster (the ``slurm_cluster`` fixture: nodes ``n1..n3``, partition ``debug``).

The checks read ``cluster.slurm.slurm_conf`` (here the lab's ``slurm.conf``), never the machine's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from kuangchao_core.config import load_config
from kuangchao_core.sched.doctor import run_doctor
from kuangchao_core.sched.slurm.doctor_checks import CONTROLLER_TIMEOUT_S, slurm_checks
from tests.cluster import netlab
from tests.conftest_prefect import TINY

ROOT = Path(__file__).resolve().parent.parent
#: what a test leaves out of ``run_doctor``: everything but the Slurm checks
NOT_SLURM = ("versions", "cuda", "gloo", "nodes", "checkpoint_storage", "mlflow", "prefect")


def _cfg(lab, conf: Path | None = None, **slurm):
    """tiny.yaml with ``cluster.mode: slurm`` on the lab: one rank per node, data parallel over the nodes."""
    settings = {"partition": lab.partition, "nodes": 2, "slurm_conf": str(conf or lab.conf), **slurm}
    overrides = [
        "cluster.mode=slurm",
        "cluster.nproc_per_node=null",
        f"parallel.data_parallel_size={settings['nodes']}",
    ]
    return load_config(TINY, overrides + [f"cluster.slurm.{k}={v}" for k, v in settings.items()])


def _by_name(checks) -> dict:
    return {c.name: c for c in checks}


def test_every_slurm_check_passes_on_the_labs_partition(slurm_cluster, tmp_path):
    lab = slurm_cluster
    report = run_doctor(_cfg(lab), skip=NOT_SLURM)  # cluster.mode: slurm turns them on
    checks = _by_name(report.checks)
    assert list(checks) == ["slurm_commands", "slurm_controller", "slurm_partition", "slurm_nodes"]
    assert report.ok, report.to_dict()
    assert "is UP" in checks["slurm_controller"].detail and str(lab.conf) in checks["slurm_controller"].detail
    assert "partition debug is UP: 3 nodes (n[1-3])" in checks["slurm_partition"].detail
    assert checks["slurm_nodes"].detail.startswith("3 of 3 nodes of debug idle, 2 asked")
    assert "Slurm expects to start the job at once on n[1-2]" in checks["slurm_nodes"].detail
    assert not run_doctor(_cfg(lab), skip=NOT_SLURM, slurm=False).checks, "--no-slurm leaves them out"
    assert lab.run(["squeue", "-h"]).stdout.strip() == "", "the doctor submitted nothing"

    # the command line: `kc doctor --config job.yaml` (cluster.mode: slurm in the file) prints the same checks
    job = tmp_path / "job.yaml"
    job.write_text(
        f"extends: {TINY}\ncluster:\n  mode: slurm\n  nproc_per_node: 1\n  slurm:\n    partition: debug\n"
        f"    nodes: 2\n    slurm_conf: {lab.conf}\n",
        encoding="utf-8",
    )
    env = {**lab.env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "KC_CACHE_DIR": str(tmp_path)}
    env.pop("PREFECT_API_URL", None)
    argv = [sys.executable, "-m", "kuangchao.cli.main", "doctor", "--config", str(job), "--json"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    names = {c["name"]: c["ok"] for c in json.loads(out.stdout)["checks"]}
    assert {k: v for k, v in names.items() if k.startswith("slurm_")} == dict.fromkeys(
        ("slurm_commands", "slurm_controller", "slurm_partition", "slurm_nodes"), True
    ), out.stdout + out.stderr


def test_a_missing_partition_fails_naming_it_and_the_partitions_there(slurm_cluster):
    checks = _by_name(slurm_checks(_cfg(slurm_cluster, partition="gpu-a100")))
    bad = checks["slurm_partition"]
    assert not bad.ok and "partition gpu-a100 (cluster.slurm.partition) not found" in bad.detail
    assert bad.fix == "set cluster.slurm.partition to one of: debug"
    assert "slurm_nodes" not in checks, "no node check without a partition"


def test_more_nodes_than_the_lab_has_gives_slurms_reason(slurm_cluster):
    check = _by_name(slurm_checks(_cfg(slurm_cluster, nodes=5)))["slurm_nodes"]
    assert not check.ok
    assert "3 of 3 nodes of debug idle, 5 asked" in check.detail
    assert "Requested node configuration is not available" in check.detail, check.detail  # Slurm's own words
    assert check.fix.startswith("ask for at most 3 nodes (cluster.slurm.nodes)")


def test_busy_nodes_give_slurms_expected_start(slurm_cluster):
    """Two of three nodes taken whole by a job with a 5-minute limit: one idle, and Slurm's estimate for 2 nodes is when
    that job's time runs out — a wait, reported, not a failure."""
    lab = slurm_cluster
    job = lab.run(
        ["sbatch", "--parsable", "-N2", "--exclusive", "--time=5", "--job-name=kc-doctor-busy", "--wrap=sleep 120"]
    )
    job_id = job.stdout.strip()
    try:
        deadline = time.monotonic() + 20
        while "R" not in lab.run(["squeue", "-h", "-j", job_id, "-o", "%t"]).stdout and time.monotonic() < deadline:
            time.sleep(0.2)
        check = _by_name(slurm_checks(_cfg(lab)))["slurm_nodes"]
    finally:
        lab.run(["scancel", job_id])
    assert check.ok, check
    assert check.detail.startswith("1 of 3 nodes of debug idle, 2 asked"), check.detail
    assert re.search(r"Slurm expects to start the job at \S+ \(in about [45] min\)", check.detail), check.detail


def test_a_controller_that_does_not_answer_fails_quickly_naming_it(slurm_cluster, tmp_path):
    lab = slurm_cluster
    port = lab.ports["slurmctld"]
    other = netlab.free_port()  # nothing listens there
    conf = tmp_path / "slurm.conf"
    conf.write_text(lab.conf.read_text().replace(f"SlurmctldPort={port}\n", f"SlurmctldPort={other}\n"))
    assert f"SlurmctldPort={other}" in conf.read_text()
    started = time.monotonic()
    checks = _by_name(slurm_checks(_cfg(lab, conf=conf)))
    took = time.monotonic() - started
    bad = checks["slurm_controller"]
    assert not bad.ok and f"({lab.address}):{other} (from {conf}) does not answer" in bad.detail
    assert f"its port {other} is reachable" in bad.fix
    assert list(checks) == ["slurm_commands", "slurm_controller"]
    assert took < CONTROLLER_TIMEOUT_S + 5, f"{took:.1f} s"  # bounded (issue 32 §7): no hang on a dead controller


def test_missing_commands_fail_naming_them(slurm_cluster, monkeypatch, tmp_path):
    """A machine without Slurm's clients (PATH without them): the one check fails naming each, and nothing else
    runs."""
    monkeypatch.setenv("PATH", str(tmp_path))
    checks = slurm_checks(_cfg(slurm_cluster))
    assert [c.name for c in checks] == ["slurm_commands"]
    assert not checks[0].ok and "sbatch, srun, squeue, scontrol, sacct, scancel, sinfo" in checks[0].detail
    assert "login node" in checks[0].fix and os.environ["PATH"] == str(tmp_path)


def test_a_partition_that_is_down_fails_though_sbatch_would_still_estimate_a_start(slurm_cluster):
    """``sbatch --test-only`` gives a start time for a DOWN partition too: the partition check is what says no."""
    lab = slurm_cluster
    assert lab.run(["scontrol", "update", f"PartitionName={lab.partition}", "State=DOWN"]).returncode == 0
    try:
        checks = _by_name(slurm_checks(_cfg(lab)))
    finally:
        lab.run(["scontrol", "update", f"PartitionName={lab.partition}", "State=UP"])
    bad = checks["slurm_partition"]
    assert not bad.ok and bad.detail == "partition debug is DOWN: Slurm starts no job in it"
    assert "slurm_nodes" not in checks
