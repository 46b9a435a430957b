"""The device context (SPEC L1.1, L1.3): built once per process by ``device_init`` and cached."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field

import torch

from kuangchao_core import guard_api
from kuangchao_core.errors import KuangchaoError
from kuangchao_core.hal import stand_in
from kuangchao_core.hal.adapters import Adapter, get_adapter

_cache: dict[tuple[str, int], DeviceContext] = {}
_current: DeviceContext | None = None
_lock = threading.Lock()


@dataclass(frozen=True)
class DeviceContext:
    """Static facts about this process's device; never re-queried in the training loop."""

    kind: str  # cpu | cuda | rocm | a registered family
    index: int
    device: torch.device
    name: str
    device_class: str  # e.g. "sm_90", "gfx942", "cpu (16 logical cores)"
    capability: tuple[int, int] | None
    total_memory: int  # bytes
    bandwidth_gbps: float | None  # peak memory bandwidth where known or derivable
    hostname: str
    numa_node: int | None
    numa_nodes: int | None
    pci_bus_id: str | None
    nvlink_peers: list[int] = field(default_factory=list)  # device indices with direct peer access
    adapter: Adapter | None = field(default=None, repr=False, compare=False)

    @property
    def resource(self) -> str:
        """The permission resource naming this device (``device:cpu``, ``device:cuda:0``)."""
        return "device:cpu" if self.device.type == "cpu" else f"device:{self.device.type}:{self.index}"

    def to_dict(self) -> dict:
        """JSON-friendly fields (for ``kc doctor`` and logs)."""
        d = asdict(self)
        d.pop("adapter", None)
        d["device"] = str(self.device)
        return d


def _resolve_kind(kind: str) -> str:
    if kind == "auto":
        return get_adapter("cuda").kind if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and getattr(torch.version, "hip", None):
        return "rocm"
    return kind


def device_init(kind: str = "auto", local_rank: int = 0) -> DeviceContext:
    """Initialise (once) and return the context of this process's device.

    ``kind``: ``auto`` (CUDA/ROCm if visible, else CPU), ``cpu``, ``cuda``, ``rocm`` or a registered family.
    ``local_rank`` picks the accelerator on this node (ignored on CPU). Guarded as ``device_init`` on
    ``device:<type>:<index>`` (``device:cpu`` for the CPU) on every call.
    """
    global _current
    resolved = _resolve_kind(kind)
    index = 0 if resolved == "cpu" else int(local_rank)
    family = "cuda" if resolved in ("cuda", "rocm") else resolved  # ROCm devices are torch "cuda" devices
    resource = "device:cpu" if resolved == "cpu" else f"device:{family}:{index}"
    guard_api.check("device_init", resource)
    key = (resolved, index)
    with _lock:
        ctx = _cache.get(key)
        if ctx is None:
            adapter = get_adapter(resolved)
            if not adapter.is_available():
                raise KuangchaoError(
                    f"device_init: device kind {resolved!r} is not available in this process "
                    f"(torch {torch.__version__}); use kind='cpu' or 'auto', or check drivers and CUDA_VISIBLE_DEVICES"
                )
            count = adapter.device_count()
            if index >= count:
                raise KuangchaoError(
                    f"device_init: local_rank {index} but only {count} {resolved} device(s) visible on this node; "
                    "start at most one worker per device (nproc_per_node)"
                )
            adapter.activate(index)
            facts = adapter.describe(index)
            device = adapter.torch_device(index)
            if resolved == "cpu" and stand_in.requested():  # CI's NCCL rules: the job's tensors on a stand-in device
                stand_in.install()
                device = stand_in.DEVICE
            ctx = DeviceContext(kind=resolved, index=index, device=device, adapter=adapter, **facts)
            _cache[key] = ctx
        _current = ctx
    return ctx


def current_context() -> DeviceContext | None:
    """The context of the last ``device_init`` in this process, or None (no permission check: read-only)."""
    return _current


def _clear_cache_for_tests() -> None:
    global _current
    with _lock:
        _cache.clear()
        _current = None


def stream_create(priority: int = 0):
    """A new stream on this process's device (a no-op stream on CPU with the same interface).

    Guarded as ``stream_create`` on the device resource. Uses the current context, or the CPU if
    ``device_init`` has not run.
    """
    ctx = _current
    resource = ctx.resource if ctx is not None else "device:cpu"
    guard_api.check("stream_create", resource)
    if ctx is None:
        return get_adapter("cpu").stream_create(torch.device("cpu"), priority)
    return ctx.adapter.stream_create(ctx.device, priority)
