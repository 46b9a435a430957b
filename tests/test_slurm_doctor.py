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
from tests.test_readme import readme_blocks

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
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


def test_every_slurm_check_passes_on_the_labs_partition(slurm_cluster, monkeypatch):
    lab = slurm_cluster
    report = run_doctor(_cfg(lab), skip=NOT_SLURM)  # cluster.mode: slurm turns them on
    checks = _by_name(report.checks)
    assert list(checks) == ["slurm_commands", "slurm_controller", "slurm_partition", "slurm_nodes", "slurm_node_facts"]
    assert report.ok, report.to_dict()
    assert checks["slurm_node_facts"].detail == ("debug: 3 of 3 nodes idle: 3 with 2 CPUs, 0 GPUs; no tree topology")
    assert "is UP" in checks["slurm_controller"].detail and str(lab.conf) in checks["slurm_controller"].detail
    assert "partition debug is UP: 3 nodes (n[1-3])" in checks["slurm_partition"].detail
    assert checks["slurm_nodes"].detail.startswith("3 of 3 nodes of debug idle, 2 asked")
    assert "Slurm expects to start the job at once on n[1-2]" in checks["slurm_nodes"].detail
    assert not run_doctor(_cfg(lab), skip=NOT_SLURM, slurm=False).checks, "--no-slurm leaves them out"
    assert lab.run(["squeue", "-h"]).stdout.strip() == "", "the doctor submitted nothing"

    # `kc doctor --slurm` without a config: SLURM_CONF, the default partition, one node
    monkeypatch.setenv("SLURM_CONF", str(lab.conf))
    plain = _by_name(run_doctor(None, skip=NOT_SLURM, slurm=True).checks)
    assert all(c.ok for c in plain.values()) and len(plain) == 5, plain
    assert plain["slurm_partition"].detail.startswith("partition debug (the default) is UP")
    assert plain["slurm_nodes"].detail.startswith("3 of 3 nodes of debug idle, 1 asked")


def _readme_config(tmp_path: Path) -> Path:
    """The README's "Run on Slurm" config fragment as ``job.yaml`` (on top of tiny.yaml, as tests/test_readme.py
    validates it)."""
    blocks = [b for b in readme_blocks(README.read_text(encoding="utf-8")) if b.section == "Run on Slurm"]
    fragment = next(b.text for b in blocks if b.lang == "yaml")
    job = tmp_path / "job.yaml"
    job.write_text(f"extends: {TINY}\n{fragment}\n", encoding="utf-8")
    return job


def _kc(lab, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**lab.env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "KC_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("PREFECT_API_URL", None)
    argv = [sys.executable, "-m", "kuangchao.cli.main", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_the_readmes_commands_kc_doctor_and_kc_slurm_script_on_the_lab(slurm_cluster, tmp_path):
    """README "Run on Slurm": ``kc doctor --config job.yaml`` passes every check on the lab (the README's config,
    its partition ``debug``; only ``slurm_conf`` set to the lab's), and the batch script ``kc slurm script`` prints
    is one the lab's ``sbatch`` accepts (``--test-only``: its ``#SBATCH`` lines checked by Slurm, nothing queued)."""
    lab = slurm_cluster
    job = _readme_config(tmp_path)
    conf = f"cluster.slurm.slurm_conf={lab.conf}"
    out = _kc(lab, tmp_path, "doctor", "--config", str(job), "--set", conf, "--json")
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report["ok"], out.stdout + out.stderr[-3000:]
    names = [c["name"] for c in report["checks"]]
    assert names[-5:] == ["slurm_commands", "slurm_controller", "slurm_partition", "slurm_nodes", "slurm_node_facts"]
    assert "3 of 3 nodes of debug idle, 2 asked" in report["checks"][-2]["detail"]

    script = _kc(lab, tmp_path, "slurm", "script", str(job), "--set", conf)
    assert script.returncode == 0, script.stderr
    (tmp_path / "job.sbatch").write_text(script.stdout, encoding="utf-8")
    assert "#SBATCH --nodes=2" in script.stdout and "#SBATCH --partition=debug" in script.stdout
    test = lab.run(["sbatch", "--test-only", "job.sbatch"], cwd=tmp_path)
    assert test.returncode == 0 and "to start at" in test.stderr, test.stderr


def test_a_missing_partition_fails_naming_it_and_the_partitions_there(slurm_cluster):
    checks = _by_name(slurm_checks(_cfg(slurm_cluster, partition="gpu-a100")))
    bad = checks["slurm_partition"]
    assert not bad.ok and "partition gpu-a100 (cluster.slurm.partition) not found" in bad.detail
    assert bad.fix == "set cluster.slurm.partition to one of: debug"
    assert "slurm_nodes" not in checks, "no node check without a partition"


def test_switches_asked_of_a_cluster_without_tree_topology_fail_naming_the_setting(slurm_cluster):
    """The lab has no ``TopologyPlugin``: Slurm knows no switch and would ignore ``--switches``."""
    check = _by_name(slurm_checks(_cfg(slurm_cluster, switches=1)))["slurm_node_facts"]
    assert not check.ok and "Slurm has no tree topology here and would ignore --switches" in check.detail, check
    assert check.fix.startswith("unset cluster.slurm.switches")


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
    assert f"its port {other} is reachable" in bad.fix and "*" not in bad.detail
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
