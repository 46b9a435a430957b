"""Does a plan fit in its devices' memory? The per-rank estimate of ``engine.plan`` against what a rank can have.

:func:`device_memory` says how much memory one rank of the job may use, measured where the check runs:

- in a worker (a HAL device context exists, ``device_init`` ran): a CUDA/ROCm device's total memory; on the CPU
  the machine's available memory divided by the ranks sharing it (``LOCAL_WORLD_SIZE``, else
  ``cluster.nproc_per_node``, else the world size);
- before launch (``kc train``, the flow): only for ``cluster.mode: local``, where the workers will run on this
  machine. On the CPU: available memory / the job's ranks. For CUDA the driver does not initialise CUDA just to ask
  (it would hold a device context for the whole run); each worker checks its own device after ``device_init``.
  Static and dynamic clusters run elsewhere: their workers check.

Available CPU memory is ``MemAvailable`` of ``/proc/meminfo`` (else ``SC_AVPHYS_PAGES`` pages), lowered to what the
cgroup memory limit leaves, when there is one (limit minus the working set: usage less inactive file cache).

:func:`fit_problems` compares the largest rank's estimate (parameters, gradients, optimizer state, activations;
``engine.plan.rank_memory``) with that figure and returns one ``(path, message)`` problem with the numbers and
what to change when it does not fit; ``engine.plan.memory_problems`` puts the two together, and tests (and callers
that know better) pass the memory in instead of measuring.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = float(1 << 30)
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: a cgroup v1 limit at or above this is "no limit" (the kernel's default is close to 2**63)
_NO_LIMIT = 1 << 60

Errors = list[tuple[str, str]]


@dataclass(frozen=True)
class DeviceMemory:
    """The memory one rank may use: ``bytes_per_rank`` on ``device``, with how it was found (``source``)."""

    bytes_per_rank: float
    device: str
    source: str


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def meminfo_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, else free pages from ``sysconf``, else None."""
    try:
        for line in meminfo.read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cgroup_remaining_bytes(root: Path = CGROUP_ROOT) -> int | None:
    """What this process's cgroup memory limit still leaves (limit − usage + inactive file cache), or None.

    cgroup v2 (``memory.max``, ``memory.current``, ``memory.stat``) or v1 (``memory/memory.limit_in_bytes``…);
    None when there is no limit or no cgroup file system."""
    v2_limit = root / "memory.max"
    if v2_limit.exists():
        limit, usage = _read_int(v2_limit), _read_int(root / "memory.current")  # "max" reads as None: no limit
        cache = _stat_value(root / "memory.stat", "inactive_file")
    else:
        v1 = root / "memory"
        limit, usage = _read_int(v1 / "memory.limit_in_bytes"), _read_int(v1 / "memory.usage_in_bytes")
        cache = _stat_value(v1 / "memory.stat", "total_inactive_file")
    if limit is None or usage is None or limit >= _NO_LIMIT:
        return None
    return max(0, limit - max(0, usage - cache))


def cpu_available_bytes(cgroup_root: Path = CGROUP_ROOT) -> int | None:
    """Memory this machine can still give a new process: :func:`meminfo_available_bytes`, capped by the cgroup."""
    found = [n for n in (meminfo_available_bytes(), cgroup_remaining_bytes(cgroup_root)) if n is not None]
    return min(found) if found else None


def ranks_on_this_machine(cfg: Any, world_size: int | None = None) -> int:
    """Ranks of the job sharing this machine: ``LOCAL_WORLD_SIZE`` (torchrun), ``cluster.nproc_per_node``, the world."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) >= 1:
        return int(local)
    nproc = getattr(getattr(cfg, "cluster", None), "nproc_per_node", None)
    if nproc:
        return int(nproc)
    return int(world_size or cfg.parallel.world_size)


def _cpu_memory(ranks: int) -> DeviceMemory | None:
    available = cpu_available_bytes()
    if available is None:
        return None
    return DeviceMemory(
        available / ranks, "cpu", f"{_gib(available)} available, shared by {ranks} rank(s) on this machine"
    )


def device_memory(cfg: Any, world_size: int | None = None) -> DeviceMemory | None:
    """The memory one rank of ``cfg``'s job may use, measured here (module docstring), or None when unknown here."""
    from kuangchao_core.hal.context import current_context

    ctx = current_context()
    if ctx is not None:  # a worker after device_init: its own device
        if ctx.device.type == "cpu":
            return _cpu_memory(ranks_on_this_machine(cfg, world_size))
        return DeviceMemory(float(ctx.total_memory), f"{ctx.device} ({ctx.name})", "the device's total memory")
    if getattr(cfg.cluster, "mode", "local") != "local":
        return None
    kind = cfg.train.device
    if kind == "auto":
        import torch

        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind != "cpu":
        return None  # checked by each worker on its device (module docstring)
    return _cpu_memory(ranks_on_this_machine(cfg, world_size))


def _gib(n: float) -> str:
    """``n`` bytes in GiB: two decimals from 10 GiB up, four significant digits below (a tiny model's MiB show)."""
    g = n / GIB
    return f"{g:.2f} GiB" if g >= 10 else f"{g:.4g} GiB"


def _hint(par: Any) -> str:
    tp, pp, dp = par.tensor_parallel_size, par.pipeline_parallel_size, par.data_parallel_size
    ways = [f"raise tensor_parallel_size (now {tp}) or pipeline_parallel_size (now {pp}) to split the model"]
    if par.zero_stage < 2:
        shard = (
            f"set zero_stage 2 (now {par.zero_stage}) to shard gradients and optimizer state over data_parallel_size"
        )
        ways.append(f"{shard} (now {dp}{', so raise it too' if dp == 1 else ''})")
    ways.append(f"lower micro_batch_size (now {par.micro_batch_size}) to hold fewer activations")
    if tp > 1 and not getattr(par, "sequence_parallel", False):
        ways.append("set sequence_parallel true to split the norms' activations over tensor_parallel_size")
    cp = getattr(par, "context_parallel_size", 1)
    ways.append(f"raise context_parallel_size (now {cp}) to split each sequence (kc recommend finds the smallest)")
    return "; ".join(ways)


def fit_problems(par: Any, ranks: list[dict[str, Any]], memory: DeviceMemory) -> Errors:
    """``[("parallel", message)]`` when the largest of ``ranks`` (``engine.plan.rank_memory`` records) needs more
    than ``memory.bytes_per_rank``, with the numbers and what to change in ``par`` (the parallel section); else []."""
    worst = max(ranks, key=lambda r: r["memory_bytes"]["total"])
    mem = worst["memory_bytes"]
    if mem["total"] <= memory.bytes_per_rank:
        return []
    parts = ", ".join(
        f"{label} {_gib(mem[key])}"
        for label, key in (
            ("parameters", "params"),
            ("gradients", "grads"),
            ("optimizer state", "optimizer"),
            ("autocast casts", "autocast_casts"),
            ("activations", "activations_estimate"),
        )
    )
    return [
        (
            "parallel",
            f"the plan needs an estimated {_gib(mem['total'])} per rank (rank {worst['rank']}: {parts}) but "
            f"{memory.device} has {_gib(memory.bytes_per_rank)} per rank ({memory.source}); {_hint(par)}",
        )
    ]
