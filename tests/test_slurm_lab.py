"""The test clusters themselves (issue 32 §9): a real Slurm cluster of network namespaces, and the multi-host bench,
each on its own names, subnet and ports, so that several run on one machine and each removes only its own.

The Slurm tests use the ``slurm_cluster`` fixture (tests/conftest_slurm.py): they skip only without root or without
Debian's Slurm packages (``.ci/run`` installs them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import netlab
from tests.cluster.bench import Bench, bench_unavailable

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

pytestmark = pytest.mark.timeout(300)


def _sacct_state(lab, job: str, timeout_s: float = 120) -> str:
    """The job's state in ``sacct`` once it has ended (polled: accounting is written after the job leaves)."""
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        out = lab.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State,ExitCode"], timeout=30)
        state = out.stdout.strip()
        if state and not state.startswith(("PENDING", "RUNNING", "COMPLETING")):
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not end within {timeout_s:g} s (sacct: {state!r})")


def test_srun_lands_one_task_per_node_each_with_its_name_and_address(slurm_cluster):
    lab = slurm_cluster
    probe = "import os, socket; n = socket.gethostname(); print(os.environ['SLURM_PROCID'], n, socket.gethostbyname(n))"
    out = lab.run(["srun", "-N3", "--ntasks-per-node=1", sys.executable, "-c", probe], timeout=60)
    assert out.returncode == 0, out.stderr
    tasks = [line.split() for line in out.stdout.splitlines()]
    assert sorted(rank for rank, _, _ in tasks) == ["0", "1", "2"]
    assert sorted(name for _, name, _ in tasks) == lab.nodes == ["n1", "n2", "n3"]
    # every node resolves its own name to its own address on the lab's subnet (the lab's /etc/hosts)
    assert {name: addr for _, name, addr in tasks} == lab.node_addr


TRAIN = """
import os, socket, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {socket.gethostname()}: {t.item():g}", flush=True)
dist.destroy_process_group()
"""

BATCH = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output={out}
set -euo pipefail
# the rendezvous host is the first allocated node, its address from Slurm (not DNS)
first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
addr=$(scontrol show node "$first" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')
echo "rendezvous $first $addr"
srun {torchrun} --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint="$addr:29411" \\
    --rdzv_id="$SLURM_JOB_ID" {script}
"""


@pytest.mark.slow
def test_sbatch_srun_torchrun_all_reduces_over_gloo_on_two_nodes_and_sacct_shows_it_completed(slurm_cluster, tmp_path):
    lab = slurm_cluster
    (tmp_path / "train.py").write_text(TRAIN)
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(BATCH.format(out=out, torchrun=TORCHRUN, script=tmp_path / "train.py"))
    submitted = lab.run(["sbatch", "--parsable", str(script)], cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    assert _sacct_state(lab, job, timeout_s=180) == "COMPLETED|0:0", out.read_text() if out.exists() else "no output"
    text = out.read_text()
    assert f"rendezvous n1 {lab.node_addr['n1']}" in text, text
    results = sorted(line for line in text.splitlines() if line.startswith("rank "))
    assert results == ["rank 0 of 2 on n1: 3", "rank 1 of 2 on n2: 3"] or results == [
        "rank 0 of 2 on n2: 3",
        "rank 1 of 2 on n1: 3",
    ], text
    steps = lab.run(["sacct", "-j", job, "-n", "-P", "-o", "JobID,State,NodeList"]).stdout
    assert f"{job}|COMPLETED|n[1-2]" in steps.splitlines(), steps


def test_a_second_lab_runs_beside_the_first_and_its_down_removes_only_its_own(slurm_cluster):
    first = slurm_cluster
    second = type(first)(1)
    try:
        second.up()
        assert second.claim.prefix != first.claim.prefix and second.claim.subnet != first.claim.subnet
        assert second.conf != first.conf and second.env["SLURM_CONF"] != first.env["SLURM_CONF"]
        assert second.ports["slurmctld"] != first.ports["slurmctld"]
        both = [lab.run(["srun", "-N1", "hostname"], timeout=60) for lab in (first, second)]
        assert [r.stdout.strip() for r in both] == ["n1", "n1"], [r.stderr for r in both]
        # a job left running in the second lab: its step daemon and its task live in the node's namespace
        held = second.run(["sbatch", "--parsable", "--wrap", "echo $$ > pid; exec sleep 300"])
        pidfile = second.directory / "pid"
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        task = int(pidfile.read_text())
        assert held.returncode == 0 and netlab.running(task, netlab.start_time(task))
        daemons = [(p, s) for p, s in second.claim.pids]
    finally:
        second.down()
    assert second.leftovers() == []
    assert not any(netlab.running(p, s) for p, s in [*daemons, (task, None)]), "a process of the lab survived down"
    assert not second.directory.exists() and not second.claim.path.exists()
    assert netlab.existing(first.claim) == [
        *first.claim.netns,
        *first.claim.links,
        first.claim.bridge,
    ], "the first lab lost a namespace or link"
    again = first.run(["srun", "-N3", "--ntasks-per-node=1", "hostname"], timeout=60)
    assert sorted(again.stdout.split()) == ["n1", "n2", "n3"], again.stderr


def test_a_lab_that_fails_to_come_up_removes_what_it_made(slurm_cluster):
    lab = type(slurm_cluster)(1)
    with pytest.raises(RuntimeError, match="not ready"):
        lab.up(timeout_s=0.0)  # no daemon can be ready: up fails after creating the network and starting munged
    assert lab.claim is not None and lab.claim.netns, "the failure came before anything was made"
    assert lab.leftovers() == [] and not lab.claim.path.exists()


LAB_THEN_HANG = """
import json, time
from tests.cluster.slurm_lab import SlurmLab
lab = SlurmLab(1)
lab.up()
print(json.dumps(lab.claim.prefix), flush=True)
time.sleep(300)
"""


def test_a_lab_whose_test_process_was_killed_is_removed_by_the_next_claim(slurm_cluster):
    """No ``finally`` runs after a ``kill -9``: the lab's record names its processes and namespaces, and the next
    claim on the machine (here an explicit reap) removes them; the running fixture's lab is untouched."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", LAB_THEN_HANG], stdout=subprocess.PIPE, text=True, env=env)
    try:
        prefix = json.loads(proc.stdout.readline())
        orphan = next(c for c in netlab.claims() if c.prefix == prefix)  # read while its owner runs
    finally:
        proc.kill()
        proc.wait()
    assert len(orphan.pids) == 5 and all(netlab.running(p, s) for p, s in orphan.pids)  # the daemons outlive it
    assert len(netlab.existing(orphan)) == 3  # one node: its namespace, veth and the bridge
    netlab.reap("ks")  # (any other test's claim may reap it first: what counts is that it is gone)
    assert netlab.existing(orphan) == []
    assert not any(netlab.running(p, s) for p, s in orphan.pids) and not orphan.path.exists()
    assert orphan.directory and not Path(orphan.directory).exists()
    lab = slurm_cluster  # its owner (this process) runs: every process and name of it is still there
    assert all(netlab.running(p, s) for p, s in lab.claim.pids) and len(netlab.existing(lab.claim)) == 7
    assert lab.node_state() == dict.fromkeys(lab.nodes, "idle")


def test_a_killed_node_has_no_process_left_and_comes_back(slurm_cluster):
    lab = slurm_cluster
    netns = lab.claim.netns[2]
    assert netlab.ip("netns", "pids", netns).stdout.split(), "n3 runs nothing"
    assert lab.kill_node("n3") >= 1  # slurmd at least
    assert netlab.ip("netns", "pids", netns).stdout.split() == []
    lab.start_node("n3")
    deadline = time.monotonic() + 30
    while lab.node_state().get("n3") != "idle" and time.monotonic() < deadline:
        time.sleep(0.2)
    out = lab.run(["srun", "-w", "n3", "hostname"], timeout=60)
    assert out.stdout.strip() == "n3", out.stderr
    inside = subprocess.run(lab.in_node("n3", ["hostname"]), capture_output=True, text=True, timeout=30)
    assert inside.stdout.strip() == "n3"


def _exchange(bench: Bench) -> str:
    """A TCP message from host 0 to host 1 of ``bench``; what host 1 received."""
    server = (
        f"import socket; c, _ = socket.create_server(('{bench.hosts[1].address}', 5555)).accept(); print(c.recv(9))"
    )
    proc = bench.popen(1, [sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
    client = (
        "import socket, sys, time\n"
        "for _ in range(100):\n"
        f"    try: s = socket.create_connection(('{bench.hosts[1].address}', 5555), timeout=2); break\n"
        "    except OSError: time.sleep(0.05)\n"
        f"s.sendall(b'{bench.claim.prefix}')\n"
    )
    subprocess.run(bench.hosts[0].command([sys.executable, "-c", client]), check=True, timeout=60)
    return proc.communicate(timeout=30)[0].strip()


def test_two_benches_run_side_by_side_and_each_removes_only_its_own():
    why = bench_unavailable()
    if why:
        pytest.fail(f"the multi-host bench cannot run here: {why}")
    with Bench(2, rate=None) as a, Bench(2, rate=None) as b:
        assert a.bridge != b.bridge and a.address != b.address
        assert a.address.rsplit(".", 1)[0] not in netlab.RESERVED and b.address.rsplit(".", 1)[0] not in netlab.RESERVED
        assert _exchange(a) == repr(a.claim.prefix.encode()) and _exchange(b) == repr(b.claim.prefix.encode())
        a.down()
        assert a.leftovers() == []
        assert len(b.leftovers()) == 5  # its two namespaces, two veths and bridge are all still there
        assert _exchange(b) == repr(b.claim.prefix.encode())
    assert b.leftovers() == []


def test_a_lab_whose_process_died_is_reaped_and_a_live_one_never():
    why = bench_unavailable()
    if why:
        pytest.fail(f"network labs cannot run here: {why}")
    live = netlab.claim("kb")
    owner = subprocess.Popen(["sleep", "300"])  # alive while the lab is built: no other test's claim reaps it early
    stale = netlab.claim("kb", owner=owner.pid)
    try:
        netlab.add_bridge(live)
        netlab.add_bridge(stale)
        netlab.add_host(stale, 0, f"{stale.subnet}.10")
        assert len(netlab.existing(stale)) == 3
        assert stale.bridge not in netlab.reap("kb")  # its owner runs
        owner.kill()
        owner.wait()
        netlab.reap("kb")  # (any other test's claim may reap it first: what counts is that it is gone)
        assert netlab.existing(stale) == [] and not stale.path.exists()
        assert netlab.existing(live) == [live.bridge] and live.path.exists()
    finally:
        owner.kill()
        owner.wait()
        netlab.release(live)
        netlab.release(stale)
