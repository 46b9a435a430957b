"""Small helpers for the per-step metrics: memory in use, named for what it is."""

from __future__ import annotations

import os

import torch


def memory_kind(device: torch.device) -> str:
    """What :func:`memory_bytes` measures on ``device``: ``cuda_peak`` (peak allocated tensor bytes) or ``rss``
    (the whole process: tensors plus the Python runtime and libraries)."""
    return "cuda_peak" if device.type == "cuda" and torch.cuda.is_available() else "rss"


def tensor_bytes(model: torch.nn.Module, sync) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state (what ``kc plan`` estimates); ``sync``
    is the job's :class:`~kuangchao_core.parallel.grad_sync.GradSync`."""
    report = getattr(sync, "memory_report", None)
    if callable(report):  # ZeRO knows its flat buffers and shards; a LoRA base it does not hold is frozen
        measured = report()["measured"]
        frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
        return {
            "params": measured["params"] + frozen,
            "grads": measured["grads"],
            "optimizer": measured["optimizer_state"],
        }
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    optim = sum(t.numel() * t.element_size() for t in sync.state_tensors())
    return {"params": params, "grads": grads, "optimizer": optim}


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
