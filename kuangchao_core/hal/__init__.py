"""L1 hardware abstraction: device contexts, adapters, memory pool and records, streams.

May import: ``errors``; the guard interface ``guard_api`` (beside ``errors``).
"""

from kuangchao_core.hal import lazy_dynamo
from kuangchao_core.hal.adapters import Adapter, CpuAdapter, CudaAdapter, get_adapter, register_adapter
from kuangchao_core.hal.context import DeviceContext, current_context, device_init, stream_create
from kuangchao_core.hal.memory import (
    POOL,
    MemoryPool,
    configure_pool,
    memory_alloc,
    memory_free,
    memory_report,
    release_unused,
    write_memory_report,
)
from kuangchao_core.hal.stream import CudaStream, NullStream

lazy_dynamo.install()  # before any optimizer is built: no torch._dynamo import where nothing compiles

__all__ = [
    "POOL",
    "Adapter",
    "CpuAdapter",
    "CudaAdapter",
    "CudaStream",
    "DeviceContext",
    "MemoryPool",
    "NullStream",
    "configure_pool",
    "current_context",
    "device_init",
    "get_adapter",
    "memory_alloc",
    "memory_free",
    "memory_report",
    "register_adapter",
    "release_unused",
    "stream_create",
    "write_memory_report",
]
