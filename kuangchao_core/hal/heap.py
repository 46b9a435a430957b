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
