"""Small helpers for the per-step metrics: memory in use and a step timer."""

from __future__ import annotations

import os

import torch


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
