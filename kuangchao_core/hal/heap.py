"""How much of the C heap is in use: where CPU tensors live, so what a CPU job's activations cost can be measured
(the CUDA caching allocator answers the same on a GPU with ``torch.cuda.memory_allocated``)."""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def heap_in_use_bytes() -> int | None:
    """Bytes the C heap has handed out and not taken back (glibc ``mallinfo2``: arena blocks in use plus mmapped
    blocks), where CPU tensors live; None where glibc's ``mallinfo2`` is not available."""
    import ctypes

    class _MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return None
    fn.restype = _MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)


def peak_tensor_bytes(fn: Any) -> tuple[int, Any]:
    """Run ``fn()`` and return ``(peak, result)``: the most bytes that tensors allocated during the call held at
    once (every CPU allocator allocation and free, in order, as ``torch.profiler`` with ``profile_memory`` records
    them; tensors that existed before the call do not count, those still alive after it do). Raises RuntimeError
    when the profiler recorded no allocation, so a broken measurement cannot read as zero bytes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    if not events:
        raise RuntimeError("torch.profiler recorded no memory events; cannot measure peak bytes")
    held = peak = 0
    for event in events:
        held += int(event.nbytes())
        peak = max(peak, held)
    return peak, result
