"""A c10d ``TCPStore`` server that listens on one address only (issue 38 item 2).

torch's ``TCPStore`` server binds every address (``::`` / ``0.0.0.0``) whatever host name it is given, and its
protocol has no authentication: anyone who reaches the port reads and writes every key. :func:`hosted_store` binds
the listening socket itself — to the address the job's traffic uses, loopback for a single-host job — and hands it
to the store by file descriptor (``master_listen_fd``), so nothing listens on the host's other addresses.
:func:`gated_store` is a multi-host job's store behind the gate of :mod:`~kuangchao_core.sched.store_gate`.
"""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

import torch.distributed as dist

from kuangchao_core.sched.bind_address import numeric_address
from kuangchao_core.sched.store_gate import Gate, Relay

BACKLOG = 2048  # torch's own listen backlog for the store
LOOPBACK = "127.0.0.1"


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (``port`` 0: one the kernel picks). Raises ``OSError`` when the
    address is not this machine's (``EADDRNOTAVAIL``) or the port is taken (``EADDRINUSE``)."""
    addr = numeric_address(host)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def hosted_store(host: str, port: int, timeout: timedelta = timedelta(seconds=60)) -> dist.TCPStore:
    """A ``TCPStore`` server (multi-tenant, so torch's own lookups of the port find it) listening on ``host:port``
    and on nothing else; its ``port`` is the real one when ``port`` is 0. The store owns the socket from here on."""
    sock = listening_socket(host, port)
    bound_port = sock.getsockname()[1]
    try:
        store = dist.TCPStore(
            numeric_address(host),
            bound_port,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server closes the descriptor when it stops
    return store


def gated_store(host: str, port: int, is_host: bool | None, timeout: timedelta, key: bytes):
    """The rendezvous store behind the gate: ``(store, local endpoint, gate or relay)``. The hosting node keeps the
    store on loopback and the gate on ``host:port``; every other node reaches it through a relay on its loopback."""
    if is_host is not False:
        try:
            store = hosted_store(LOOPBACK, 0, timeout)
            gate = Gate(host, port, (LOOPBACK, store.port), key)
            return store, (LOOPBACK, store.port), gate
        except OSError as exc:
            if is_host or exc.errno not in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
                raise OSError(exc.errno, f"cannot host the store gate on {host}:{port}: {exc.strerror}") from exc
    relay = Relay((host, port), key, LOOPBACK, connect_wait_s=timeout.total_seconds())
    store = dist.TCPStore(LOOPBACK, relay.port, is_master=False, timeout=timeout)
    return store, (LOOPBACK, relay.port), relay
