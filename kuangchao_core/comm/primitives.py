"""The six communication primitives (SPEC L2.1), each passing ``comm.dispatch``.

``src``/``dst`` are global ranks. ``group=None`` means the world group. Reductions take ``op`` as one of
``sum``, ``avg``, ``max``, ``min``, ``prod``; Gloo has no native average, so ``avg`` there is a sum followed
by a division by the group size. CUDA tensors on a Gloo device group (several ranks on one GPU) go through
:mod:`~kuangchao_core.comm.host_staging`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kuangchao_core.comm import dispatch, host_staging, rules
from kuangchao_core.comm.dispatch import CommHandle
from kuangchao_core.comm.group import CommGroup, world_group
from kuangchao_core.errors import CommError

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}
_rs_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_rs_native_ok: dict[str, bool] = {}  # backend -> native reduce_scatter works


def _group(group: CommGroup | None) -> CommGroup:
    return world_group() if group is None else group


def _reduce_op(op: str, group: CommGroup):
    """(torch op, whether to divide by the group size afterwards)."""
    try:
        rop = _REDUCE_OPS[op]
    except KeyError:
        raise CommError(f"unknown reduction op {op!r}; use one of {', '.join(_REDUCE_OPS)}") from None
    if op == "avg" and group.backend != "nccl":
        return dist.ReduceOp.SUM, True
    return rop, False


def _divide(tensor: torch.Tensor, n: int) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(n)
    else:
        tensor.floor_divide_(n)


def broadcast(tensor: torch.Tensor, src: int, group: CommGroup | None = None) -> torch.Tensor:
    """Copy ``tensor`` from global rank ``src`` to every member of ``group`` (in place); returns ``tensor``."""
    g = _group(group)
    if host_staging.applies(g, tensor):
        return host_staging.call(broadcast, "broadcast", tensor, src, g)
    if src not in g.ranks:
        raise CommError(f"broadcast on group {g.name!r}: src rank {src} is not in {g.ranks}")
    rules.admit("broadcast", g, tensor)
    dispatch.run("broadcast", g, tensor.nbytes, lambda a: dist.broadcast(tensor, src, group=g.pg, async_op=a))
    return tensor


def all_reduce(tensor: torch.Tensor, group: CommGroup | None = None, op: str = "sum", async_op: bool = False):
    """Reduce ``tensor`` across ``group`` in place; returns ``tensor``, or a ``CommHandle`` if ``async_op``."""
    g = _group(group)
    if host_staging.applies(g, tensor):
        return host_staging.call(all_reduce, "all_reduce", tensor, g, op, async_op)
    rop, divide = _reduce_op(op, g)
    rules.admit("all_reduce", g, tensor)

    def issue(a):
        return dist.all_reduce(tensor, op=rop, group=g.pg, async_op=a)

    if async_op:
        finish = (lambda: _divide(tensor, g.size)) if divide else None
        return dispatch.run_async("all_reduce", g, tensor.nbytes, issue, finish)
    dispatch.run("all_reduce", g, tensor.nbytes, issue)
    if divide:
        _divide(tensor, g.size)
    return tensor


def all_gather(tensor_list: list[torch.Tensor] | None, tensor: torch.Tensor, group: CommGroup | None = None):
    """Gather ``tensor`` from every member, in group order, into ``tensor_list`` (allocated if None); returns it."""
    g = _group(group)
    if host_staging.applies(g, tensor, tensor_list or ()):
        return host_staging.call(all_gather, "all_gather", tensor_list, tensor, g)
    if tensor_list is None:
        tensor_list = [torch.empty_like(tensor) for _ in range(g.size)]
    elif len(tensor_list) != g.size:
        raise CommError(f"all_gather on group {g.name!r}: tensor_list has {len(tensor_list)} entries, need {g.size}")
    rules.admit("all_gather", g, tensor, *tensor_list)
    order = _group_order(g)
    if order is None:
        dispatch.run(
            "all_gather",
            g,
            tensor.nbytes * g.size,
            lambda a: dist.all_gather(tensor_list, tensor, group=g.pg, async_op=a),
        )
    else:  # the caller's rank order differs from torch's sorted order: gather, then reorder
        tmp = [torch.empty_like(tensor) for _ in range(g.size)]
        dispatch.run(
            "all_gather", g, tensor.nbytes * g.size, lambda a: dist.all_gather(tmp, tensor, group=g.pg, async_op=a)
        )
        for i, j in enumerate(order):
            tensor_list[i].copy_(tmp[j])
    return tensor_list


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: CommGroup | None = None, async_op: bool = False):
    """Gather ``tensor`` from every member into the flat ``output`` (member i's copy at ``[i*n, (i+1)*n)``, group
    order); returns ``output``, or a ``CommHandle`` whose ``wait()`` leaves the data there if ``async_op``."""
    g = _group(group)
    if host_staging.applies(g, tensor, output):
        return host_staging.call(all_gather_into, "all_gather_into", output, tensor, g, async_op)
    n = tensor.numel()
    if output.numel() != n * g.size or not output.is_contiguous():
        raise CommError(
            f"all_gather_into on group {g.name!r}: output must be contiguous with {n * g.size} elements "
            f"(group size {g.size} x {n}), got {output.numel()}"
        )
    rules.admit("all_gather", g, tensor, output)
    parts = list(output.view(g.size, n).unbind(0))
    order = _group_order(g)
    src = tensor.reshape(-1)
    tmp = parts if order is None else [torch.empty_like(src) for _ in range(g.size)]

    def reorder() -> None:
        for i, j in enumerate(order):
            parts[i].copy_(tmp[j])

    def issue(a):
        return dist.all_gather(tmp, src, group=g.pg, async_op=a)

    finish = None if order is None else reorder
    if async_op:
        return dispatch.run_async("all_gather", g, tensor.nbytes * g.size, issue, finish)
    dispatch.run("all_gather", g, tensor.nbytes * g.size, issue)
    if finish is not None:
        finish()
    return output


def _group_order(g: CommGroup) -> list[int] | None:
    """Positions in torch's sorted rank order of each entry of ``g.ranks``; None when identical."""
    srt = sorted(g.ranks)
    if srt == g.ranks:
        return None
    return [srt.index(r) for r in g.ranks]


def reduce_scatter(
    output: torch.Tensor, input_list: list[torch.Tensor] | torch.Tensor, group: CommGroup | None = None, op: str = "sum"
) -> torch.Tensor:
    """Reduce ``input_list`` across the group and leave member i's chunk (group order) in ``output``.

    ``input_list`` is a list of ``group.size`` tensors shaped like ``output``, or one tensor of that many
    ``output``-sized chunks laid end to end. Returns ``output``.
    """
    g = _group(group)
    if host_staging.applies(g, output, input_list):
        return host_staging.call(reduce_scatter, "reduce_scatter", output, input_list, g, op)
    if isinstance(input_list, torch.Tensor):
        if input_list.numel() != output.numel() * g.size:
            raise CommError(
                f"reduce_scatter on group {g.name!r}: input has {input_list.numel()} elements, "
                f"need group size {g.size} x output {output.numel()}"
            )
        chunks = list(input_list.reshape(g.size, -1).unbind(0))
    else:
        if len(input_list) != g.size:
            raise CommError(
                f"reduce_scatter on group {g.name!r}: input_list has {len(input_list)} entries, need {g.size}"
            )
        chunks = list(input_list)
    order = _group_order(g)
    if order is not None:  # torch scatters in sorted rank order
        by_sorted = [None] * g.size
        for i, j in enumerate(order):
            by_sorted[j] = chunks[i]
        chunks = by_sorted
    rop, divide = _reduce_op(op, g)
    rules.admit("reduce_scatter", g, *chunks, output)
    flat = torch.cat([c.reshape(-1) for c in chunks])
    nbytes = flat.nbytes
    out_flat = (
        output.view(-1)
        if output.is_contiguous()
        else torch.empty(output.numel(), dtype=output.dtype, device=output.device)
    )
    native = _rs_native_ok.get(g.backend, True)

    def issue_native(a):
        return _rs_single(out_flat, flat, op=rop, group=g.pg, async_op=a)

    def issue_emulated(a):
        return dist.all_reduce(flat, op=rop, group=g.pg, async_op=a)

    if native:
        try:
            dispatch.run("reduce_scatter", g, nbytes, issue_native)
        except CommError as exc:
            text = str(exc.__cause__ or exc).lower()
            if "not supported" not in text and "does not support" not in text and "not implemented" not in text:
                raise
            _rs_native_ok[g.backend] = False
            g.broken = None
            native = False
    if not native:
        dispatch.run("reduce_scatter", g, nbytes, issue_emulated)
        me = sorted(g.ranks).index(g.global_rank)
        out_flat.copy_(flat.view(g.size, -1)[me])
    if out_flat.data_ptr() != output.data_ptr():
        output.copy_(out_flat.view_as(output))
    if divide:
        _divide(output, g.size)
    return output


def send(tensor: torch.Tensor, dst: int, group: CommGroup | None = None) -> None:
    """Send ``tensor`` to global rank ``dst`` (a member of ``group``); blocks until it is handed over."""
    g = _group(group)
    if host_staging.applies(g, tensor):
        return host_staging.call(send, "send", tensor, dst, g)
    if dst not in g.ranks:
        raise CommError(f"send on group {g.name!r}: dst rank {dst} is not in {g.ranks}")
    rules.admit("send", g, tensor, peer=dst)
    dispatch.run("send", g, tensor.nbytes, lambda a: _p2p(dist.isend, tensor, dst, g, a), peer=dst)


def recv(tensor: torch.Tensor, src: int, group: CommGroup | None = None) -> torch.Tensor:
    """Receive into ``tensor`` from global rank ``src`` (a member of ``group``); returns ``tensor``."""
    g = _group(group)
    if host_staging.applies(g, tensor):
        return host_staging.call(recv, "recv", tensor, src, g)
    if src not in g.ranks:
        raise CommError(f"recv on group {g.name!r}: src rank {src} is not in {g.ranks}")
    rules.admit("recv", g, tensor, peer=src)
    dispatch.run("recv", g, tensor.nbytes, lambda a: _p2p(dist.irecv, tensor, src, g, a), peer=src)
    return tensor


def isend(tensor: torch.Tensor, dst: int, group: CommGroup | None = None, tag: int = 0) -> CommHandle:
    """Send ``tensor`` to global rank ``dst`` asynchronously with a message ``tag``; wait on the returned handle
    before reusing ``tensor``. Guarded and timed as ``send``, like every primitive."""
    g = _group(group)
    if host_staging.applies(g, tensor):
        return host_staging.call(isend, "send", tensor, dst, g, tag)
    if dst not in g.ranks:
        raise CommError(f"send on group {g.name!r}: dst rank {dst} is not in {g.ranks}")
    rules.admit("send", g, tensor, peer=dst, tag=tag)
    return dispatch.run_async(
        "send", g, tensor.nbytes, lambda _a: dist.isend(tensor, dst, group=g.pg, tag=tag), peer=dst
    )


def irecv(tensor: torch.Tensor, src: int, group: CommGroup | None = None, tag: int = 0) -> CommHandle:
    """Receive into ``tensor`` from global rank ``src`` asynchronously (message ``tag``); the data is there after
    the returned handle's ``wait()``. Guarded and timed as ``recv``."""
    g = _group(group)
    if host_staging.applies(g, tensor):
        return host_staging.call(irecv, "recv", tensor, src, g, tag)
    if src not in g.ranks:
        raise CommError(f"recv on group {g.name!r}: src rank {src} is not in {g.ranks}")
    rules.admit("recv", g, tensor, peer=src, tag=tag)
    return dispatch.run_async(
        "recv", g, tensor.nbytes, lambda _a: dist.irecv(tensor, src, group=g.pg, tag=tag), peer=src
    )


def _p2p(fn, tensor, peer, g, async_op):
    work = fn(tensor, peer, group=g.pg)
    if async_op:
        return work
    work.wait()
    return None
