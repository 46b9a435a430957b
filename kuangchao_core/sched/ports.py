"""A free TCP port for a server another process starts later (a rendezvous store, a test server)."""

from __future__ import annotations

import random
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now, drawn below the kernel's ephemeral range when it leaves room:
    the port is bound later by another process (torchrun's store), and a port from ``bind(0)`` is one the kernel may
    hand to any other socket meanwhile (two test workers once met on one)."""
    low = _ephemeral_low()
    for _ in range(50 if low > 12000 else 0):
        port = random.randint(10000, low - 1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The low end of the kernel's ephemeral port range (0 when unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
