"""Memory allocation through the HAL (SPEC L1.1, L1.4): a small pool and per-module allocation records.

``memory_alloc`` hands out tensors and records which module asked for how much in which region; ``memory_free``
returns a tensor's block to the pool, where an allocation of the same device, dtype and element count reuses
it (the pool keeps at most ``max_cached_bytes``). The records answer "who holds the memory?" when a device runs
out of it (``report()``, ``kc debug memory``). Tensors the caller drops without ``memory_free`` leave the
records when they are garbage-collected.

The engine's own buffers (gradient buckets, ZeRO's flat shards and bucket buffers, pipeline receive buffers) come from
the pool through :func:`pool_zeros` / :func:`pool_empty`. ``limit_bytes`` (the config's ``hal.memory_pool_size``) caps what the pool holds, live plus
cached: an allocation past it drops the cache, then raises :class:`HalOutOfMemory`, whose one message names the
top consumers — the rank's per-module records when the engine registered them (:func:`set_record_source`),
else the pool's own — and writes the memory report where :func:`set_oom_dump` points (issue 44).
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

DEFAULT_POOL_BYTES = 256 * 1024 * 1024  #: the most bytes of freed blocks the pool keeps for reuse
TOP_CONSUMERS = 5  #: how many consumers an out-of-memory message names


class HalOutOfMemory(KuangchaoError, MemoryError):
    """An allocation did not fit: the pool's cap (``hal.memory_pool_size``) or the device's memory."""


@dataclass
class _Record:
    module: str
    region: str
    nbytes: int
    key: tuple
    ptr: int  # the block's storage address (the engine's records count each storage once)
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

    def __init__(self, max_cached_bytes: int = DEFAULT_POOL_BYTES, limit_bytes: int | None = None) -> None:
        self.max_cached_bytes = int(max_cached_bytes)
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._cached_bytes = 0
        self._live_bytes = 0
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
            self._make_room(nbytes, module, region)
            block = torch.empty(numel, dtype=dtype, device=device)
        tensor = block.view(shape)
        rec = _Record(module, region, nbytes, key, block.untyped_storage().data_ptr(), block)
        tid = id(tensor)
        with self._lock:
            self._live_bytes += nbytes
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

    def _make_room(self, nbytes: int, module: str, region: str) -> None:
        """Raise HalOutOfMemory when ``nbytes`` more would pass ``limit_bytes`` (after dropping the cache)."""
        if self.limit_bytes is None or self._live_bytes + self._cached_bytes + nbytes <= self.limit_bytes:
            return
        self.release_unused()
        if self._live_bytes + nbytes > self.limit_bytes:
            raise out_of_memory(
                f"{module} ({region}) asked the HAL pool for {nbytes:,} B with {self._live_bytes:,} B of its "
                f"hal.memory_pool_size {self.limit_bytes:,} B in use"
            )

    def live_blocks(self) -> list[tuple[str, str, int, int]]:
        """``(module, region, bytes, storage address)`` of every live allocation."""
        with self._lock:
            return [(r.module, r.region, r.nbytes, r.ptr) for r in self._live.values()]

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
        self._live_bytes -= rec.nbytes
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
            if rec.block is not None and self._cached_bytes + rec.nbytes <= self.max_cached_bytes:  # within the cap
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

    @property
    def live_bytes(self) -> int:
        """Bytes of the pool's allocations not yet freed."""
        return self._live_bytes

    def report(self) -> dict:
        """``{"modules": {name: stats}, "regions": {name: live bytes}, "pool_cached_bytes", "pool_max_bytes"}``."""
        with self._lock:
            return {
                "modules": {m: vars(s).copy() for m, s in self._modules.items()},
                "regions": dict(self._regions),
                "pool_cached_bytes": self._cached_bytes,
                "pool_max_bytes": self.max_cached_bytes,
                "pool_live_bytes": self._live_bytes,
                "pool_limit_bytes": self.limit_bytes,
            }


POOL = MemoryPool()
_UNSET = object()
_hooks: dict[str, object] = {"records": None, "oom_dump": None}


def configure_pool(max_cached_bytes: int | None = None, limit_bytes=_UNSET) -> None:
    """Set how many freed bytes the pool keeps for reuse and, given, its cap ``limit_bytes`` (``hal.memory_pool_size``;
    None: no cap but the device's); extra cached blocks are dropped."""
    if max_cached_bytes is not None:
        POOL.max_cached_bytes = int(max_cached_bytes)
    if limit_bytes is not _UNSET:
        POOL.limit_bytes = None if limit_bytes is None else int(limit_bytes)
    if POOL.cached_bytes > POOL.max_cached_bytes:
        POOL.release_unused()


def pool_zeros(numel: int, dtype: torch.dtype, device: torch.device | str, module: str, region: str) -> torch.Tensor:
    """A zeroed flat tensor from the pool for the engine's own buffers, recorded under ``module``/``region``
    (not guarded: the engine's buffers are not a script's ``memory_alloc``)."""
    return POOL.alloc(int(numel), (int(numel),), dtype, torch.device(device), region, module).zero_()


def pool_empty(shape, dtype: torch.dtype, device: torch.device | str, module: str, region: str) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` from the pool for the engine's own buffers (as :func:`pool_zeros`)."""
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    return POOL.alloc(numel, shape, dtype, torch.device(device), region, module)


def set_record_source(source) -> None:
    """Register ``source() -> [{"module", "kind", "bytes"}, ...]``, the rank's per-module records (None: none)."""
    _hooks["records"] = source


def set_oom_dump(path: str | os.PathLike | None) -> None:
    """Where an out-of-memory writes this rank's memory report (None: nowhere)."""
    _hooks["oom_dump"] = path


def memory_records() -> list[dict]:
    """The per-module records (the registered source's), else the pool's live bytes per module and region."""
    source = _hooks["records"]
    if source is not None:
        for attempt in range(3):  # a dump thread may walk the optimizer's state while the step adds to it
            try:
                return source()
            except RuntimeError:
                if attempt == 2:
                    raise
    out: dict[tuple[str, str], int] = {}
    for module, region, nbytes, _ in POOL.live_blocks():
        out[(module, region)] = out.get((module, region), 0) + nbytes
    return [{"module": m, "kind": k, "bytes": b} for (m, k), b in out.items()]


def top_consumers(records: list[dict], n: int = TOP_CONSUMERS) -> str:
    """``"module kind N B, ..."`` for the ``n`` largest records."""
    top = sorted(records, key=lambda r: -r["bytes"])[:n]
    return ", ".join(f"{r['module']} {r['kind']} {r['bytes']:,} B" for r in top) or "no records"


def out_of_memory(what: str) -> HalOutOfMemory:
    """The out-of-memory error for ``what`` happened, naming the top consumers; writes the memory report first
    where :func:`set_oom_dump` pointed (a failed write is said in the message, never hides the error)."""
    try:
        records = memory_records()
    except Exception as exc:  # the records must not mask the out-of-memory itself
        records, what = [], f"{what} (records unavailable: {exc})"
    path = _hooks["oom_dump"]
    if path is not None:
        try:
            what += f"; memory report written to {write_memory_report(path, records)}"
        except OSError as exc:
            what += f"; memory report not written ({exc})"
    return HalOutOfMemory(f"out of memory: {what}; top consumers: {top_consumers(records)}")


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


def memory_report(records: list[dict] | None = None) -> dict:
    """The pool's allocation records (see ``MemoryPool.report``), the per-module ``records``
    (:func:`memory_records` when not given) with their sum, plus device runtime figures when known."""
    from kuangchao_core.hal.context import current_context

    rep = POOL.report()
    rep["records"] = memory_records() if records is None else records
    rep["records_bytes"] = sum(r["bytes"] for r in rep["records"])
    ctx = current_context()
    if ctx is not None and ctx.adapter is not None:
        allocated, reserved = ctx.adapter.memory_in_use(ctx.device)
        rep["device"] = {"name": ctx.name, "allocated_bytes": allocated, "reserved_bytes": reserved}
    return rep


def write_memory_report(path: str | os.PathLike, records: list[dict] | None = None) -> Path:
    """Write ``memory_report(records)`` as JSON, atomically (read by ``kc debug memory``)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(memory_report(records), indent=1))
    os.replace(tmp, p)
    return p
