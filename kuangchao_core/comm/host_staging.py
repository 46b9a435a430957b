"""CUDA tensors on a Gloo device group, staged through host memory (several ranks on one GPU; issue 41 item 5).

NCCL refuses two ranks on one device, so a multi-rank job on a one-GPU machine (the GPU check's sections (e) and
(g)) runs its device groups on Gloo with CUDA tensors. Gloo's CUDA support covers only some operations: in
torch's ``ProcessGroupGloo.cpp`` ``allreduce``, ``broadcast``, ``reduce``, ``allgather``, ``gather``, ``scatter`` and
``alltoall_base`` copy CUDA tensors through pinned host memory themselves; ``allreduce_coalesced`` refuses them;
``allgather_coalesced`` / ``allgather_into_tensor_coalesced`` and ``send`` / ``recv`` (so ``batch_isend_irecv``) hand
the device pointer to Gloo's host transport unchecked; ``reduce_scatter``'s list form has changed across releases
(unsupported, then a CPU implementation). Rather than follow that table release by release, every primitive
(:mod:`kuangchao_core.comm.primitives`, :mod:`kuangchao_core.comm.p2p_batch`) on a Gloo device group given a CUDA
tensor runs here: its tensors are copied to host memory, the primitive runs on the copies (Gloo sees only CPU
tensors, the path CI runs every day), and the copies go back to the device after the op completes (at ``wait()``
for an asynchronous one). Each staged op is counted in :data:`STATS`. The copies are synchronous
(``Tensor.to("cpu")`` waits for the kernels that produced the tensor): correct, not fast — this path is for a
check on one GPU, never for a real multi-GPU job, whose device groups are NCCL.

``KC_GLOO_HOST_STAGING=always`` stages every op on a Gloo device group, CPU tensors too, so CI exercises this code.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch

ENV = "KC_GLOO_HOST_STAGING"
#: staged ops and bytes copied to the host, per op name (this process)
STATS: dict[str, dict[str, int]] = {}
_state = threading.local()


def _tensors(items) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for x in items:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out += _tensors(x)
    return out


def applies(group, *tensors) -> bool:
    """Whether an op on ``group`` with ``tensors`` (tensors or lists of them) is staged: a Gloo device group given
    a CUDA tensor (or any tensor under ``KC_GLOO_HOST_STAGING=always``), not already inside a staged op."""
    if getattr(_state, "inside", False) or group.kind != "device" or group.backend != "gloo":
        return False
    if os.environ.get(ENV, "").strip().lower() == "always":
        return True
    return any(t.is_cuda for t in _tensors(tensors))


def _copy_back(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():  # a parameter broadcast in place is a leaf that requires grad
        for device_t, host_t in pairs:
            device_t.copy_(host_t)


class StagedHandle:
    """An asynchronous op's handle whose ``wait()`` also copies the host results back to the device."""

    def __init__(self, handle, finish: Callable[[], None]) -> None:
        self._handle = handle
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        """Wait for the op, then copy its tensors back (once)."""
        self._handle.wait()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def is_completed(self) -> bool:
        """Whether the op and the copy back are done (never blocks)."""
        return self._finish is None and self._handle.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def call(fn: Callable, op: str, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (a primitive) with every tensor argument replaced by a host copy; afterwards the
    copies are written back into the original tensors and results on the host are mapped back to the device."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    copies: dict[int, torch.Tensor] = {}

    def to_host(x):
        if isinstance(x, torch.Tensor):
            if id(x) not in copies:
                copies[id(x)] = x.detach().to("cpu", copy=True)
                pairs.append((x, copies[id(x)]))
            return copies[id(x)]
        if isinstance(x, (list, tuple)):
            return type(x)(to_host(v) for v in x)
        return x

    host_args = [to_host(a) for a in args]
    host_kwargs = {k: to_host(v) for k, v in kwargs.items()}
    device = pairs[0][0].device if pairs else torch.device("cpu")
    row = STATS.setdefault(op, {"ops": 0, "bytes": 0})
    row["ops"] += 1
    row["bytes"] += sum(h.nbytes for _, h in pairs)
    originals = {id(h): d for d, h in pairs}

    def to_device(x):
        if isinstance(x, torch.Tensor):
            return originals.get(id(x)) if id(x) in originals else x.to(device)
        if isinstance(x, list):
            return [to_device(v) for v in x]
        return x

    _state.inside = True
    try:
        out = fn(*host_args, **host_kwargs)
    finally:
        _state.inside = False
    if hasattr(out, "wait") and not isinstance(out, torch.Tensor):
        return StagedHandle(out, lambda: _copy_back(pairs))
    _copy_back(pairs)
    return to_device(out)


def summary() -> dict[str, dict[str, int]]:
    """A copy of :data:`STATS` (JSON-ready)."""
    return {k: dict(v) for k, v in STATS.items()}
