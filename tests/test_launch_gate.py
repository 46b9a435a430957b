"""``kc launch`` across hosts (issue 38 item 2): node 0's store listens on ``--master-addr`` only, and with
``--store-key-file`` (the same secret file on both hosts) a third host that knows the address and port can neither
read nor write a key; without the key (the negative control) it reads the job's key and plants one of its own.

Two network-namespace hosts each run ``kc launch --nnodes 2`` of a plain torch script (one rank each, Gloo on
``eth0``), held running until the attack is done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kuangchao_core.sched.launcher import free_port
from kuangchao_core.sched.store_key import new_key
from tests.cluster.bench import Bench, bench_unavailable
from tests.test_store_binding import ROOT, SECRET, WORKER, attack_two_host_job

pytestmark = [pytest.mark.slow]


@pytest.mark.parametrize("keyed", [True, False], ids=["store-key", "no-key-negative-control"])
def test_kc_launch_across_hosts_gates_its_store(tmp_path, keyed):
    why = bench_unavailable()
    if why:
        pytest.skip(why)
    script, job = tmp_path / "kc_gate_script.py", tmp_path / "job"
    script.write_text(WORKER)
    job.mkdir()
    (tmp_path / "trusted.yaml").write_text("task:\n  name: kc-launch-gate\npermission:\n  mode: trusted\n")
    key = tmp_path / "store.key"
    key.write_text(new_key() + "\n")
    key.chmod(0o600)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "KC_TEST_DIR": str(job),
        "KC_TEST_SECRET": SECRET,
        "GLOO_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": "1",
    }
    with Bench(3, rate=None) as bench:
        master, port = bench.hosts[0].address, free_port()
        nodes = []
        for n in range(2):
            argv = [sys.executable, "-m", "kuangchao.cli.main", "launch", "--nnodes", "2", "--node-rank", str(n)]
            argv += ["--master-addr", master, "--master-port", str(port), "--job-id", "kc-gate-job"]
            argv += ["--config", str(tmp_path / "trusted.yaml"), "--run-dir", str(tmp_path / f"run{n}")]
            argv += ["--store-key-file", str(key)] if keyed else []
            nodes.append(
                bench.popen(
                    n, [*argv, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        attack, outs = attack_two_host_job(bench, nodes, job, master, port)
    assert attack.returncode == 0, attack.stderr[-2000:]
    assert all(p.returncode == 0 for p in nodes), [o[-3000:] for o in outs]
    seen = json.loads(attack.stdout.strip().splitlines()[-1])[str(port)]
    planted = (job / "planted").read_text()
    if keyed:
        assert seen["connect"] == "ok" and "error" in seen and seen.get("read") is None, seen  # the gate, no further
        assert planted == "False" and "no store key" not in outs[0], outs[0][-2000:]
    else:
        assert seen.get("read") == "s3" and seen.get("wrote") and planted == "True", seen
        assert "no store key" in outs[0], outs[0][-2000:]  # said on the console
