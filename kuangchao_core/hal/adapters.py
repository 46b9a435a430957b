"""Device adapters (SPEC L1.2): the only code that talks to a vendor runtime.

``CpuAdapter`` and ``CudaAdapter`` (which also serves AMD ROCm through PyTorch's HIP build, where
``torch.version.hip`` is set and devices still appear as ``cuda``). Other families plug in with
``register_adapter(kind, cls)``.
"""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path

import torch

from kuangchao_core.errors import KuangchaoError
from kuangchao_core.hal.stream import CudaStream, NullStream

# Peak memory bandwidth (GB/s) of common accelerators, by a substring of the device name (first match wins).
KNOWN_BANDWIDTH_GBPS = [
    ("H200", 4800.0),
    ("H100 SXM", 3350.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("H20", 4000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("A10", 600.0),
    ("V100", 900.0),
    ("MI300X", 5300.0),
    ("MI250", 3277.0),
]


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


class Adapter:
    """What the HAL needs from a device family."""

    kind: str = "abstract"

    def is_available(self) -> bool:
        """Whether this process can use the family at all."""
        raise NotImplementedError

    def device_count(self) -> int:
        """Number of visible devices of the family."""
        raise NotImplementedError

    def describe(self, index: int) -> dict:
        """Static facts about device ``index`` (the fields of ``DeviceContext`` except kind/index/device)."""
        raise NotImplementedError

    def torch_device(self, index: int) -> torch.device:
        """The ``torch.device`` of device ``index``."""
        raise NotImplementedError

    def activate(self, index: int) -> None:
        """Make device ``index`` the current device of this process."""

    def stream_create(self, device: torch.device, priority: int = 0):
        """A new stream on ``device`` (an object with the ``NullStream`` interface)."""
        raise NotImplementedError

    def memory_in_use(self, device: torch.device) -> tuple[int, int]:
        """(bytes allocated by tensors, bytes reserved by the runtime's caching allocator)."""
        return 0, 0

    def empty_cache(self) -> None:
        """Return cached, unused device memory to the system."""


class CpuAdapter(Adapter):
    """The host CPU (always available)."""

    kind = "cpu"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def torch_device(self, index: int) -> torch.device:
        return torch.device("cpu")

    def describe(self, index: int) -> dict:
        name = platform.processor() or platform.machine()
        cpuinfo = _read("/proc/cpuinfo") or ""
        for line in cpuinfo.splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
        total = 0
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            pass
        numa_nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
        return {
            "name": name,
            "device_class": f"cpu ({os.cpu_count()} logical cores)",
            "capability": None,
            "total_memory": int(total),
            "bandwidth_gbps": None,
            "hostname": socket.gethostname(),
            "numa_node": 0 if numa_nodes else None,
            "numa_nodes": len(numa_nodes) or None,
            "pci_bus_id": None,
            "nvlink_peers": [],
        }

    def stream_create(self, device: torch.device, priority: int = 0):
        return NullStream(device)


class CudaAdapter(Adapter):
    """NVIDIA CUDA devices, and AMD ROCm devices through PyTorch's HIP build (same ``torch.cuda`` API)."""

    kind = "cuda"

    def __init__(self) -> None:
        if getattr(torch.version, "hip", None):
            self.kind = "rocm"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def torch_device(self, index: int) -> torch.device:
        return torch.device("cuda", index)

    def activate(self, index: int) -> None:
        torch.cuda.set_device(index)

    def describe(self, index: int) -> dict:
        if not torch.cuda.is_available():
            raise KuangchaoError("no CUDA/ROCm device is visible; use device kind 'cpu' or check the driver")
        props = torch.cuda.get_device_properties(index)
        bandwidth = None
        clock_khz = getattr(props, "memory_clock_rate", None)
        bus_bits = getattr(props, "memory_bus_width", None)
        if clock_khz and bus_bits:  # double data rate: 2 transfers per clock
            bandwidth = round(2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, 1)
        else:
            for key, gbps in KNOWN_BANDWIDTH_GBPS:
                if key in props.name:
                    bandwidth = gbps
                    break
        pci = None
        if hasattr(props, "pci_bus_id"):
            pci = f"{getattr(props, 'pci_domain_id', 0):08x}:{props.pci_bus_id:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        numa = None
        if pci:
            raw = _read(f"/sys/bus/pci/devices/{pci[4:].lower()}/numa_node") or _read(
                f"/sys/bus/pci/devices/{pci.lower()}/numa_node"
            )
            if raw is not None and raw.lstrip("-").isdigit() and int(raw) >= 0:
                numa = int(raw)
        peers = [
            j for j in range(torch.cuda.device_count()) if j != index and torch.cuda.can_device_access_peer(index, j)
        ]
        arch = getattr(props, "gcnArchName", None) if self.kind == "rocm" else None
        return {
            "name": props.name,
            "device_class": arch or f"sm_{props.major}{props.minor}",
            "capability": (props.major, props.minor),
            "total_memory": int(props.total_memory),
            "bandwidth_gbps": bandwidth,
            "hostname": socket.gethostname(),
            "numa_node": numa,
            "numa_nodes": None,
            "pci_bus_id": pci,
            "nvlink_peers": peers,
        }

    def stream_create(self, device: torch.device, priority: int = 0):
        return CudaStream(torch.cuda.Stream(device=device, priority=priority), device)

    def memory_in_use(self, device: torch.device) -> tuple[int, int]:
        return int(torch.cuda.memory_allocated(device)), int(torch.cuda.memory_reserved(device))

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


_ADAPTERS: dict[str, type[Adapter]] = {"cpu": CpuAdapter, "cuda": CudaAdapter, "rocm": CudaAdapter}


def register_adapter(kind: str, cls: type[Adapter]) -> None:
    """Plug in an adapter for another device family (``device_init(kind=kind)`` then uses it)."""
    _ADAPTERS[kind] = cls


def get_adapter(kind: str) -> Adapter:
    """An adapter instance for ``kind`` (``cpu``, ``cuda``, ``rocm`` or a registered one)."""
    try:
        return _ADAPTERS[kind]()
    except KeyError:
        raise KuangchaoError(
            f"unknown device kind {kind!r}; known: {', '.join(sorted(_ADAPTERS))} (or register_adapter())"
        ) from None
