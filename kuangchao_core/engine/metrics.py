"""Small helpers for the per-step metrics: memory in use, named for what it is (the tensors a rank holds are the
grad sync's own account: :meth:`~kuangchao_core.parallel.grad_sync.GradSync.tensor_bytes`)."""

from __future__ import annotations

import os

import torch


def memory_kind(device: torch.device) -> str:
    """What :func:`memory_bytes` measures on ``device``: ``cuda_peak`` (peak allocated tensor bytes) or ``rss``
    (the whole process: tensors plus the Python runtime and libraries)."""
    return "cuda_peak" if device.type == "cuda" and torch.cuda.is_available() else "rss"


def memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a CUDA device, or the resident set size of this process on CPU."""
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            resident_pages = int(fh.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
