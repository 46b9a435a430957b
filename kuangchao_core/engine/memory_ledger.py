"""Per-module memory records of one rank (issue 44 item 3): who holds the bytes, for ``kc debug memory`` and for the
message an out-of-memory ends the job with.

A record is ``{"module", "kind", "bytes"}``. Kinds: ``params``, ``grads`` and ``buffers`` of each block of the
model (an element of a ``ModuleList`` — a decoder layer — or a module holding parameters itself: the embedding, the
final norm, the head); the optimizer's ``optimizer_state`` (AdamW's moments, one record: the GradSync does not say
whose they are) and ``master_params``; compression's error feedback as ``comm comm_buffers``; ``activations``, what
a block's forward saved for its backward and its output while that lives (counted through ``saved_tensors_hooks`` while the step's forward-backward
runs, each saved storage until autograd lets it go; what the step saves outside every block — the loss over the
logits — goes to ``(outside blocks)``; hooks active before the block's — a checkpointed layer's, the sequence-parallel
regather's — keep deciding what is saved, and what they keep in their own form is not counted: selective
checkpointing's kept matmul outputs, the regather's shards); and the HAL pool's allocations under their own module and region
(``dp.grad_buckets grads``, ``zero.flat_params params``, ``zero.grad_buckets comm_buffers``: the engine's buffers)
plus its cached blocks. Every storage is counted once, the pool's first: a parameter that is a view of ZeRO's flat
buffer is in ``zero.flat_params``.

On CUDA the bytes come from the caching allocator's own snapshot (``torch.cuda.memory_snapshot()``): every active
block is named by the storage the records know at its address, and the blocks none of them owns are listed as
``(unattributed)``. (That path runs only on a GPU; CI checks the CPU path, where the bytes are the storages'.)
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kuangchao_core.hal import memory as hal_memory

OUTSIDE = "(outside blocks)"
POOL_CACHE = ("hal.pool", "cached")
#: a pool region -> the record kind it is
REGION_KINDS = {"params": "params", "grads": "grads", "optim": "optimizer_state", "comm": "comm_buffers"}


def model_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The blocks records are kept for: each ``ModuleList`` element, and each other module that holds parameters
    or buffers itself (not inside a block already), with their dotted names."""
    out: list[tuple[str, torch.nn.Module]] = []

    def walk(name: str, mod: torch.nn.Module) -> None:
        if isinstance(mod, torch.nn.ModuleList):
            out.extend((f"{name}.{i}" if name else str(i), child) for i, child in enumerate(mod))
            return
        if next(mod.parameters(recurse=False), None) is not None or next(mod.buffers(recurse=False), None) is not None:
            out.append((name or "(model)", mod))
            return
        for child_name, child in mod.named_children():
            walk(f"{name}.{child_name}" if name else child_name, child)

    walk("", model)
    return out


class _Saved:
    """What autograd keeps for a saved tensor while activations are tracked: what the hooks active before ours made
    of it (the tensor itself when there were none), and, when that is the tensor, its share of its storage's
    count (released when autograd drops it)."""

    __slots__ = ("__weakref__", "ledger", "packed", "ptr")

    def __init__(self, ledger: MemoryLedger | None, ptr: int, packed: Any) -> None:
        self.ledger, self.ptr, self.packed = ledger, ptr, packed

    def __del__(self) -> None:
        if self.ledger is not None:
            self.ledger._release(self.ptr)


class MemoryLedger:
    """The records of one rank: ``model``'s blocks, ``sync``'s optimizer state (a GradSync), the HAL pool's
    buffers, and activations saved inside :meth:`tracking`. :meth:`install` makes them the HAL's record source."""

    def __init__(self, model: torch.nn.Module, sync: Any = None, track_activations: bool = True) -> None:
        self.model = model
        self.sync = sync
        self.blocks = model_blocks(model)
        self.owner = {id(p): name for name, mod in self.blocks for p in mod.parameters()}
        self._lock = threading.Lock()
        self._saved: dict[int, list] = {}  # storage address -> [saves alive, bytes, block]
        self._live: dict[str, int] = {}  # per block: bytes of its saved storages alive now
        self.peaks: dict[str, int] = {}  # per block: the most it held at once in the last tracked step
        self._tracking_now = False
        self._where = threading.local()
        self._handles = []
        if track_activations:
            for name, mod in self.blocks:
                self._handles.append(mod.register_forward_pre_hook(self._enter(name)))
                self._handles.append(mod.register_forward_hook(self._leave(name), always_call=True))

    # ------------------------------------------------------------------ activations
    def _hold(self, t: torch.Tensor, block: str) -> int:
        """Count ``t``'s storage under ``block`` once more; returns its address (for :meth:`_release`)."""
        st = t.untyped_storage()
        ptr = st.data_ptr()
        with self._lock:
            entry = self._saved.setdefault(ptr, [0, st.nbytes(), block])
            entry[0] += 1
            if entry[0] == 1:
                live = self._live[block] = self._live.get(block, 0) + entry[1]
                self.peaks[block] = max(self.peaks.get(block, 0), live)
        return ptr

    def _hooks(self, block: str) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks counting what ``block`` saves, run over the hooks active before them (a checkpointed layer's, the
        sequence-parallel regather's): those still decide what is kept, and a tensor they replace is not counted."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is not None and getattr(outer[0], "_kc_ledger", False):
            outer = None  # our own (the step's, or an enclosing block's): the inner block counts
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t: torch.Tensor) -> Any:
            packed = outer_pack(t) if outer_pack is not None else t
            if packed is not t or t.device.type == "meta":
                return _Saved(None, 0, packed)
            return _Saved(self, self._hold(t, block), packed)

        def unpack(h: Any) -> Any:
            packed = h.packed if isinstance(h, _Saved) else h
            return outer_unpack(packed) if outer_unpack is not None else packed

        pack._kc_ledger = True
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _release(self, ptr: int) -> None:
        with self._lock:
            entry = self._saved.get(ptr)
            if entry is not None:
                entry[0] -= 1
                if entry[0] <= 0:
                    del self._saved[ptr]
                    self._live[entry[2]] -= entry[1]

    def _enter(self, block: str) -> Callable:
        def pre(_mod, _args) -> None:
            stack = self._where.__dict__.setdefault("stack", [])
            if not getattr(self._where, "on", False):
                stack.append(None)
                return
            ctx = self._hooks(block)
            ctx.__enter__()
            stack.append(ctx)

        return pre

    def _leave(self, block: str) -> Callable:
        def post(_mod, _args, out) -> None:
            stack = self._where.__dict__.get("stack") or [None]
            ctx = stack.pop()
            if ctx is None:
                return
            ctx.__exit__(None, None, None)
            for t in out if isinstance(out, tuple | list) else (out,):  # the block's output, while it lives
                if torch.is_tensor(t) and t.device.type != "meta":
                    weakref.finalize(t, self._release, self._hold(t, block))

        return post

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Count what the forwards inside save for their backwards (per block; the rest as ``(outside blocks)``)."""
        previous = getattr(self._where, "on", False)
        self._where.on = True
        if not previous:
            with self._lock:
                self.peaks = {}
            self._tracking_now = True
        try:
            with self._hooks(OUTSIDE):
                yield
        finally:
            self._where.on = previous
            self._tracking_now = previous

    def wrap(self, step: Callable, every: int = 1) -> Callable:
        """``step`` (a forward-backward function) run inside :meth:`tracking` on its first call and every
        ``every``-th after: the hooks cost ~9 % of a tiny model's step, and at a fixed shape a step saves what the
        one before saved; between tracked steps the records hold each block's peak of the last tracked one."""
        calls = itertools.count()

        def tracked(*args: Any, **kwargs: Any) -> Any:
            if next(calls) % every:
                return step(*args, **kwargs)
            with self.tracking():
                return step(*args, **kwargs)

        return tracked

    # ------------------------------------------------------------------ records
    def storages(self) -> list[tuple[str, str, int, int]]:
        """``(module, kind, bytes, storage address)``, each storage once (the pool's first, then parameters,
        gradients, buffers, optimizer state and master copies, activations)."""
        out: list[tuple[str, str, int, int]] = []
        seen: set[int] = set()

        def take(module: str, kind: str, t: torch.Tensor | None) -> None:
            if t is None or t.device.type == "meta":
                return
            st = t.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
            if nbytes and ptr not in seen:
                seen.add(ptr)
                out.append((module, kind, nbytes, ptr))

        for module, region, nbytes, ptr in hal_memory.POOL.live_blocks():
            if ptr not in seen:
                seen.add(ptr)
                out.append((module, REGION_KINDS.get(region, region), nbytes, ptr))
        for kind in ("params", "grads", "buffers"):
            for name, mod in self.blocks:
                for t in mod.buffers() if kind == "buffers" else mod.parameters():
                    take(name, kind, t.grad if kind == "grads" else t)
        if self.sync is not None:  # the GradSync's own surface (tests/test_grad_sync_seam.py: no probing)
            for v in self.sync.state_tensors():
                take("optimizer", "optimizer_state", v)
            for group in self.sync.param_groups:
                for p in group["params"]:  # fp32 masters of bf16 parameters; ZeRO's chunks are the pool's already
                    take("optimizer", "master_params", p)
                    take("optimizer", "master_grads", p.grad)
            for v in self.sync.comm_state_tensors().values():  # compression's error feedback
                take("comm", "comm_buffers", v)
        with self._lock:
            saved = [(ptr, e[1], e[2]) for ptr, e in self._saved.items()]
            peaks = dict(self.peaks) if not self._tracking_now else {}
        for ptr, nbytes, block in saved:
            if ptr not in seen:
                seen.add(ptr)
                out.append((block, "activations", nbytes, ptr))
        live = {block for _, _, block in saved}
        for block, nbytes in peaks.items():  # an untracked step: the last tracked step's, at no address
            if block not in live and nbytes:
                out.append((block, "activations_peak", nbytes, -1 - len(out)))
        return out

    def records(self) -> list[dict]:
        """The rank's records ``{"module", "kind", "bytes"}``, largest first (on CUDA from the allocator's
        snapshot, see the module's docstring)."""
        held = self.storages()
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        totals: dict[tuple[str, str], int] = {}
        if device.type == "cuda":  # the pool's cached blocks are among the allocator's unattributed ones
            totals = cuda_snapshot_totals({ptr: (m, k) for m, k, _, ptr in held}, device)
        else:
            for module, kind, nbytes, _ in held:
                totals[(module, kind)] = totals.get((module, kind), 0) + nbytes
            totals[POOL_CACHE] = hal_memory.POOL.cached_bytes
        rows = [{"module": m, "kind": k, "bytes": b} for (m, k), b in totals.items() if b]
        return sorted(rows, key=lambda r: -r["bytes"])

    def install(self) -> MemoryLedger:
        """Make these records the HAL's (``kc debug memory`` dumps, out-of-memory messages); returns self."""
        hal_memory.set_record_source(self.records)
        return self

    def close(self) -> None:
        """Remove the hooks and stop being the HAL's record source."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        hal_memory.set_record_source(None)


def cuda_snapshot_totals(owners: dict[int, tuple[str, str]], device: torch.device) -> dict[tuple[str, str], int]:
    """Bytes per (module, kind) from the CUDA caching allocator's snapshot of ``device``: each active block named
    by the storage at its address (``owners``), the rest ``(unattributed)``."""
    totals: dict[tuple[str, str], int] = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") != index:
            continue
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            key = owners.get(block["address"], ("(unattributed)", "cuda"))
            totals[key] = totals.get(key, 0) + int(block["size"])
    return totals
