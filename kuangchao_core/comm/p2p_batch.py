"""Batched point-to-point: sends and receives issued together as one NCCL group (``batch_isend_irecv``).

A ring exchange has every rank send to its successor and receive from its predecessor at once. Issued as separate
``isend``/``irecv`` on NCCL, two ranks that send to each other first (a ring of two) can each block in a send whose
receive sits behind it on the same stream; ``torch.distributed.batch_isend_irecv`` coalesces the batch into one
NCCL group, which cannot deadlock that way. On Gloo it issues each op (tags keep the pairs apart).

Every op of the batch passes the comm layer's checks as :func:`~kuangchao_core.comm.primitives.isend` /
``irecv`` do: membership, ``comm.rules.admit`` (device tensors on device groups; under ``KC_COMM_RULES=nccl`` each
send/receive is logged per peer and direction for ``comm.order_check``), the permission guard and the per-peer
sequence counters; the batch is one handle (timed and watched as its first op).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from kuangchao_core.comm import dispatch, host_staging, rules, stream_trace
from kuangchao_core.comm.dispatch import CommHandle
from kuangchao_core.comm.group import CommGroup
from kuangchao_core.comm.timing import COMM_STATS
from kuangchao_core.errors import CommError


class _BatchWork:
    """torch's works of one batch behind one work's interface (``wait``, ``is_completed``, ``is_success``)."""

    __slots__ = ("works",)

    def __init__(self, works) -> None:
        self.works = list(works or [])

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self.works)


def batch_send_recv(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: CommGroup,
    tag: int = 0,
    tags: Sequence[int] | None = None,
) -> CommHandle:
    """Issue ``sends`` (``(tensor, dst)``) and ``recvs`` (``(tensor, src)``; global ranks of ``group``) as one
    batch; the received data is in place after the returned handle's ``wait()``, and a sent tensor may be reused
    only then. Every rank pairs its sends with the peers' receives in the order both list them. ``tags``: one per
    op (the sends', then the receives'), else ``tag`` for all (Gloo matches by tag; NCCL ignores tags)."""
    if host_staging.applies(group, list(sends), list(recvs)):  # CUDA tensors on Gloo: through host memory
        return host_staging.call(batch_send_recv, "batch_send_recv", list(sends), list(recvs), group, tag, tags)
    ops = [("send", t, peer) for t, peer in sends] + [("recv", t, peer) for t, peer in recvs]
    tags = list(tags) if tags is not None else [tag] * len(ops)
    if len(tags) != len(ops):
        raise CommError(f"batch_send_recv on group {group.name!r}: {len(tags)} tags for {len(ops)} sends and receives")
    if not ops:
        raise CommError(f"batch_send_recv on group {group.name!r}: nothing to send or receive")
    for op, _, peer in ops:
        if peer not in group.ranks:
            raise CommError(f"{op} on group {group.name!r}: peer rank {peer} is not in {group.ranks}")
    with stream_trace.batch(group):  # one grouped operation on the group's own stream
        for (op, t, peer), op_tag in zip(ops, tags, strict=True):
            rules.admit(op, group, t, peer=peer, tag=op_tag)
    for op, _, peer in ops[1:]:  # the first op enters through run_async below
        dispatch._enter(op, group, peer)
    p2p = [  # torch's own isend/irecv: P2POp accepts no other function
        dist.P2POp(c10d.isend if op == "send" else c10d.irecv, t, peer, group=group.pg, tag=op_tag)
        for (op, t, peer), op_tag in zip(ops, tags, strict=True)
    ]
    for op, t, _ in ops[1:]:  # one call and its bytes per op; the batch's blocking time goes to the first
        COMM_STATS.add(op, 0.0, t.nbytes)
    first_op, first_t, first_peer = ops[0]
    return dispatch.run_async(
        first_op, group, first_t.nbytes, lambda _a: _BatchWork(dist.batch_isend_irecv(p2p)), peer=first_peer
    )
