"""One node's task of a Slurm attempt: ``python -m kuangchao_core.sched.slurm.node --share FILE -- <torchrun …>``.

``srun`` starts this once per node. It reads the attempt's ``share.json`` (the workers' settings; nothing secret),
finds its own node (``SLURMD_NODENAME``) and rank among the allocation's nodes (the order the c10d rendezvous
gives: by ``NodeAddr``), reads the mesh ranks its slots play from the job's ``placement.json`` (:mod:`.placement`;
refused when missing: the run directory must be shared), waits for the node's token file that the orchestrator
writes once the job placed its ranks (``<run>/tokens/<node>/attempt_<n>.json``, 0600, read and deleted here), and
runs the torchrun line through the one launcher (:func:`~kuangchao_core.sched.launcher.run_workers`): each rank
gets its own tokens over the lifeline, never in an environment; rank heartbeats, the orchestrator's beat and stop file are watched as on a node agent.
Under ``attempt_<n>/nodes/<node>/`` it leaves ``agent.json`` (its beat while it runs), ``launcher.log``, ``logs/``
and ``result.json`` (:func:`~kuangchao_core.sched.node_share.reporting`, as a node agent does).
With ``--probe`` it runs the job's topology probe instead (the batch script's first step, :mod:`.placement`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kuangchao_core.errors import WorkerFailed
from kuangchao_core.sched.launch_spec import LaunchSpec
from kuangchao_core.sched.launcher import run_workers
from kuangchao_core.sched.node_share import (
    ENV_TOKEN_BUNDLE,
    node_dir,
    owner_beat_path,
    reporting,
    stop_path,
    take_token_bundle,
)
from kuangchao_core.sched.slurm import commands, placement


def token_file(run_dir: str | Path, node: str, attempt: int) -> Path:
    """Where the orchestrator puts ``node``'s tokens of ``attempt`` (see ``perm.issuance.node_token_env``)."""
    return Path(run_dir) / "tokens" / node / f"attempt_{int(attempt)}.json"


def _wait_for(path: Path, timeout_s: float, stop: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if stop.exists():
            raise WorkerFailed(None, f"stopped by the orchestrator ({stop.read_text().strip()})")
        if time.monotonic() > deadline:
            raise WorkerFailed(None, f"no token file {path} within {timeout_s:g} s (is the orchestrator running?)")
        time.sleep(0.2)


def where(env: dict[str, str] | None = None) -> tuple[str, list[tuple[str, str]], int]:
    """This task's node (``SLURMD_NODENAME``), the allocation's nodes in the rendezvous' order (``(name,
    NodeAddr)``, by address) and this node's position in it."""
    env = commands.slurm_env() if env is None else env
    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    order = commands.node_order(commands.hostnames(os.environ["SLURM_JOB_NODELIST"], env), env)
    names = [n for n, _ in order]
    if node not in names:
        raise WorkerFailed(None, f"node {node} is not among the job's nodes {names}")
    return node, order, names.index(node)


def run_node(share: dict[str, Any], command: list[str]) -> dict[str, Any]:
    """This node's ranks of the attempt ``share`` describes, to the end; writes ``result.json``."""
    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    run_dir, attempt = share["run_dir"], int(share["attempt"])
    out = node_dir(run_dir, attempt, node)
    out.mkdir(parents=True, exist_ok=True)
    stop = stop_path(run_dir, attempt)
    with reporting(out, 0.5) as done:
        node, order, node_rank = where()
        worker_env = {**os.environ, **share["env"], "KC_NODE": node}
        if share.get("placement"):  # the mesh ranks this node's slots play, as the job's placement step decided
            record = placement.read_placement(placement.placement_path(run_dir, attempt))
            worker_env.update(placement.node_env(record, node, node_rank))
        if share.get("tokens"):
            bundle = token_file(run_dir, node, attempt)
            _wait_for(bundle, float(share.get("token_wait_s", 300)), stop)
            worker_env = take_token_bundle({**worker_env, ENV_TOKEN_BUNDLE: str(bundle)})
        result = run_workers(
            LaunchSpec(
                "",
                [],
                nproc=int(share["nproc"]),
                env=worker_env,
                run_dir=Path(run_dir),
                heartbeat_timeout_s=share.get("heartbeat_timeout_s"),
                heartbeat_interval_s=float(share.get("heartbeat_interval_s", 1.0)),
                attempt=attempt,
                nnodes=len(order),
                node_rank=node_rank,
                master_addr=order[0][1],
                master_port=int(share["port"]),
                local_addr=order[node_rank][1],
                out_dir=out,
                stop_file=stop,
                owner_beat=owner_beat_path(run_dir, attempt),
                owner_lost_after_s=float(share.get("owner_lost_after_s", 10.0)),
                command=command,
            )
        )
        done.update(duration_s=result.duration_s, node_rank=node_rank)
    return {"ok": True, "node": node}


def run_probe(share: dict[str, Any], command: list[str]) -> None:
    """This node's ranks of the job's topology probe (``command``: torchrun of ``probe_worker``), bounded by the
    probe's timeout; the orchestrator's stop file and beat stop them as they stop training ranks."""
    node, order, node_rank = where()
    run_dir, attempt, spec = share["run_dir"], int(share["attempt"]), share["placement"]
    base = placement.probe_dir(run_dir, attempt)
    out = base / "nodes" / node
    out.mkdir(parents=True, exist_ok=True)
    run_workers(
        LaunchSpec(
            "",
            [],
            nproc=int(share["nproc"]),
            env={**os.environ, "KC_NODE": node, "OMP_NUM_THREADS": "1"},
            run_dir=base,
            attempt=attempt,
            nnodes=len(order),
            node_rank=node_rank,
            master_addr=order[0][1],
            master_port=int(spec["probe_port"]),
            local_addr=order[node_rank][1],
            out_dir=out,
            stop_file=stop_path(run_dir, attempt),
            owner_beat=owner_beat_path(run_dir, attempt),
            owner_lost_after_s=float(share.get("owner_lost_after_s", 10.0)),
            timeout_s=float(spec.get("probe_timeout_s", placement.PROBE_TIMEOUT_S)),
            command=command,
        )
    )


def main(argv: list[str] | None = None) -> int:
    """``--share FILE [--probe] -- <torchrun command>``; exit code 0 when every rank of this node succeeded."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m kuangchao_core.sched.slurm.node --share FILE -- <torchrun command>", file=sys.stderr)
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="kuangchao_core.sched.slurm.node")
    parser.add_argument("--share", required=True)
    parser.add_argument("--probe", action="store_true", help="run the job's topology probe, not its training")
    ns = parser.parse_args(argv[:cut])
    share = json.loads(Path(ns.share).read_text(encoding="utf-8"))
    try:
        (run_probe if ns.probe else run_node)(share, argv[cut + 1 :])
    except WorkerFailed as exc:
        what = "probe" if ns.probe else "node"
        print(f"kuangchao: {what} failed: rank {exc.rank}: {exc.cause}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
