"""torchrun's static rendezvous with its store bound to node 0's address, and gated by the job's key when there is
one (issue 38 item 2): the backend ``kc-static`` of :mod:`kuangchao_core.sched.bound_rdzv`, which ``kc launch
--nnodes N`` uses.

torch's ``static`` backend fixes each node's rank (``--node-rank``), which ``kc launch``'s per-rank tokens rely on,
and hosts its store on every address of node 0. ``kc-static`` keeps the fixed ranks and hosts the store on the
endpoint's address only; with a store key (``--store-key-file``) the store sits on node 0's loopback behind the
gate, and every other node's agent and ranks reach it through a relay on their own loopback
(:mod:`~kuangchao_core.sched.store_gate`). ``--rdzv-conf rank=<node rank>``, and ``timeout`` (seconds) as for
``static``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters, RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from kuangchao_core.sched.bound_store import gated_store, hosted_store

BACKEND = "kc-static"
DEFAULT_TIMEOUT_S = 600


class BoundStaticRendezvous(StaticTCPRendezvous):
    """torch's static rendezvous whose store listens on one address (see the module docstring); ``key``: the job's
    store key (None: no gate)."""

    def __init__(self, master: tuple[str, int], rank: int, world_size: int, run_id: str, timeout: int, key=None):
        super().__init__(master[0], master[1], rank, world_size, run_id, timeout)
        self.key = key
        self.endpoint = tuple(master)  # where this node's agent and ranks reach the store
        self.gate = None

    def get_backend(self) -> str:
        return BACKEND

    def _open(self) -> dist.TCPStore:
        addr, port = self.master_addr, self.master_port
        if self.key:
            store, self.endpoint, self.gate = gated_store(addr, port, self.rank == 0, self.timeout, self.key)
            return store
        if self.rank == 0:
            return hosted_store(addr, port, self.timeout)
        return dist.TCPStore(addr, port, is_master=False, timeout=self.timeout)

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._store = self._open()
        store = PrefixStore(self.run_id, self._store)
        return RendezvousInfo(store, self.rank, self.world_size, RendezvousStoreInfo(*self.endpoint))


def create_handler(params: RendezvousParameters, key: bytes | None = None) -> BoundStaticRendezvous:
    """The ``kc-static`` handler for torchrun's ``params`` (``--rdzv-endpoint``, ``--nnodes``, ``--rdzv-id`` and
    ``--rdzv-conf rank=…``)."""
    if "rank" not in params.config:
        raise ValueError("kc-static needs --rdzv-conf rank=<this node's rank>")
    addr, port = parse_rendezvous_endpoint(params.endpoint.strip(), -1)
    if not addr or port == -1:
        raise ValueError(f"kc-static needs --rdzv-endpoint ADDRESS:PORT, got {params.endpoint!r}")
    timeout = int(params.config.get("timeout", DEFAULT_TIMEOUT_S))
    rank = int(params.config["rank"])
    return BoundStaticRendezvous((addr, port), rank, params.max_nodes, params.run_id, timeout, key)
