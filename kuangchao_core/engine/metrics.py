"""Small helpers for the per-step metrics: memory in use, named for what it is (the tensors a rank holds are the
grad sync's own account: :meth:`~kuangchao_core.parallel.grad_sync.GradSync.tensor_bytes`).

On CUDA the figure is a peak, and a peak is only meaningful over a phase: the trainer calls :func:`start_phase` at
the start of every step, so a step's ``mem_bytes`` is that step's peak (activations, gradients, the optimizer's
update), not the largest since the process started (model build, the first step's compilation, an evaluation or
a checkpoint save between steps). On the CPU the figure is the resident set size, a current value: there is no
peak to reset and nothing changes. ``cuda`` (default ``torch.cuda``) is the allocator's statistics interface.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def memory_kind(device: torch.device) -> str:
    """What :func:`memory_bytes` measures on ``device``: ``cuda_peak`` (peak allocated tensor bytes) or ``rss``
    (the whole process: tensors plus the Python runtime and libraries)."""
    return "cuda_peak" if device.type == "cuda" and torch.cuda.is_available() else "rss"


def start_phase(device: torch.device, cuda: Any = None) -> None:
    """Start a phase whose peak :func:`memory_bytes` then reports: on CUDA the allocator's peak is reset to what is
    allocated now (``torch.cuda.reset_peak_memory_stats``); on the CPU nothing happens."""
    cuda = torch.cuda if cuda is None else cuda
    if device.type == "cuda" and cuda.is_available():
        cuda.reset_peak_memory_stats(device)


def memory_bytes(device: torch.device, cuda: Any = None) -> int:
    """Peak allocated bytes on a CUDA device since the last :func:`start_phase` (or the process's start), or the
    resident set size of this process on CPU."""
    cuda = torch.cuda if cuda is None else cuda
    if device.type == "cuda" and cuda.is_available():
        return int(cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            resident_pages = int(fh.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
