"""The public SDK of Kuangchao's communication and device layers.

    import kuangchao.distributed as kc

    kc.init()                                            # from the torchrun environment
    g = kc.CommGroup(ranks=[0, 1, 2, 3], backend="gloo", timeout_ms=30000)
    kc.all_reduce(tensor=t, group=g, op="sum")
    kc.memory.release_unused()

Every call passes the permission guard of the process and is timed (``kc.COMM_STATS``).
"""

from __future__ import annotations

from types import SimpleNamespace

from kuangchao_core.comm import (
    COMM_STATS,
    CommGroup,
    CommHandle,
    all_gather,
    all_reduce,
    broadcast,
    check_consistency,
    dump_groups,
    init_distributed,
    recv,
    reduce_scatter,
    send,
    world_group,
)
from kuangchao_core.errors import CommError, CommTimeout
from kuangchao_core.hal import (
    DeviceContext,
    configure_pool,
    device_init,
    memory_alloc,
    memory_free,
    memory_report,
    release_unused,
    stream_create,
)

init = init_distributed

memory = SimpleNamespace(
    alloc=memory_alloc,
    free=memory_free,
    release_unused=release_unused,
    report=memory_report,
    configure_pool=configure_pool,
)
"""``kc.memory.alloc/free/release_unused/report/configure_pool`` (the HAL memory interfaces)."""

__all__ = [
    "COMM_STATS",
    "CommError",
    "CommGroup",
    "CommHandle",
    "CommTimeout",
    "DeviceContext",
    "all_gather",
    "all_reduce",
    "broadcast",
    "check_consistency",
    "device_init",
    "dump_groups",
    "init",
    "init_distributed",
    "memory",
    "recv",
    "reduce_scatter",
    "send",
    "stream_create",
    "world_group",
]
