"""torchrun with its c10d stores bound to the job's address (issue 38 item 2): ``python -m
kuangchao_core.sched.bound_rdzv <torchrun options>`` is ``python -m torch.distributed.run`` plus the rendezvous
backend ``kc-c10d``.

torch's ``c10d`` backend hosts the rendezvous store on every address, and torchrun then starts a second store
for the workers (shared mode: the agent's, on a fresh port; otherwise rank 0's, in the worker), also on every
address. ``kc-c10d`` is the same dynamic rendezvous over the same store protocol, with one difference: the node
that hosts the store binds it to the endpoint's address only (:func:`kuangchao_core.sched.bound_store.hosted_store`),
loopback for a single-host job, the training interface's address for a multi-host one; and the workers' store
(``TORCHELASTIC_USE_AGENT_STORE``, so every worker is a client) is that same store when this node hosts it, or one
bound to this node's announced address (``--local-addr``) otherwise. So a job listens on one port per store host,
on one address.

Options of ``--rdzv-conf``: ``is_host`` (whether this node hosts the store; when absent, the node that can bind the
endpoint's address hosts it) and ``read_timeout`` (seconds, default 60), as for ``c10d``.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from kuangchao_core.sched import bound_static
from kuangchao_core.sched.bind_address import RDZV_BACKEND as BACKEND
from kuangchao_core.sched.bind_address import is_loopback, numeric_address
from kuangchao_core.sched.bound_store import gated_store, hosted_store
from kuangchao_core.sched.store_gate import ENV_KEY_FD, Gate, Relay

DEFAULT_PORT = 29400
_KEY: list[bytes] = []  # the job's store key (multi-host jobs): set once by main()
log = logging.getLogger(__name__)


class _Backend(C10dRendezvousBackend):
    """torch's c10d rendezvous state in the store, under this backend's name (torchrun checks it)."""

    @property
    def name(self) -> str:
        return BACKEND


class BoundRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous whose workers' store listens on one address (see the module docstring)."""

    hosted: dist.TCPStore | None = None  # the rendezvous store, when this node hosts it (or, gated, any store)
    hosted_addr: str | None = None
    local_endpoint: tuple[str, int] | None = None  # gated: where this node's ranks reach the store (loopback)
    gate: Gate | Relay | None = None

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
        if self.hosted is not None and (self.local_endpoint or numeric_address(master_addr) == self.hosted_addr):
            return self.hosted  # the workers reach it where the agents do: one port for the job
        return hosted_store(master_addr, master_port)

    def next_rendezvous(self) -> RendezvousInfo:
        info = super().next_rendezvous()
        if self.local_endpoint is None:
            return info
        # gated: this node's ranks reach the one store on their own loopback (the store, or this node's relay)
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(*self.local_endpoint))


def _store(
    host: str, port: int, is_host: bool | None, timeout: timedelta, max_nodes: int = 1
) -> tuple[dist.TCPStore, bool]:
    """The rendezvous store and whether this process hosts it."""
    if max_nodes > 1 and is_loopback(host):  # several agents of one host may meet there; others never will
        log.warning(
            "the rendezvous endpoint %s is a loopback address (%s) in a job of up to %d nodes: nodes on other "
            "hosts cannot reach the store there; give node 0's address on the training network",
            host,
            numeric_address(host),
            max_nodes,
        )
    if is_host is not False:
        try:
            return hosted_store(host, port, timeout), True
        except OSError as exc:
            if is_host or exc.errno not in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
                raise OSError(exc.errno, f"cannot host the rendezvous store on {host}:{port}: {exc.strerror}") from exc
            # not this machine's address, or another agent on this machine hosts it: join as a client
    return dist.TCPStore(host, port, is_master=False, timeout=timeout), False


def read_store_key() -> bytes | None:
    """The job's store key, read once from the pipe the launcher passed (``KC_STORE_KEY_FD``, taken out of the
    environment so the ranks never see it); None for a job without one."""
    fd = os.environ.pop(ENV_KEY_FD, None)
    if fd is None:
        return None
    with os.fdopen(int(fd), "rb") as f:
        text = f.read(4096).strip()
    try:
        return bytes.fromhex(text.decode("ascii"))
    except ValueError:
        raise ValueError(f"{ENV_KEY_FD}: the store key is not hex") from None


def _timeout(params: RendezvousParameters, key: str) -> timedelta | None:
    seconds = params.get_as_int(f"{key}_timeout")
    return None if seconds is None else timedelta(seconds=seconds)


def create_handler(params: RendezvousParameters) -> BoundRendezvousHandler:
    """The ``kc-c10d`` handler for torchrun's ``params`` (endpoint, run id, node counts, ``--rdzv-conf``)."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    read_timeout = params.get_as_int("read_timeout", 60) or 60
    is_host = params.get_as_bool("is_host")
    if _KEY:
        store, local, gate = gated_store(host, port, is_host, timedelta(seconds=read_timeout), _KEY[0])
        hosting = False
    else:
        store, hosting = _store(host, port, is_host, timedelta(seconds=read_timeout), params.max_nodes)
    timeout = RendezvousTimeout(*(_timeout(params, k) for k in ("join", "last_call", "close", "heartbeat")))
    handler = BoundRendezvousHandler.from_backend(
        params.run_id,
        store,
        _Backend(store, params.run_id),
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3),
    )
    if hosting:
        handler.hosted, handler.hosted_addr = store, numeric_address(host)
    elif _KEY:
        handler.hosted, handler.local_endpoint, handler.gate = store, local, gate
    return handler


def _create_static(params: RendezvousParameters):
    return bound_static.create_handler(params, _KEY[0] if _KEY else None)


def register() -> None:
    """Make ``--rdzv-backend kc-c10d`` and ``kc-static`` (:mod:`.bound_static`) known to torchrun in this process
    (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, create_handler)
    rendezvous_handler_registry.register(bound_static.BACKEND, _create_static)


def main(argv: list[str] | None = None) -> None:
    """torchrun (``torch.distributed.run``) with ``kc-c10d`` registered."""
    from torch.distributed.run import main as torchrun_main

    key = read_store_key()
    if key:
        _KEY.append(key)
    register()
    torchrun_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    from kuangchao_core.sched.fast_exit import exit_now

    main()
    exit_now(0)  # the workers have ended: no interpreter teardown (seconds of CPU on a loaded machine)
