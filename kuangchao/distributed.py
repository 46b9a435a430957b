"""The public SDK of Kuangchao's communication and device layers.

    import kuangchao.distributed as kc

    kc.init()                 # the rank's capability token (from `kc launch`) and the torchrun environment
    g = kc.CommGroup(ranks=[0, 1, 2, 3], backend="gloo", timeout_ms=30000)
    kc.all_reduce(tensor=t, group=g, op="sum")
    kc.memory.release_unused()

Every call passes the permission guard of the process and is timed (``kc.COMM_STATS``). Run scripts with
``kc launch --nproc-per-node N script.py``: it issues each rank a token, which this module installs when it is
imported (and :func:`init` again, if it was not yet). ``kc.init(trusted=True)`` runs without checks, loudly.
"""

from __future__ import annotations

from types import SimpleNamespace

from kuangchao_core.comm import (
    COMM_STATS,
    CommGroup,
    CommHandle,
    all_gather,
    all_reduce,
    all_to_all,
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


def _install_guard_from_environment() -> bool:
    """Install this rank's guard from the tokens ``kc launch`` hands it (over its lifeline, ``KC_LIFELINE``, which
    also ends this process when ``kc launch`` dies; or ``KC_TOKENS``); False when there are none."""
    import os

    if not os.environ.get("KC_TOKENS") and not os.environ.get("KC_LIFELINE"):
        return False
    from kuangchao_core.perm.runtime import install_from_environment, take_environment_tokens

    tokens = take_environment_tokens()
    if not tokens:
        return False
    install_from_environment(int(os.environ.get("RANK", "0")), tokens)
    return True


def init(backend: str = "auto", timeout_ms: int = 300000, *, trusted: bool = False) -> CommGroup:
    """Join the job: install the rank's capability token (``kc launch`` puts it in the environment) and the
    process group (torchrun's environment); returns the world group.

    ``trusted=True`` turns every permission check off for this process (a private cluster; logged loudly). Without
    a token and not trusted, the first guarded call raises ``PermissionDenied`` saying how to run the script."""
    import logging

    from kuangchao_core.perm import guard_api

    if trusted:
        logging.getLogger("kuangchao.distributed").warning(
            "!!! kc.init(trusted=True): capability checks are OFF in this process. Use only on a private cluster; "
            "start the script with `kc launch` to enforce tokens. !!!"
        )
        guard_api.install_guard(guard_api.AllowAll())
    elif isinstance(guard_api.current_guard(), guard_api.DenyAll):
        _install_guard_from_environment()
    return init_distributed(backend=backend, timeout_ms=timeout_ms)


_install_guard_from_environment()  # a script that never calls kc.init() still runs under its token

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
    "all_to_all",
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
