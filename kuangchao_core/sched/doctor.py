"""``kc doctor``: check that this machine and the configured cluster can run a job (SPEC OPS.1).

Each check gives ``name``, ``ok``, ``detail`` and, when it fails, a ``fix``. The checks:

- ``versions``: Python and torch versions here.
- ``cuda``: CUDA, cuDNN and NCCL versions when CUDA is available; fails only when the config asks for CUDA/NCCL
  and there is none.
- ``gloo``: a real two-process Gloo ``all_reduce`` over loopback, in fresh subprocesses, with a timeout.
- ``node:<host>``: each configured node answers a TCP connect on its doctor agent port.
- ``gpu_cuda``, ``gpu_nccl``, ``gpu_driver``, ``gpu_model`` (issue 44): each node's CUDA, NCCL, NVIDIA driver and
  GPU models, and whether they agree (``gpu_versions.py``: CUDA/NCCL major.minor an error, driver/model a warning).
- ``nccl_smoke``: one NCCL all-reduce across the nodes' GPUs, through the node agents or on this machine's GPUs;
  skipped with the reason where a node has no CUDA (``nccl_smoke.py``).
- ``version_agreement``: torch/CUDA/NCCL/Python versions reported by the reachable nodes agree with ours.
  A node reports its versions through a tiny TCP agent (``kc doctor --serve`` or
  ``python -m kuangchao_core.sched.doctor --serve``): it answers each connection with one JSON line.
  No ssh is needed. A node written ``host:port`` uses that port; others use ``KC_DOCTOR_PORT`` (29411).
  Local-only clusters pass trivially.
- ``checkpoint_storage``: a local ``checkpoint.dir`` accepts a write+fsync+delete of a probe file; an
  ``s3://bucket/prefix`` URI accepts ``head_bucket`` and a put/delete of a probe object (endpoint from
  ``checkpoint.endpoint_url`` or ``AWS_ENDPOINT_URL``, credentials from boto3's usual chain).
- ``mlflow``: a ``sqlite:`` or file store's directory is writable; an ``http(s)`` server answers ``GET /health``.
- ``prefect``: with ``PREFECT_API_URL`` set the server answers ``GET <api>/health``; otherwise the ephemeral
  API is used and the check passes.
- ``slurm_*`` (``cluster.mode: slurm``, or asked for): Slurm's commands, its controller, the partition, idle nodes
  or the expected wait (``kuangchao_core/sched/slurm/doctor_checks.py``).
"""

from __future__ import annotations

# The result types, the version agent and the service probes live in doctor_report, version_agent and
# service_checks; they are imported here so that ``kc doctor`` and its tests reach every check through one module.
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kuangchao_core.config.access import setting
from kuangchao_core.config.paths import machine_cache_dir
from kuangchao_core.obs.run_hooks import NO_HOOKS, RunHooks
from kuangchao_core.sched.doctor_report import Check, DoctorReport
from kuangchao_core.sched.gpu_versions import gpu_agreement_checks, probe_gpu_versions
from kuangchao_core.sched.launcher import free_port
from kuangchao_core.sched.nccl_smoke import cluster_smoke
from kuangchao_core.sched.node_checks import check_node_agents, check_nodes
from kuangchao_core.sched.service_checks import check_checkpoint_storage, check_mlflow, check_prefect
from kuangchao_core.sched.version_agent import (
    DEFAULT_AGENT_PORT,
    local_versions,
    serve_versions,
)

# ------------------------------------------------------------------------------------------------ checks


def check_versions() -> Check:
    """Python and torch versions."""
    v = local_versions()
    return Check("versions", True, f"python {v['python']}, torch {v['torch']} on {v['hostname']}")


def check_cuda(cfg: Any = None) -> Check:
    """CUDA/NCCL versions when CUDA is available; fail only when the config needs CUDA and it is absent."""
    v = local_versions()
    wants_cuda = setting(cfg, "train.device") == "cuda" or setting(cfg, "parallel.backend") == "nccl"
    if v["cuda_available"]:
        return Check(
            "cuda",
            True,
            f"CUDA {v['cuda']}, cuDNN {v['cudnn']}, NCCL {v['nccl']}, {v['gpus']} x {v.get('gpu_name', 'GPU')}",
        )
    if wants_cuda:
        why = v.get("cuda_error") or f"torch {v['torch']} built with CUDA {v['cuda']}, no usable GPU"
        return Check(
            "cuda",
            False,
            f"config asks for CUDA/NCCL but CUDA is not available ({why})",
            "install a CUDA build of torch and the NVIDIA driver, or set train.device: cpu and parallel.backend: gloo",
        )
    return Check("cuda", True, f"CUDA not available (CPU build or no GPU; torch CUDA {v['cuda']}); Gloo will be used")


_GLOO_PROBE = textwrap.dedent(
    """
    import sys, datetime
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(sys.argv[4])))
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    dist.destroy_process_group()
    print(repr(t.tolist()))
    """
)


def _gloo_memo() -> tuple[Path, str]:
    import torch

    base = machine_cache_dir()
    key = f"{socket.gethostname()}|{sys.executable}|{torch.__version__}"
    return base / "doctor-gloo.json", key


def recent_gloo_pass(max_age_s: float) -> Check | None:
    """The Gloo check as passed on this machine (same host, Python and torch) less than ``max_age_s`` ago."""
    if max_age_s <= 0:
        return None
    path, key = _gloo_memo()
    try:
        memo = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    age = time.time() - float(memo.get("time", 0))
    if memo.get("key") != key or not 0 <= age < max_age_s:
        return None
    return Check("gloo", True, f"passed {age:.0f} s ago on this machine with this Python and torch (not rerun)")


def _remember_gloo_pass() -> None:
    path, key = _gloo_memo()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "time": time.time()}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs the next run the check


def check_gloo(timeout_s: float = 60.0, world_size: int = 2) -> Check:
    """A real ``world_size``-process Gloo all_reduce over loopback."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GLOO_PROBE, str(r), str(world_size), str(port), str(timeout_s)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world_size)
    ]
    outs: list[tuple[int | None, str, str]] = []
    deadline = t0 + timeout_s
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            outs.append((p.returncode, out, err))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            for q in procs:
                q.communicate()
            return Check(
                "gloo",
                False,
                f"{world_size}-process Gloo all_reduce on 127.0.0.1:{port} did not finish in {timeout_s:.0f} s",
                "check that loopback TCP works and no firewall blocks local ports; set GLOO_SOCKET_IFNAME=lo",
                transient=True,  # a machine too loaded to finish in time may finish on the next try
            )
    expected = [float(world_size * (world_size + 1) // 2)] * 4
    for rank, (rc, out, err) in enumerate(outs):
        if rc != 0 or out.strip() != repr(expected):
            tail = (err.strip().splitlines() or ["no output"])[-1]
            return Check(
                "gloo",
                False,
                f"Gloo all_reduce failed on rank {rank} (exit {rc}): {tail}",
                "reinstall torch with distributed support; set GLOO_SOCKET_IFNAME to a working interface (lo)",
                transient="address already in use" in err.lower(),  # its free port taken meanwhile
            )
    return Check("gloo", True, f"{world_size}-process all_reduce ok in {time.monotonic() - t0:.1f} s")


def _guarded(name: str, fn: Callable[[], Any]) -> list[Check]:
    try:
        out = fn()
    except Exception as exc:  # a check that crashes is a failed check, never a crashed doctor
        return [Check(name, False, f"check raised {type(exc).__name__}: {exc}", "report this as a kc doctor bug")]
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _fresh_gloo(timeout_s: float) -> Check:
    early = _early_gloo.pop("thread", None)
    if early is not None:  # started by start_gloo_check: the same check, begun earlier
        early.join()
        if _early_gloo.get("timeout_s") == timeout_s and "check" in _early_gloo:
            return _early_gloo.pop("check")
    check = check_gloo(timeout_s)
    if check.ok:
        _remember_gloo_pass()
    return check


#: how long the flow's doctor accepts a Gloo check that passed on this machine (``reuse_gloo_s``)
FLOW_REUSE_GLOO_S = 600.0
_early_gloo: dict[str, Any] = {}


def start_gloo_check(timeout_s: float = 60.0, reuse_gloo_s: float = FLOW_REUSE_GLOO_S) -> bool:
    """Start the doctor's Gloo check now, in a thread (its processes import torch while this one does other work),
    unless one passed within ``reuse_gloo_s``; the next :func:`run_doctor` with the same ``gloo_timeout_s`` takes
    its result instead of running it again (``kc train`` starts it before it imports the flow). True if started."""
    import threading

    if recent_gloo_pass(reuse_gloo_s) is not None or "thread" in _early_gloo:
        return False

    def run() -> None:
        check = check_gloo(timeout_s)
        if check.ok:
            _remember_gloo_pass()
        _early_gloo["check"] = check

    _early_gloo.clear()
    _early_gloo["timeout_s"] = timeout_s
    _early_gloo["thread"] = thread = threading.Thread(target=run, name="kc-doctor-gloo", daemon=True)
    thread.start()
    return True


def run_doctor(
    cfg: Any = None,
    *,
    gloo_timeout_s: float = 60.0,
    skip: Sequence[str] = (),
    reuse_gloo_s: float = 0.0,
    slurm: bool | None = None,
    hooks: RunHooks = NO_HOOKS,
) -> DoctorReport:
    """Run every check against ``cfg`` (a ``JobConfig``, a similar object, or None for defaults).

    ``reuse_gloo_s`` > 0 accepts a Gloo check that passed on this machine (same Python and torch) that recently
    instead of running it again (the flow's doctor does, so back-to-back jobs do not pay for it; ``kc doctor``
    always runs it). ``slurm``: run the Slurm checks (group ``slurm``); None: when ``cluster.mode`` is ``slurm``.
    """
    t0 = time.monotonic()
    report = DoctorReport()

    gpu: dict[str, Any] = {}  # the nodes' GPU versions, and how to reach them, for the NCCL smoke

    def nodes() -> list[Check]:
        agents = check_node_agents(cfg, gpu_out=gpu)
        if agents is None:
            node_checks, agreement = check_nodes(cfg, gpu_out=gpu)
            agents = [*node_checks, agreement]
        return [*agents, *gpu_agreement_checks(gpu.get("per_node", {}))]

    steps: list[tuple[str, Callable[[], Any]]] = [
        ("versions", check_versions),
        ("cuda", lambda: check_cuda(cfg)),
        ("gloo", lambda: recent_gloo_pass(reuse_gloo_s) or _fresh_gloo(gloo_timeout_s)),
        ("nodes", nodes),
        ("nccl_smoke", lambda: cluster_smoke(gpu)),
        ("checkpoint_storage", lambda: check_checkpoint_storage(cfg)),
        ("mlflow", lambda: check_mlflow(cfg)),
        ("prefect", lambda: check_prefect(hooks=hooks)),
    ]
    if slurm or (slurm is None and setting(cfg, "cluster.mode", "local") == "slurm"):
        from kuangchao_core.sched.slurm.doctor_checks import slurm_checks

        steps.append(("slurm", lambda: slurm_checks(cfg)))
    if "nodes" in skip:  # the smoke runs on the nodes' probed GPUs: without the probe there is nothing to run on
        skip = (*skip, "nccl_smoke")
    for name, fn in steps:
        if name not in skip:
            report.checks.extend(_guarded(name, fn))
    report.elapsed_s = time.monotonic() - t0
    return report


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kuangchao_core.sched.doctor")
    ap.add_argument("--serve", action="store_true", help="run the version agent on this node")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=DEFAULT_AGENT_PORT)
    args = ap.parse_args(argv)
    if args.serve:
        print(f"kc doctor agent listening on {args.host}:{args.port}", flush=True)
        serve_versions(args.host, args.port)
        return 0
    report = run_doctor()
    print(json.dumps(report.to_dict(), indent=2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())


__all__ = [
    "DEFAULT_AGENT_PORT",
    "Check",
    "DoctorReport",
    "check_checkpoint_storage",
    "check_cuda",
    "check_gloo",
    "check_mlflow",
    "check_nodes",
    "check_prefect",
    "check_versions",
    "gpu_agreement_checks",
    "local_versions",
    "probe_gpu_versions",
    "run_doctor",
    "serve_versions",
]
