"""GPU versions of one node and whether the nodes agree (issue 44 item 5, SPEC OPS.1).

:func:`probe_gpu_versions` is what every node reports beside its other versions (the TCP doctor agent's answer,
a node agent's published facts): the CUDA its torch was built with, the NCCL torch loads when CUDA is available,
the NVIDIA driver (``nvidia-smi``, else ``/proc/driver/nvidia/version``) and the GPU names. A field a node does not
have is ``"none"`` and ``why`` says the reason.

:func:`gpu_agreement_checks` compares those dicts across nodes, one check line per field, naming the odd node(s)
and their values: CUDA or NCCL differing in major.minor is an error (NCCL's ranks must speak the same protocol; a
mixed job fails at init or hangs in its first collective), a different driver or GPU model a warning (a driver
runs every CUDA up to its own, so the job starts; a mixed fleet runs at its slowest node's pace and hides
node-specific bugs). :func:`nccl_smoke_skip` says why the NCCL all-reduce smoke across the nodes cannot run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from kuangchao_core.sched.doctor_report import Check

NONE = "none"
FIELDS = ("cuda", "nccl", "driver", "gpus")
PROC_DRIVER = Path("/proc/driver/nvidia/version")
_FIX_SAME = (
    "install the same CUDA build of torch (and so the same NCCL) on every node: one container image or lock file"
)


def read_driver_version(proc_file: Path = PROC_DRIVER, timeout_s: float = 10.0) -> tuple[str, str]:
    """``(driver version, "")``, or ``("none", why)`` when neither ``nvidia-smi`` nor ``proc_file`` names one."""
    smi = shutil.which("nvidia-smi")
    tried = []
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            found = sorted({line.strip() for line in out.stdout.splitlines() if line.strip()})
            if out.returncode == 0 and found:
                return ",".join(found), ""
            tried.append(f"nvidia-smi exited {out.returncode}: {(out.stderr or out.stdout).strip()[:200]}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            tried.append(f"nvidia-smi failed: {type(exc).__name__}: {exc}")
    else:
        tried.append("no nvidia-smi on PATH")
    try:
        text = proc_file.read_text(encoding="utf-8", errors="replace")
    except OSError:
        tried.append(f"no {proc_file} (no NVIDIA kernel driver loaded)")
        return NONE, "; ".join(tried)
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text) or re.search(
        r"\b(\d+\.\d+(?:\.\d+)?)\b", text
    )
    if found:
        return found.group(1), ""
    tried.append(f"{proc_file} names no version")
    return NONE, "; ".join(tried)


def probe_gpu_versions() -> dict[str, Any]:
    """This node's ``cuda``, ``nccl``, ``driver`` and ``gpus`` (names), each ``"none"`` with its reason in
    ``why`` where absent, and ``cuda_available``."""
    import torch

    why: dict[str, str] = {}
    out: dict[str, Any] = {"cuda": torch.version.cuda or NONE, "cuda_available": False}
    if torch.version.cuda is None:
        why["cuda"] = f"torch {torch.__version__} is built without CUDA"
    no_cuda = why.get("cuda", "")
    try:
        out["cuda_available"] = bool(torch.version.cuda) and torch.cuda.is_available()
        if torch.version.cuda and not out["cuda_available"]:
            no_cuda = f"torch.cuda.is_available() is False ({torch.cuda.device_count()} devices visible)"
    except Exception as exc:  # a broken driver must not crash the doctor
        no_cuda = f"torch.cuda failed: {type(exc).__name__}: {exc}"
    out["nccl"], out["gpus"] = NONE, NONE
    if out["cuda_available"]:
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as exc:  # noqa: BLE001 - a build without NCCL still runs Gloo
            why["nccl"] = f"torch.cuda.nccl.version() failed: {type(exc).__name__}: {exc}"
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    else:
        why["nccl"] = why["gpus"] = f"CUDA not available: {no_cuda}"
    out["driver"], driver_why = read_driver_version()
    if driver_why:
        why["driver"] = driver_why
    out["why"] = why
    return out


def _major_minor(value: str) -> str:
    parts = re.findall(r"\d+", value)
    return ".".join(parts[:2]) if parts else value


def _key(name: str, value: Any) -> str:
    """What must agree: major.minor of CUDA and NCCL, the whole driver version, the list of GPU names."""
    if value in (None, NONE):
        return NONE
    if name in ("cuda", "nccl"):
        return _major_minor(str(value))
    if name == "gpus":
        return ", ".join(sorted(set(value))) if isinstance(value, list) else str(value)
    return str(value)


def _shown(info: dict[str, Any], name: str) -> str:
    value = info.get(name, NONE)
    if value in (None, NONE):
        reason = (info.get("why") or {}).get(name)
        return f"none ({reason})" if reason else NONE
    if name == "gpus" and isinstance(value, list):
        return f"{len(value)} x " + ", ".join(sorted(set(value)))
    return str(value)


_CHECK = {"cuda": "gpu_cuda", "nccl": "gpu_nccl", "driver": "gpu_driver", "gpus": "gpu_model"}
_LABEL = {"cuda": "CUDA", "nccl": "NCCL", "driver": "NVIDIA driver", "gpus": "GPU model"}
_WHY = {
    "cuda": "every rank's NCCL needs the same CUDA major.minor; a mixed job fails at init or hangs",
    "nccl": "NCCL ranks of different major.minor versions fail at init or hang in their first collective",
    "driver": "warning: a driver runs every CUDA up to its own, so the job starts, but a mixed fleet hides "
    "node-specific bugs",
    "gpus": "warning: a synchronous job runs at its slowest GPU's pace",
}
_FIX = {
    "cuda": _FIX_SAME,
    "nccl": _FIX_SAME,
    "driver": "upgrade the odd node(s) to the same NVIDIA driver",
    "gpus": "place the job on nodes with one GPU model (cluster.nodes / the pool)",
}


def gpu_agreement_checks(per_node: dict[str, dict[str, Any] | None]) -> list[Check]:
    """One check per field (``gpu_cuda``, ``gpu_nccl``, ``gpu_driver``, ``gpu_model``) over ``per_node``
    (node -> :func:`probe_gpu_versions` dict; None for a node that reported none: an older agent).

    The largest group of equal values is the reference; every other node is named with its value. CUDA and NCCL
    failing to agree (major.minor, or one node without them) is an error; the driver and GPU model a warning."""
    known = {n: info for n, info in per_node.items() if info}
    silent = sorted(n for n, info in per_node.items() if not info)
    note = f"; not compared: {', '.join(silent)} (reports no GPU versions: an older kuangchao there)" if silent else ""
    checks = []
    for name in FIELDS:
        label = _LABEL[name]
        groups: dict[str, list[str]] = {}
        for node, info in known.items():
            groups.setdefault(_key(name, info.get(name, NONE)), []).append(node)
        if not groups:
            checks.append(Check(_CHECK[name], True, f"{label}: no node reported GPU versions{note}"))
            continue
        ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        ref_key, ref_nodes = ranked[0]
        ref_value = _shown(known[ref_nodes[0]], name)
        if len(ranked) == 1:
            what = f"{ref_value} on every node" if len(known) > 1 else f"{ref_value} on {ref_nodes[0]}"
            checks.append(Check(_CHECK[name], True, f"{label} {what} ({len(known)} compared){note}"))
            continue
        odd = "; ".join(f"{', '.join(sorted(nodes))}: {_shown(known[nodes[0]], name)}" for _, nodes in ranked[1:])
        detail = (
            f"{label} differs across nodes: {odd} (the other {len(ref_nodes)} node(s) "
            f"{', '.join(sorted(ref_nodes))}: {ref_value}) — {_WHY[name]}{note}"
        )
        error = name in ("cuda", "nccl")
        checks.append(Check(_CHECK[name], not error, detail, _FIX[name], warn=not error))
    return checks


def nccl_smoke_skip(per_node: dict[str, dict[str, Any] | None]) -> str | None:
    """Why an NCCL all-reduce across ``per_node`` cannot run (no node, a node without usable CUDA or NCCL, or
    CUDA/NCCL that disagree), or None when it can."""
    if not per_node:
        return "no nodes to run it on"
    lacking = []
    for node, info in sorted(per_node.items()):
        if not info:
            lacking.append(f"{node} (reports no GPU versions)")
        elif not info.get("cuda_available") or info.get("nccl") in (None, NONE):
            reason = (info.get("why") or {}).get("nccl") or "no NCCL"
            lacking.append(f"{node} ({reason})")
    if lacking:
        return f"no CUDA with NCCL on {'; '.join(lacking)}"
    failed = [c.name for c in gpu_agreement_checks(per_node) if not c.ok]
    if failed:
        return f"the nodes' {' and '.join(failed)} disagree (see those checks)"
    return None
