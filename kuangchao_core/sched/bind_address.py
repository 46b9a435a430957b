"""Where a job's listening sockets go (issue 38 item 2), without importing torch: a single-host job listens on
loopback only, a multi-host one on the address its traffic uses; torchrun runs as :data:`TORCHRUN` with the
rendezvous backend :data:`RDZV_BACKEND` (:mod:`kuangchao_core.sched.bound_rdzv`), which binds its stores so.
"""

from __future__ import annotations

import ipaddress
import socket

TORCHRUN = "kuangchao_core.sched.bound_rdzv"  # ``python -m`` it: torchrun with the backend below registered
RDZV_BACKEND = "kc-c10d"
LOOPBACK_IFNAME = "lo"  # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME of a single-host job


def numeric_address(host: str) -> str:
    """``host`` as a numeric address (a name resolved, IPv4 first); raises ``OSError`` when it does not resolve."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return str(infos[0][4][0])


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is a loopback address; False when it does not resolve."""
    try:
        return ipaddress.ip_address(numeric_address(host)).is_loopback
    except (OSError, ValueError):
        return False
