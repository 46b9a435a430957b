"""Shared pieces of the multi-host benchmarks: processes on the network-namespace bench, engine steps timed.

The bench (``tests/cluster/bench.py``: hosts as network namespaces on one bridge, each link shaped with tbf) needs
root. :func:`run_ranks` starts ``hosts × nproc`` processes, ``nproc`` inside each host, with the ``torch.distributed``
environment (rank, world, master on host 0, ``GLOO_SOCKET_IFNAME``) and returns each rank's output;
:func:`engine_step_times` runs the real engine worker for a config and returns rank 0's step times;
:func:`probe_bench` runs the node probe's worker on the bench and assembles its report.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster.bench import Bench, bench_unavailable  # noqa: E402

__all__ = ["Bench", "bench_unavailable", "engine_step_times", "probe_bench", "run_ranks", "spread"]


def run_ranks(
    bench: Bench,
    nproc: int,
    argv: list[str],
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
    slot_env: Any = None,
) -> list[str]:
    """Run ``argv`` as ``len(bench.hosts) × nproc`` ranks (torch rank = host × nproc + local); returns each
    rank's stdout (raises with the failing rank's stderr). ``slot_env(slot)`` adds per-slot variables."""
    world = len(bench.hosts) * nproc
    port = random.randint(20000, 40000)
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for slot in range(world):
            host = bench.hosts[slot // nproc]
            penv = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(ROOT),
                "RANK": str(slot),
                "LOCAL_RANK": str(slot % nproc),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": str(slot // nproc),
                "MASTER_ADDR": bench.hosts[0].address,
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": host.ifname,
                "KC_NODE": f"h{host.index}",
                **(env or {}),
                **(slot_env(slot) if slot_env else {}),
            }
            out = open(Path(tmp) / f"{slot}.out", "w")  # noqa: SIM115 - closed below
            err = open(Path(tmp) / f"{slot}.err", "w")  # noqa: SIM115
            procs.append((bench.popen(slot // nproc, argv, env=penv, stdout=out, stderr=err), out, err))
        results = []
        for slot, (proc, out, err) in enumerate(procs):
            try:
                proc.wait(timeout=timeout_s)
            finally:
                out.close()
                err.close()
            if proc.returncode != 0:
                for p, _, _ in procs:
                    if p.poll() is None:
                        p.kill()
                tail = (Path(tmp) / f"{slot}.err").read_text()[-3000:]
                raise RuntimeError(f"rank slot {slot} exited {proc.returncode}: {tail}")
            results.append((Path(tmp) / f"{slot}.out").read_text())
    return results


def spread(values: list[float]) -> dict[str, float]:
    """Median and the interquartile range of ``values`` (the benchmarks' spread)."""
    qs = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": qs[0], "q3": qs[2], "n": len(values)}


def _write_config(tmp: Path, name: str, model: dict, parallel: dict, steps: int) -> Path:
    cfg = {
        "task": {"name": name, "seed": 3},
        "model": model,
        "data": {"format": "synthetic", "seq_len": model.get("max_seq_len", 128), "prefetch": 2},
        "parallel": {"backend": "gloo", **parallel},
        "optimizer": {"lr": 1e-3},
        "train": {"steps": steps, "warmup_steps": 1, "device": "cpu", "log_interval": 1, "eval_interval": 10**6},
        "permission": {"mode": "trusted"},
        "checkpoint": {"dir": str(tmp / "ckpt"), "interval": 10**6, "keep_last": 1, "resume": "never"},
        "tracking": {"uri": f"sqlite:///{tmp / 'mlflow.db'}"},
        "logging": {"console": False},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return path


def engine_step_times(
    bench: Bench, nproc: int, model: dict, parallel: dict, steps: int = 6, placement: Any = None
) -> list[float]:
    """Seconds per optimizer step (rank 0's step events, the first two dropped) of the real engine worker on the
    bench; ``placement`` (a RankPlacement) renames the slots as a placed multi-node job does."""
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_config(Path(tmp), "bench", model, parallel, steps)
        env = {"KC_RUN_DIR": tmp}
        if placement is not None:
            env.update(placement.env())
        outs = run_ranks(
            bench, nproc, [sys.executable, "-m", "kuangchao_core.engine.worker", "--config", str(path)], env
        )
    times = []
    for out in outs:
        events = [json.loads(ln.split(" ", 1)[1]) for ln in out.splitlines() if ln.startswith("KC_EVENT ")]
        steps_seen = [e for e in events if e.get("event") == "step" and e.get("step_time_s") is not None]
        if steps_seen:
            times = [e["step_time_s"] for e in steps_seen][2:]
    if not times:
        raise RuntimeError("no step events with step_time_s in the workers' output")
    return times


def probe_bench(bench: Bench, nproc: int) -> dict[str, Any]:
    """The node probe's report (``TopologyReport.to_dict``) measured on the bench by the probe worker."""
    from kuangchao_core.sched.topology import DEFAULT_SIZES, assemble_report

    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(bench, nproc, [sys.executable, "-m", "kuangchao_core.sched.probe_worker", "--out", tmp])
        per_rank = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank_*.json"))]
    per_rank.sort(key=lambda d: d["rank"])
    report = assemble_report(per_rank, DEFAULT_SIZES, 5, [d["node"] for d in per_rank])
    report.flops_per_s = [float(d["flops_per_s"]) for d in per_rank]
    return report.to_dict()
