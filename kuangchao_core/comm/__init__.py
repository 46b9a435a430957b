"""L2 communication: groups, the seven primitives behind one dispatch point, timeouts, state dump, timers.

May import: ``errors``, ``hal``; the guard interface ``guard_api`` (beside ``errors``).
"""

from kuangchao_core.comm.dispatch import CommHandle
from kuangchao_core.comm.group import DEFAULT_TIMEOUT_MS, CommGroup, init_distributed, world_group
from kuangchao_core.comm.primitives import all_gather, all_reduce, all_to_all, broadcast, recv, reduce_scatter, send
from kuangchao_core.comm.registry import all_groups
from kuangchao_core.comm.state import check_consistency, dump_groups, write_dump
from kuangchao_core.comm.timing import COMM_STATS

__all__ = [
    "COMM_STATS",
    "DEFAULT_TIMEOUT_MS",
    "CommGroup",
    "CommHandle",
    "all_gather",
    "all_groups",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "check_consistency",
    "dump_groups",
    "init_distributed",
    "recv",
    "reduce_scatter",
    "send",
    "world_group",
    "write_dump",
]
