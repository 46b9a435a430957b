"""Rank placement inside a Slurm job (issue 32 §5): which node hosts which ranks, from the links the job measured.

The batch script's steps before training (:mod:`.script`):

1. the probe: one task per node runs :mod:`~kuangchao_core.sched.probe_worker` under torchrun, as the node agents
   do (:mod:`~kuangchao_core.sched.node_probe`), each rank writing ``attempt_<n>/slurm/probe/ranks/rank_<r>.json``;
2. ``python -m kuangchao_core.sched.slurm.placement --share FILE`` on the batch host: the probe's report
   (:func:`~kuangchao_core.sched.node_probe.report_from_rank_files`) and the same placement as every other path
   (:func:`~kuangchao_core.sched.rank_placement.place_from_report`: the heaviest group kind innermost, nodes chained
   over their best measured links from the rendezvous node), written atomically to ``attempt_<n>/slurm/placement.json``.

Nodes are in the c10d rendezvous' order (by ``NodeAddr``, :func:`.commands.node_order`): node ``i`` runs torch ranks
``[i * nproc, (i + 1) * nproc)`` and the placement says which mesh rank each of them plays (``KC_RANK_MAP``).
A probe that failed or timed out leaves the job placed without measured links (the rendezvous order, ranks by the
traffic model) and says so — as a failed probe does on the node-agent path. The probe is skipped where measured links
cannot change the placement (:func:`wants_probe`).

The run directory is on storage every node sees (``docs/architecture.md``, "Slurm", §8): the node launchers read the
file the batch host wrote, and refuse to start without it (:func:`read_placement`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kuangchao_core.errors import CommError, WorkerFailed
from kuangchao_core.sched.rank_placement import RankPlacement, place_from_report, placement_sizes
from kuangchao_core.sched.slurm.script import slurm_dir
from kuangchao_core.sched.topology import DEFAULT_SIZES

#: how long the probe step may take before the job goes on without measured links
PROBE_TIMEOUT_S = 120.0
PROBE_ITERS = 5


def placement_path(run_dir: str | Path, attempt: int) -> Path:
    """``attempt_<n>/slurm/placement.json``: the placement the node launchers start their ranks with."""
    return slurm_dir(run_dir, attempt) / "placement.json"


def probe_dir(run_dir: str | Path, attempt: int) -> Path:
    """``attempt_<n>/slurm/probe/``: the probe's ranks' files (``ranks/``) and its launchers' logs (``nodes/``)."""
    return slurm_dir(run_dir, attempt) / "probe"


def wants_probe(cfg: Any) -> bool:
    """Whether the job measures its nodes' links: ``cluster.placement: topology`` and links that can change the
    placement — three nodes or more (the chain from the rendezvous node over two nodes is the same whatever the
    link), or GPU nodes (the device links order the slots inside a node)."""
    slurm = cfg.cluster.slurm
    return cfg.cluster.placement == "topology" and (int(slurm.nodes) >= 3 or bool(slurm.gpus_per_node))


def request(cfg: Any, traffic: dict[str, float], probe_port: int) -> dict[str, Any]:
    """What the placement step needs from the orchestrator (``share.json``'s ``placement``): the layout, the bytes
    per step of each group kind (``engine.traffic.group_traffic``), the mode and the probe's settings."""
    return {
        "mode": cfg.cluster.placement,
        "sizes": list(placement_sizes(cfg.parallel)),
        "traffic": {k: float(v) for k, v in traffic.items()},
        "probe": wants_probe(cfg),
        "probe_port": int(probe_port),
        "probe_timeout_s": PROBE_TIMEOUT_S,
        "probe_sizes": list(DEFAULT_SIZES),
        "probe_iters": PROBE_ITERS,
    }


def compute(share: dict[str, Any], order: list[tuple[str, str]], job_id: str = "") -> dict[str, Any]:
    """The placement record of the attempt ``share`` describes on the nodes ``order`` (``(name, NodeAddr)`` in the
    rendezvous' order), from the probe's files when it measured them."""
    spec, nproc = share["placement"], int(share["nproc"])
    names = [n for n, _ in order]
    report, warning = None, None
    if spec.get("probe"):
        ranks = probe_dir(share["run_dir"], share["attempt"]) / "ranks"
        sizes, iters = tuple(spec.get("probe_sizes") or DEFAULT_SIZES), int(spec.get("probe_iters", PROBE_ITERS))
        try:
            from kuangchao_core.sched.node_probe import report_from_rank_files

            report = report_from_rank_files(ranks, len(names) * nproc, sizes, iters)
            if sorted(report.nodes) != sorted(names):
                raise CommError(f"node probe measured {', '.join(report.nodes)}, not the job's {', '.join(names)}")
        except (OSError, ValueError, KeyError, CommError) as exc:
            report, warning = None, f"node probe failed ({exc}); ranks placed without measured links"
    placement = place_from_report(
        tuple(int(s) for s in spec["sizes"]), names, nproc, traffic=spec.get("traffic"), mode=spec["mode"],
        topology=report,
    )  # fmt: skip
    return {
        "attempt": int(share["attempt"]),
        "job_id": job_id,
        "nodes": [
            {"name": n, "address": a, "node_rank": i, "ranks": placement.ranks_of_node(i)}
            for i, (n, a) in enumerate(order)
        ],
        "placement": placement.to_dict(),
        "measured": report is not None,
        "warning": warning,
        "topology": report.to_dict() if report is not None else None,
    }


def write_placement(path: str | Path, record: dict[str, Any]) -> Path:
    """Write ``record`` to ``path`` atomically (a reader sees the whole file or none)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_placement(path: str | Path) -> dict[str, Any]:
    """The placement record at ``path``; ``WorkerFailed`` saying why when it is missing or unreadable."""
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        RankPlacement.from_dict(record["placement"])
        return record
    except FileNotFoundError:
        raise WorkerFailed(
            None,
            f"no placement file {path}: the job's placement step writes it on the batch host before this step, so "
            "the run directory (runs/ where kc train ran, or KC_RUNS_DIR) must be on storage every node shares",
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WorkerFailed(None, f"placement file {path} is unreadable: {type(exc).__name__}: {exc}") from None


def node_env(record: dict[str, Any], node: str, node_rank: int) -> dict[str, str]:
    """The workers' environment on ``node`` (rendezvous position ``node_rank``): ``KC_RANK_MAP`` (the mesh rank
    each torch rank plays, unless that is the identity) and ``KC_NODE_OF_RANK``. ``WorkerFailed`` when the record
    places other nodes at that position (it was written for another allocation)."""
    names = [n["name"] for n in record["nodes"]]
    if node_rank >= len(names) or names[node_rank] != node:
        raise WorkerFailed(
            None, f"the placement puts nodes {names} in rendezvous order; node {node} is at position {node_rank}"
        )
    return RankPlacement.from_dict(record["placement"]).env()


def describe(record: dict[str, Any]) -> str:
    """One line: the placement's mode, whether links were measured, and which node hosts which mesh ranks."""
    mode = record["placement"]["mode"]
    how = "measured links" if record["measured"] else "probe failed" if record.get("warning") else "links not probed"
    nodes = "; ".join(f"{n['name']} ({n['address']}): ranks {n['ranks']}" for n in record["nodes"])
    return f"placement of attempt {record['attempt']} ({mode}, {how}): {nodes}"


def main(argv: list[str] | None = None) -> int:
    """The placement step: ``--share FILE``; writes ``placement.json`` and says it (exit 1 when it cannot)."""
    from kuangchao_core.sched.slurm import commands

    parser = argparse.ArgumentParser(prog="kuangchao_core.sched.slurm.placement")
    parser.add_argument("--share", required=True)
    ns = parser.parse_args(argv)
    try:
        share = json.loads(Path(ns.share).read_text(encoding="utf-8"))
        env = commands.slurm_env()
        t0 = time.monotonic()
        order = commands.node_order(commands.hostnames(os.environ["SLURM_JOB_NODELIST"], env), env)
        record = compute(share, order, os.environ.get("SLURM_JOB_ID", ""))
        write_placement(placement_path(share["run_dir"], share["attempt"]), record)
    except Exception as exc:  # noqa: BLE001 - said in the job's output, the step's exit code stops the job
        print(f"kuangchao: placement failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    if record["warning"]:
        print(f"kuangchao: warning: {record['warning']}", flush=True)
    print(f"kuangchao: {describe(record)} [{time.monotonic() - t0:.1f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
