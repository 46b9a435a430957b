"""Multi-node jobs on real hosts (issue 10): node agents, static and dynamic clusters, a lost node survived.

The hosts are Linux network namespaces on one bridge with tbf-shaped links (``tests/cluster/bench.py``); a
Prefect server listens on the bridge address, each host runs ``kc node start`` (a Prefect worker of one process
work pool), and ``kc train`` runs from the root namespace, as a user would on a real cluster. Ranks inside a host
talk over its loopback, across hosts over the shaped link. One bench and one server serve the whole module.

Needs root (network namespaces); without it every test here fails with the reason (CI runs as root).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kuangchao_core.config import load_config
from kuangchao_core.sched.heartbeat import read_beat
from kuangchao_core.sched.lifeline import is_alive, wait_gone
from tests.cluster.bench import Bench, bench_unavailable
from tests.conftest_prefect import TINY, loss_history
from tests.listening import assert_store_gated
from tests.reference_runs import one_process_reference
from tests.tolerances import FP32_LOSS_REL

ROOT = Path(__file__).resolve().parent.parent
KC = str(Path(sys.executable).with_name("kc"))
PREFECT = str(Path(sys.executable).with_name("prefect"))
POOL = "kc-bench"
STEPS = 8
INTERVAL = 2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _wait(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what} did not happen within {timeout_s:g} s")


class Cluster:
    """The bench, its Prefect server and one node agent per host."""

    def __init__(self, tmp: Path, hosts: int = 3):
        self.tmp = tmp
        self.bench = Bench(hosts)
        self.env: dict[str, str] = {}
        self.server: subprocess.Popen | None = None
        self.agents: dict[int, subprocess.Popen] = {}

    def up(self) -> None:
        self.bench.up()
        port = self.bench.free_port()  # never a fixed one: another run may serve on this machine
        api = f"http://{self.bench.address}:{port}/api"
        self.env = {
            **os.environ,
            "PREFECT_API_URL": api,
            "PREFECT_HOME": str(self.tmp / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{self.tmp / 'prefect.db'}",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_HEARTBEAT_SECONDS": "2",
            "PREFECT_LOGGING_LEVEL": "WARNING",
            "KC_RUNS_DIR": str(self.tmp / "runs"),
            "KC_CACHE_DIR": str(self.tmp / "cache"),  # this bench's measured topology only
            "OMP_NUM_THREADS": "1",
        }
        self.env.pop("PREFECT_PROFILES_PATH", None)
        self.server = subprocess.Popen(
            [PREFECT, "server", "start", "--host", self.bench.address, "--port", str(port)],
            env=self.env,
            cwd=self.tmp,
            stdout=open(self.tmp / "server.log", "w"),  # noqa: SIM115 - the process owns it
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _wait(lambda: self._healthy(api), 120, "the Prefect server on the bridge answering /health")
        for host in self.bench.hosts:
            self.start_agent(host.index)
        _wait(lambda: len(self.live()) == len(self.bench.hosts), 120, "every node agent being live")

    @staticmethod
    def _healthy(api: str) -> bool:
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def start_agent(self, index: int) -> None:
        host = self.bench.hosts[index]
        argv = [
            KC,
            "node",
            "start",
            "--pool",
            POOL,
            "--name",
            f"h{index}",
            "--address",
            host.address,
            "--ifname",
            host.ifname,
            "--project-dir",
            str(ROOT),
        ]
        log = open(self.tmp / f"agent-h{index}.log", "w")  # noqa: SIM115 - the process owns it
        self.agents[index] = self.bench.popen(index, argv, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def nodes(self) -> list[dict]:
        out = subprocess.run(
            [KC, "node", "list", "--pool", POOL, "--json"], env=self.env, capture_output=True, text=True, timeout=60
        )
        return json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else []

    def live(self) -> list[str]:
        return [n["name"] for n in self.nodes() if n["live"]]

    def train(self, workdir: Path, overrides: list[str], timeout_s: float = 400) -> subprocess.CompletedProcess:
        argv = [KC, "train", "--config", TINY, "--json", *[a for o in overrides for a in ("--set", o)]]
        result = subprocess.run(
            argv,
            env={**self.env, "KC_RUNS_DIR": str(workdir / "runs")},
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        (workdir / "kc-train.log").write_text(result.stdout + "\n--- stderr ---\n" + result.stderr)
        return result

    def down(self) -> None:
        self.bench.down()
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, 9)
            self.server.wait(timeout=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = bench_unavailable()
    if why:
        pytest.fail(f"the multi-host bench cannot run here: {why}")
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.up()
        yield c
    finally:
        c.down()
        assert not c.bench.leftovers(), "the bench left namespaces or links behind"


def _overrides(workdir: Path, task: str, store: Path, **extra) -> list[str]:
    base = {
        "task.name": task,
        "train.steps": STEPS,
        "train.warmup_steps": 2,
        "train.log_interval": 1,
        "train.eval_interval": 1000,
        "checkpoint.interval": INTERVAL,
        "checkpoint.keep_last": 10,
        "checkpoint.dir": str(workdir / "ckpt"),
        "tracking.uri": f"sqlite:///{store / 'mlflow.db'}",  # one store for the module: migrated once
        "permission.audit_log": str(workdir / "audit"),
        "parallel.data_parallel_size": 2,
        "parallel.tensor_parallel_size": 2,
        "parallel.micro_batch_size": 2,
        "cluster.nproc_per_node": 2,
        "cluster.heartbeat_timeout_s": 4,
        "cluster.heartbeat_interval_s": 0.5,
        "cluster.max_restarts": 2,
        **extra,
    }
    return [f"{k}={v}" for k, v in base.items()]


def _static(*hosts: str) -> dict[str, str]:
    nodes = json.dumps([{"host": h, "gpus": 0, "role": "worker"} for h in hosts])
    return {"cluster.mode": "static", "cluster.nodes": nodes, "cluster.registry": f"prefect://{POOL}"}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """The module's MLflow store directory."""
    return tmp_path_factory.mktemp("cluster-mlflow")


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory, store) -> list[float]:
    """The dp2×tp2 job's losses from one process (same global batch: four micro-batches of 2 per step)."""
    tmp = tmp_path_factory.mktemp("cluster-ref")
    return one_process_reference(TINY, _overrides(tmp, "kc-cluster-ref", store), STEPS, 2)


def _start_train(cluster: Cluster, workdir: Path, overrides: list[str]) -> subprocess.Popen:
    """``kc train`` in the background, its output in files (a pipe nobody reads would block it)."""
    return subprocess.Popen(
        [KC, "train", "--config", TINY, "--json", *[a for o in overrides for a in ("--set", o)]],
        env={**cluster.env, "KC_RUNS_DIR": str(workdir / "runs")},
        cwd=workdir,
        stdout=open(workdir / "kc-train.out", "w"),  # noqa: SIM115 - the process owns it
        stderr=open(workdir / "kc-train.err", "w"),  # noqa: SIM115
        text=True,
    )


def _finish(proc: subprocess.Popen, workdir: Path, timeout_s: float = 400) -> subprocess.CompletedProcess:
    proc.wait(timeout=timeout_s)
    out, err = (workdir / "kc-train.out").read_text(), (workdir / "kc-train.err").read_text()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _summary(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-4000:])
    text = result.stdout
    decoder = json.JSONDecoder()
    starts = [i + 1 for i, c in enumerate(text) if c == "\n" and text[i + 1 : i + 2] == "{"]
    for start in reversed(starts):  # the summary comes last; JSON log lines come before it
        try:
            found, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(found, dict) and "mlflow_run_id" in found:
            return found
    raise AssertionError(f"no run summary in the output: {text[-2000:]}")


def _assert_losses(store: Path, summary: dict, reference: list[float]) -> None:
    uri = f"sqlite:///{store / 'mlflow.db'}"
    history = loss_history(uri, summary["mlflow_run_id"])
    assert [s for s, _ in history] == list(range(1, STEPS + 1)), "every step exactly once in MLflow"
    for (step, got), want in zip(history, reference, strict=True):
        assert abs(got - want) <= FP32_LOSS_REL * abs(want), (step, got, want)


def test_node_list_shows_every_host_with_its_facts(cluster):
    nodes = {n["name"]: n for n in cluster.nodes()}
    assert sorted(nodes) == ["h0", "h1", "h2"]
    for i, host in enumerate(cluster.bench.hosts):
        n = nodes[f"h{i}"]
        assert n["live"] and n["address"] == host.address and n["ifname"] == "eth0"
        assert n["device_kind"] == "cpu" and n["cpu_count"] >= 1 and n["torch"]
    table = subprocess.run([KC, "node", "list", "--pool", POOL], env=cluster.env, capture_output=True, text=True)
    assert "h0" in table.stdout and cluster.bench.hosts[2].address in table.stdout
    # kc recommend sizes its cluster from the live pool (three agents, their slots)
    slots = min(n["cpu_count"] for n in nodes.values())
    rec = subprocess.run(
        [KC, "recommend", "--pool", POOL, "--params", "1e8", "--gpu-memory-gb", "24"],
        env=cluster.env,
        capture_output=True,
        text=True,
    )
    assert f"cluster: 3 node(s) x {slots} GPUs" in rec.stdout, rec.stdout + rec.stderr


def test_static_node_without_agent_fails_before_any_rank(cluster, tmp_path, store):
    result = cluster.train(
        tmp_path, _overrides(tmp_path, "kc-cluster-down", store) + [f"{k}={v}" for k, v in _static("h0", "h9").items()]
    )
    assert result.returncode != 0
    assert "h9" in result.stdout + result.stderr and "no node agent" in result.stdout + result.stderr
    assert not list((tmp_path / "runs").glob("*/*/attempt_*")), "a rank was started"


def test_kill_9_of_the_orchestrator_stops_every_nodes_ranks(cluster, tmp_path, store):
    """Issue 26: the ranks of a static dp2×tp2 job on h0 and h1 (run by those hosts' agents) stop within 10 s of a
    ``kill -9`` of ``kc train`` on the orchestrator's machine: each agent's launcher sees the orchestrator's beat
    go silent and ends its ranks, so no rank goes on writing the lineage."""
    overrides = _overrides(tmp_path, "kc-cluster-orphan", store, **{"train.steps": 5000, **_static("h0", "h1")})
    proc = _start_train(cluster, tmp_path, overrides)
    try:
        beats = _wait(
            lambda: f if len(f := list(tmp_path.glob("runs/**/attempt_0/heartbeat/rank_*.hb"))) == 4 else None, 300, "4"
        )
        time.sleep(2.0)  # past the start: the ranks train
        pids = [b.pid for f in beats if (b := read_beat(f)) is not None]
        assert len(pids) == 4 and all(is_alive(p) for p in pids)
        assert_store_gated(tmp_path, pids, cluster.bench.hosts[0].address)  # issue 38 item 2
        proc.kill()
        proc.wait(timeout=10)
        killed = time.monotonic()
        alive = wait_gone(pids, 10.0)
        assert alive == [], f"ranks alive {time.monotonic() - killed:.1f} s after kill -9 of the orchestrator: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_dynamic_picks_two_of_three_probed_nodes_and_shrinks_when_one_is_lost(
    cluster, tmp_path, store, one_process_losses
):
    """Dynamic dp2×tp2 with cluster.elastic: the probe measures all three live hosts and the job takes two of them
    (equal links, no load: by name, h0 and h1), placed from the measured links. The spare h2 goes away, then h1 dies
    mid-run (a kill -9 of everything on it); with no node left to replace it the job resumes as dp1×tp2
    with doubled accumulation on h0 alone, and the loss sequence is the one-process one. (Choosing a spare node
    after a loss is ``choose_nodes(exclude=...)`` in tests/test_placement.py; a static cluster's missing agent is
    the test above.)

    Issue 27: with the default 60 s heartbeat limit, h1 is declared lost within 15 s of the kill (h0's ranks see
    their connections to h1 drop, h0's agent reports, h1's agent is silent), in one console line naming it, and
    neither torch's failure report nor a traceback reaches the console."""
    overrides = _overrides(
        tmp_path,
        "kc-cluster-dynamic",
        store,
        **{
            "cluster.mode": "dynamic",
            "cluster.registry": f"prefect://{POOL}",
            "cluster.elastic": "true",
            "cluster.heartbeat_timeout_s": 60,
        },
    )
    runs = tmp_path / "runs" / "kc-cluster-dynamic"
    ckpt = tmp_path / "ckpt" / "kc-cluster-dynamic"
    proc = _start_train(cluster, tmp_path, overrides)
    try:
        # the first attempt is placed long before its ranks train (they start on the agents): time to lose the spare
        _wait(lambda: list(runs.glob("*/placement.attempt_0.json")), 300, "the first attempt placed")
        assert cluster.bench.kill_host(2) > 0
        _wait(lambda: "h2" not in cluster.live(), 60, "the spare h2 no longer live", poll_s=2)
        _wait(lambda: list(ckpt.glob(f"*/step_{INTERVAL:08d}/manifest.json")), 300, "a checkpoint mid-run")
        assert cluster.bench.kill_host(1) > 0
        killed = time.monotonic()
        err = tmp_path / "kc-train.err"
        _wait(lambda: "node h1: lost" in err.read_text(), 60, "h1 declared lost", poll_s=0.1)
        took = time.monotonic() - killed
        result = _finish(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    (tmp_path / "lost-after.txt").write_text(f"{took:.1f}\n")
    assert took <= 15.0, f"h1 declared lost {took:.1f} s after it was killed"
    named = [line for line in result.stderr.splitlines() if "h1: lost" in line]
    assert len(named) == 1, named
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr[-4000:]
    summary = _summary(result)
    run_dir = Path(summary["run_dir"])
    assert len(list((run_dir / "probe" / "ranks").glob("rank_*.json"))) == 6  # 3 hosts x 2 ranks measured
    assert sorted(p.name for p in (run_dir / "attempt_0" / "nodes").iterdir()) == ["h0", "h1"]
    assert sorted(json.loads((run_dir / "placement.attempt_0.json").read_text())["placement"]["nodes"]) == ["h0", "h1"]
    assert summary["attempts"] == 2 and summary["restart_causes"][0].startswith("attempt 0: node h1: lost"), summary
    assert sorted(p.name for p in (run_dir / "attempt_1" / "nodes").iterdir()) == ["h0"]
    replanned = load_config(run_dir / "config.attempt_1.yaml")
    assert (replanned.parallel.data_parallel_size, replanned.parallel.gradient_accumulation_steps) == (1, 2)
    assert replanned.parallel.tensor_parallel_size == 2
    _assert_losses(store, summary, one_process_losses)
    _assert_probed_and_placed(store, summary, ["h0", "h1"])
    assert not list(runs.glob("*/tokens/*.store_key")), "each attempt's store key is removed when it ends"


def _assert_probed_and_placed(store: Path, summary: dict, nodes: list[str]) -> None:
    """The node agents measured the real links (loopback inside a host, the shaped link between hosts) and the
    attempt was placed from them: each TP group inside one host; both recorded with the run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    run_id = summary["mlflow_run_id"]
    topo = json.loads(Path(client.download_artifacts(run_id, "topology/topology.json")).read_text())
    assert set(nodes) <= set(topo["nodes"]) and topo["fingerprint"]
    i, j = (topo["nodes"].index(n) for n in nodes)
    bw = topo["node_bandwidth_gbps"]
    assert bw[i][j] < bw[i][i] / 2 and bw[i][j] < bw[j][j] / 2, bw  # the shaped link is the slow one
    assert bw[i][j] < 0.1, bw  # 400 Mbit/s = 0.05 GB/s: the tbf shaping, not loopback
    assert len(topo["flops_per_s"]) == 2 * len(topo["nodes"]) and min(topo["flops_per_s"]) > 0
    placed = json.loads(Path(client.download_artifacts(run_id, "placement/attempt_0.json")).read_text())
    assert placed["measured"] and placed["placement"]["mode"] == "topology"
    groups = {g: v for row in placed["links"] for g, v in row["groups"].items()}
    assert groups["tp[0,1]"]["crosses_nodes"] is False and groups["tp[2,3]"]["crosses_nodes"] is False
    assert groups["dp[0,2]"]["crosses_nodes"] is True  # DP, the lightest kind here, takes the slow link


_RENEW = (
    "import json, sys, urllib.request\n"
    "body = json.dumps({'token': sys.argv[2], 'module_id': 'worker-0'}).encode()\n"
    "req = urllib.request.Request(sys.argv[1] + '/renew', data=body,\n"
    "                             headers={'Content-Type': 'application/json'})\n"
    "print(json.loads(urllib.request.urlopen(req, timeout=5).read())['token'])\n"
)


def test_a_token_renews_from_another_host_at_the_orchestrators_bridge_address(cluster, tmp_path):
    """Workers on other hosts renew through the endpoint the launch task opens on the orchestrator's address towards
    the nodes; the same endpoint on loopback (the single-node default) is out of their reach (the control)."""
    from kuangchao_core.perm.authority import Authority
    from kuangchao_core.perm.runtime import RenewalServer
    from kuangchao_core.sched.nodes import route_address

    auth = Authority(tmp_path / "auth")
    token = auth.issue("worker-0", "trainer", "job-R", 0, interfaces=["all_reduce"], ttl_s=60)
    host = cluster.bench.hosts[0]
    here = route_address(host.address)
    assert here == cluster.bench.address  # the root namespace reaches the hosts over the bridge
    renew = [sys.executable, "-c", _RENEW]
    with RenewalServer(auth, "job-R", 0, host=here, ttl_s=30) as server:
        out = subprocess.run(host.command([*renew, server.address, token]), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert server.renewed == 1
    claims = auth.verifier("job-R").verify(out.stdout.strip(), subject="worker-0")
    assert claims.exp - claims.iat <= 30  # the renewed token, with the configured lifetime
    with RenewalServer(auth, "job-R", 0, ttl_s=30) as loopback:
        out = subprocess.run(
            host.command([*renew, loopback.address, token]), capture_output=True, text=True, timeout=60
        )
    assert out.returncode != 0 and loopback.renewed == 0
