"""Memory allocation through the HAL (SPEC L1.1, L1.4): a small pool and per-module allocation records.

``memory_alloc`` hands out tensors and records which module asked for how much in which region; ``memory_free``
returns a tensor's block to the pool, where an allocation of the same device, dtype and element count reuses
it (the pool keeps at most ``max_cached_bytes``). The records answer "who holds the memory?" when a device runs
out of it (``report()``, ``kc debug memory``). Tensors the caller drops without ``memory_free`` leave the
records when they are garbage-collected.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from kuangchao_core import guard_api
from kuangchao_core.errors import KuangchaoError

DEFAULT_POOL_BYTES = int(os.environ.get("KC_MEMORY_POOL_SIZE", 256 * 1024 * 1024))


@dataclass
class _Record:
    module: str
    region: str
    nbytes: int
    key: tuple
    block: torch.Tensor | None  # the flat block backing the tensor (returned to the pool on free)
    finalizer: weakref.finalize | None = None


@dataclass
class ModuleStats:
    """Allocation figures of one module."""

    live_bytes: int = 0
    live_count: int = 0
    peak_bytes: int = 0
    allocs: int = 0
    frees: int = 0
    reused: int = 0


class MemoryPool:
    """Exact-size block reuse plus per-module, per-region allocation records (thread-safe)."""

    def __init__(self, max_cached_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self.max_cached_bytes = int(max_cached_bytes)
        self._lock = threading.Lock()
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._cached_bytes = 0
        self._live: dict[int, _Record] = {}  # id(tensor) -> record
        self._modules: dict[str, ModuleStats] = {}
        self._regions: dict[str, int] = {}

    def alloc(self, numel: int, shape, dtype: torch.dtype, device: torch.device, region: str, module: str):
        """A tensor of ``shape`` (uninitialised, like ``torch.empty``), recorded under ``module``/``region``."""
        key = (str(device), dtype, numel)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            stack = self._free.get(key)
            block = stack.pop() if stack else None
            if block is not None:
                self._cached_bytes -= nbytes
        reused = block is not None
        if block is None:
            block = torch.empty(numel, dtype=dtype, device=device)
        tensor = block.view(shape)
        rec = _Record(module, region, nbytes, key, block)
        tid = id(tensor)
        with self._lock:
            self._live[tid] = rec
            st = self._modules.setdefault(module, ModuleStats())
            st.allocs += 1
            st.reused += int(reused)
            st.live_count += 1
            st.live_bytes += nbytes
            st.peak_bytes = max(st.peak_bytes, st.live_bytes)
            self._regions[region] = self._regions.get(region, 0) + nbytes
        rec.finalizer = weakref.finalize(tensor, self._forget, tid, rec)
        return tensor

    def record_of(self, tensor: torch.Tensor) -> _Record | None:
        """The allocation record of ``tensor`` if the HAL allocated it and it is live."""
        with self._lock:
            return self._live.get(id(tensor))

    def _forget(self, tid: int, rec: _Record) -> None:
        """Drop a record (the tensor was garbage-collected without memory_free)."""
        with self._lock:
            if self._live.get(tid) is rec:
                del self._live[tid]
                self._account_free(rec)
        rec.block = None

    def _account_free(self, rec: _Record) -> None:
        st = self._modules[rec.module]
        st.frees += 1
        st.live_count -= 1
        st.live_bytes -= rec.nbytes
        self._regions[rec.region] -= rec.nbytes

    def free(self, tensor: torch.Tensor) -> None:
        """Release ``tensor``; its block goes back to the pool if there is room. Do not use ``tensor`` after."""
        tid = id(tensor)
        with self._lock:
            rec = self._live.pop(tid, None)
            if rec is None:
                raise KuangchaoError(
                    "memory_free: this tensor was not allocated by memory_alloc or was already freed; "
                    "free only tensors returned by memory_alloc, once"
                )
            self._account_free(rec)
            if rec.block is not None and self._cached_bytes + rec.nbytes <= self.max_cached_bytes:
                self._free.setdefault(rec.key, []).append(rec.block)
                self._cached_bytes += rec.nbytes
        if rec.finalizer is not None:
            rec.finalizer.detach()
        rec.block = None

    def release_unused(self) -> int:
        """Drop every cached block; returns the bytes released from the pool."""
        with self._lock:
            released = self._cached_bytes
            self._free.clear()
            self._cached_bytes = 0
        return released

    @property
    def cached_bytes(self) -> int:
        """Bytes held in the pool for reuse."""
        return self._cached_bytes

    def report(self) -> dict:
        """``{"modules": {name: stats}, "regions": {name: live bytes}, "pool_cached_bytes", "pool_max_bytes"}``."""
        with self._lock:
            return {
                "modules": {m: vars(s).copy() for m, s in self._modules.items()},
                "regions": dict(self._regions),
                "pool_cached_bytes": self._cached_bytes,
                "pool_max_bytes": self.max_cached_bytes,
            }


POOL = MemoryPool()


def configure_pool(max_cached_bytes: int) -> None:
    """Set the pool's capacity (``memory_pool_size``); extra cached blocks are dropped."""
    POOL.max_cached_bytes = int(max_cached_bytes)
    if POOL.cached_bytes > POOL.max_cached_bytes:
        POOL.release_unused()


def memory_alloc(
    shape_or_nbytes,
    dtype: torch.dtype | None = None,
    region: str = "default",
    module: str = "unknown",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Allocate an uninitialised tensor through the HAL pool.

    ``shape_or_nbytes``: an int is a byte count (``dtype`` defaults to uint8 and must divide it), a tuple/list/
    ``torch.Size`` is a shape (``dtype`` defaults to float32). ``region`` names the memory region (guarded as
    ``memory:<region>``), ``module`` the owner in the allocation records. ``device`` defaults to this process's
    device (``device_init``) or the CPU.
    """
    guard_api.check("memory_alloc", f"memory:{region}")
    if isinstance(shape_or_nbytes, int):
        dtype = dtype or torch.uint8
        item = torch.empty((), dtype=dtype).element_size()
        if shape_or_nbytes < 0 or shape_or_nbytes % item:
            raise KuangchaoError(
                f"memory_alloc: {shape_or_nbytes} bytes is not a non-negative multiple of {dtype}'s {item}-byte "
                "element size; pass a shape or a matching byte count"
            )
        shape = (shape_or_nbytes // item,)
    else:
        dtype = dtype or torch.float32
        shape = tuple(int(s) for s in shape_or_nbytes)
    numel = 1
    for s in shape:
        numel *= s
    if device is None:
        from kuangchao_core.hal.context import current_context

        ctx = current_context()
        device = ctx.device if ctx is not None else torch.device("cpu")
    return POOL.alloc(numel, shape, dtype, torch.device(device), region, module)


def memory_free(tensor: torch.Tensor) -> None:
    """Free a tensor from ``memory_alloc`` (guarded as ``memory_free`` on ``memory:<its region>``)."""
    rec = POOL.record_of(tensor)
    region = rec.region if rec is not None else "unknown"
    guard_api.check("memory_free", f"memory:{region}")
    POOL.free(tensor)


def release_unused() -> int:
    """Return unused memory: empties the HAL pool and the device runtime's cache; returns pool bytes released."""
    released = POOL.release_unused()
    from kuangchao_core.hal.context import current_context

    ctx = current_context()
    if ctx is not None and ctx.adapter is not None:
        ctx.adapter.empty_cache()
    return released


def memory_report() -> dict:
    """The pool's allocation records (see ``MemoryPool.report``), plus device runtime figures when known."""
    from kuangchao_core.hal.context import current_context

    rep = POOL.report()
    ctx = current_context()
    if ctx is not None and ctx.adapter is not None:
        allocated, reserved = ctx.adapter.memory_in_use(ctx.device)
        rep["device"] = {"name": ctx.name, "allocated_bytes": allocated, "reserved_bytes": reserved}
    return rep


def write_memory_report(path: str | os.PathLike) -> Path:
    """Write ``memory_report()`` as JSON (read by ``kc debug memory``)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(memory_report(), indent=1))
    return p
