"""Nothing listens beyond what the job needs (issue 38 item 2): a local job's stores and endpoints are on loopback
only, and a ``TCPStore`` client from another network namespace, at the host's other address, is refused.

Each check runs on the fixed launch and, as its negative control, on the pre-fix one (torchrun's own ``c10d``
backend, whose stores bind every address): there the same check finds the exposed store, and the client from the
other namespace reads a key the job holds and plants one of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from kuangchao_core.sched.bound_store import hosted_store
from kuangchao_core.sched.launch_spec import LaunchSpec
from kuangchao_core.sched.launcher import free_port, process_tree, run_workers
from kuangchao_core.sched.store_gate import Gate, Relay, new_key
from tests.cluster.bench import Bench, bench_unavailable
from tests.listening import exposed, listening

ROOT = Path(__file__).resolve().parent.parent
SECRET = "kc-job-secret"

WORKER = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 0 and os.environ.get("KC_TEST_SECRET"):  # a key the job holds, in its own store
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        store.set(os.environ["KC_TEST_SECRET"], "s3")
    ready = os.path.join(os.environ["KC_TEST_DIR"], f"ready_{dist.get_rank()}")
    open(ready, "w").close()
    release = os.path.join(os.environ["KC_TEST_DIR"], "release")
    deadline = time.monotonic() + 90
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
    if dist.get_rank() == 0 and os.environ.get("KC_TEST_SECRET"):
        planted = store.check(["kc-planted"])
        open(os.path.join(os.environ["KC_TEST_DIR"], "planted"), "w").write(str(planted))
    dist.barrier()
    dist.destroy_process_group()
    """
)

# a client from another network namespace: raw connect to each port, then TCPStore read and write on the stores
ATTACK = textwrap.dedent(
    """
    import datetime, json, socket, sys
    import torch.distributed as dist

    host, ports, stores = sys.argv[1], json.loads(sys.argv[2]), set(json.loads(sys.argv[3]))
    out = {}
    for port in ports:
        try:
            socket.create_connection((host, port), timeout=3).close()
        except OSError as exc:
            out[port] = {"connect": type(exc).__name__}
            continue
        got = {"connect": "ok"}
        if port in stores:
            try:
                s = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=5))
                got["read"] = s.get(sys.argv[4]).decode() if s.check([sys.argv[4]]) else None
                s.set("kc-planted", "attacker")
                got["wrote"] = True
            except Exception as exc:
                got["error"] = str(exc)[:300]
        out[port] = got
    print(json.dumps(out))
    """
)


def _prefix_command(port: int) -> list[str]:
    """The launch before the fix: torchrun's own c10d rendezvous (its stores bind every address)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "kc-prefix",
        "--max-restarts",
        "0",
        "-m",
        "kc_store_worker",
    ]


class _Job:
    """A 2-rank local job through the launcher, held running (every rank past its first all_reduce) until
    :meth:`release`."""

    def __init__(self, tmp_path: Path, prefix: bool):
        mods = tmp_path / "mods"
        mods.mkdir()
        (mods / "kc_store_worker.py").write_text(WORKER)
        self.dir = tmp_path / "job"
        self.dir.mkdir()
        env = {"PYTHONPATH": os.pathsep.join([str(mods), str(ROOT)]), "KC_TEST_DIR": str(self.dir)}
        self.spec = LaunchSpec(
            "kc_store_worker",
            [],
            nproc=2,
            env=env,
            run_dir=tmp_path / "run",
            timeout_s=120,
            command=_prefix_command(free_port()) if prefix else None,
        )
        self.outcome: list = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.outcome.append(run_workers(self.spec))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.outcome.append(exc)

    def start(self) -> list[int]:
        """Start the job and wait until both ranks are up; returns the job's processes (torchrun first)."""
        self.thread.start()
        deadline = time.monotonic() + 90
        while not all((self.dir / f"ready_{r}").exists() for r in range(2)):
            assert self.thread.is_alive(), f"the job ended before its ranks were up: {self.outcome}"
            assert time.monotonic() < deadline, "the ranks did not come up in 90 s"
            time.sleep(0.1)
        return _torchrun_tree(os.getpid())

    def release(self) -> None:
        """Let the ranks finish; the job must have succeeded."""
        (self.dir / "release").touch()
        self.thread.join(timeout=60)
        assert self.outcome and not isinstance(self.outcome[0], BaseException), self.outcome


def _torchrun_tree(pid: int) -> list[int]:
    """The job's torchrun agent under ``pid`` and its descendants, the agent first (the test process may have other
    children: servers of other tests in the same session)."""
    for p in process_tree(pid):
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kuangchao_core.sched.bound_rdzv" in cmdline or b"torch.distributed.run" in cmdline:
            return process_tree(p)
    raise AssertionError(f"no torchrun under pid {pid}")


def _store_ports(pids: list[int]) -> list[int]:
    """The ports the torchrun agent (the first of ``pids``) listens on: its stores."""
    return sorted({port for _, _, port in listening(pids[:1])})


def test_hosted_store_listens_on_its_address_only():
    store = hosted_store("127.0.0.1", 0, timeout=timedelta(seconds=10))
    mine = [e for e in listening([os.getpid()]) if e[2] == store.port]
    assert mine and not exposed(mine), mine
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    # negative control: torch's own server on the same address binds every address
    stock = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    assert exposed([e for e in listening([os.getpid()]) if e[2] == stock.port])


@pytest.mark.parametrize("prefix", [False, True], ids=["fixed", "prefix-negative-control"])
def test_local_job_listens_on_loopback_only(tmp_path, prefix):
    job = _Job(tmp_path, prefix)
    try:
        pids = job.start()
        listeners = listening(pids)
        stores = _store_ports(pids)
    finally:
        job.release()
    assert stores, f"the torchrun agent hosts no store? {listeners}"
    assert len(listeners) >= 3, listeners  # the store and each rank's Gloo listener at least
    if prefix:
        assert exposed(listeners), f"the pre-fix launch exposed nothing? {listeners}"
    else:
        assert not exposed(listeners), f"listening beyond loopback: {exposed(listeners)}"
        assert len(stores) == 1, f"one store for the whole job, the workers its clients: {listeners}"


@pytest.mark.parametrize("prefix", [False, True], ids=["fixed", "prefix-negative-control"])
def test_store_client_from_another_namespace_is_refused(tmp_path, prefix):
    why = bench_unavailable()
    if why:
        pytest.skip(why)
    with Bench(1, rate=None) as bench:
        job = _Job(tmp_path, prefix)
        try:
            pids = job.start()
            ports = sorted({port for _, _, port in listening(pids)})
            stores = _store_ports(pids)
            for port in stores:  # a key the job holds, set over loopback
                dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)).set(SECRET, "s3")
            attack = subprocess.run(
                bench.hosts[0].command(
                    [sys.executable, "-c", ATTACK, bench.address, json.dumps(ports), json.dumps(stores), SECRET]
                ),
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            assert attack.returncode == 0, attack.stderr[-2000:]
            seen = {int(k): v for k, v in json.loads(attack.stdout.strip().splitlines()[-1]).items()}
            planted = [p for p in stores if dist.TCPStore("127.0.0.1", p, is_master=False).check(["kc-planted"])]
        finally:
            job.release()
    if prefix:  # the attack works before the fix: a key read and a key written from the other namespace
        assert any(seen[p].get("read") == "s3" for p in stores), seen
        assert planted, seen
    else:
        assert all(v == {"connect": "ConnectionRefusedError"} for v in seen.values()), seen
        assert not planted


NODE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from kuangchao_core.sched.launch_spec import LaunchSpec
    from kuangchao_core.sched.launcher import run_workers

    a = json.loads(sys.argv[1])
    run_workers(LaunchSpec(
        "kc_store_worker", [], nproc=1, env=a["env"], run_dir=Path(a["run_dir"]), out_dir=Path(a["out_dir"]),
        nnodes=2, node_rank=a["node_rank"], master_addr=a["master"], master_port=a["port"],
        local_addr=a["local"], rdzv_is_host=a["node_rank"] == 0, rdzv_id="kc-gate-test", timeout_s=150,
    ))
    """
)


def attack_two_host_job(bench, nodes: list, job: Path, master: str, port: int):
    """Once both ranks of the two-host job ``nodes`` are up: the attack from host 2 on ``master:port``, then the job
    released; ``(the attack's CompletedProcess, each node's output)``."""
    deadline = time.monotonic() + 120
    while not all((job / f"ready_{r}").exists() for r in range(2)):
        assert all(p.poll() is None for p in nodes), [p.communicate()[0][-3000:] for p in nodes]
        assert time.monotonic() < deadline, "the ranks did not come up in 120 s"
        time.sleep(0.1)
    argv = [sys.executable, "-c", ATTACK, master, json.dumps([port]), json.dumps([port]), SECRET]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    attack = subprocess.run(bench.hosts[2].command(argv), capture_output=True, text=True, timeout=120, env=env)
    (job / "release").touch()
    return attack, [p.communicate(timeout=120)[0] for p in nodes]


@pytest.mark.slow
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated-negative-control"])
def test_multi_host_store_refuses_a_client_without_the_job_key(tmp_path, gated):
    """Two hosts run a job; a third host that knows the store's address and port can neither read nor write a key
    (with the job's store key); without the key (the negative control) it reads the job's key and plants one."""
    why = bench_unavailable()
    if why:
        pytest.skip(why)
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "kc_store_worker.py").write_text(WORKER)
    job = tmp_path / "job"
    job.mkdir()
    env = {
        "PYTHONPATH": os.pathsep.join([str(mods), str(ROOT)]),
        "KC_TEST_DIR": str(job),
        "KC_TEST_SECRET": SECRET,
        "GLOO_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": "1",
        **({"KC_STORE_KEY": new_key()} if gated else {}),
    }
    with Bench(3, rate=None) as bench:
        master, port = bench.hosts[0].address, free_port()
        nodes = [
            bench.popen(
                n,
                [
                    sys.executable,
                    "-c",
                    NODE,
                    json.dumps(
                        {
                            "env": env,
                            "run_dir": str(tmp_path / "run"),
                            "out_dir": str(tmp_path / f"node{n}"),
                            "node_rank": n,
                            "master": master,
                            "port": port,
                            "local": bench.hosts[n].address,
                        }
                    ),
                ],
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for n in range(2)
        ]
        attack, outs = attack_two_host_job(bench, nodes, job, master, port)
    assert attack.returncode == 0, attack.stderr[-2000:]
    assert all(p.returncode == 0 for p in nodes), [o[-3000:] for o in outs]
    seen = json.loads(attack.stdout.strip().splitlines()[-1])[str(port)]
    planted = (job / "planted").read_text()
    if gated:
        assert seen["connect"] == "ok" and "error" in seen, seen  # it reaches the gate, and no further
        assert seen.get("read") is None and not seen.get("wrote"), seen
        assert planted == "False"
    else:
        assert seen.get("read") == "s3" and seen.get("wrote"), seen
        assert planted == "True"


def test_gate_lets_through_only_the_job_key():
    """In one process: a relay with the job's key reaches the store behind the gate; one with another key does not,
    and the gate counts it refused."""
    key = bytes.fromhex(new_key())
    store = hosted_store("127.0.0.1", 0, timeout=timedelta(seconds=10))
    store.set("k", "v")
    gate = Gate("127.0.0.1", 0, ("127.0.0.1", store.port), key)
    good, bad = Relay(("127.0.0.1", gate.port), key), Relay(("127.0.0.1", gate.port), b"x" * 32, connect_wait_s=1)
    try:
        client = dist.TCPStore("127.0.0.1", good.port, is_master=False, timeout=timedelta(seconds=10))
        assert client.get("k") == b"v"
        client.set("from-relay", "1")
        assert store.get("from-relay") == b"1"
        with pytest.raises(Exception):  # noqa: B017 - torch raises its own DistNetworkError / RuntimeError
            dist.TCPStore("127.0.0.1", bad.port, is_master=False, timeout=timedelta(seconds=3)).get("k")
        assert gate.refused >= 1
    finally:
        for listener in (gate, good, bad):
            listener.close()
