"""The communication primitives (SPEC L2.1; ``all_to_all`` added for expert parallelism, issue 40), each passing
``comm.dispatch``.

``src``/``dst`` are global ranks. ``group=None`` means the world group. Reductions take ``op`` as one of
``sum``, ``avg``, ``max``, ``min``, ``prod``; Gloo has no native average, so ``avg`` there is a sum followed
by a division by the group size. CUDA tensors on a Gloo device group (several ranks on one GPU) go through
:mod:`~kuangchao_core.comm.host_staging`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kuangchao_core.comm import dispatch, host_staging, rules, staging
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
_ag_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_rs_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_flat_ok: dict[tuple[str, str], bool] = {}  # (backend, op) -> the backend takes the flat form


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


def _run(op: str, g: CommGroup, nbytes: int, issue, async_op: bool, finish=None):
    """``issue`` through dispatch: a ``CommHandle`` when ``async_op`` (``finish`` runs after its wait), else run it,
    then ``finish``, and return None."""
    if async_op:
        return dispatch.run_async(op, g, nbytes, issue, finish)
    dispatch.run(op, g, nbytes, issue)
    if finish is not None:
        finish()
    return None


def _try_flat(op: str, g: CommGroup, nbytes: int, issue, async_op: bool, finish=None):
    """(True, what :func:`_run` returns) for the flat form of ``op``; (False, None) where the backend refuses it
    (remembered per backend, so later calls go straight to the caller's fallback)."""
    if not _flat_ok.get((g.backend, op), True):
        return False, None
    try:
        return True, _run(op, g, nbytes, issue, async_op, finish)
    except CommError as exc:
        text = str(exc.__cause__ or exc).lower()
        if "not supported" not in text and "does not support" not in text and "not implemented" not in text:
            raise
        _flat_ok[(g.backend, op)] = False
        g.broken = None
        return False, None


def all_gather(tensor_list: list[torch.Tensor] | None, tensor: torch.Tensor, group: CommGroup | None = None):
    """Gather ``tensor`` from every member, in group order, into ``tensor_list``; returns it.

    With ``tensor_list=None`` the result is ``group.size`` views of one flat buffer the backend gathers into
    directly (:func:`all_gather_into`); a caller's list takes the list form, which backends stage (``comm.staging``).
    """
    g = _group(group)
    if host_staging.applies(g, tensor, tensor_list or ()):
        return host_staging.call(all_gather, "all_gather", tensor_list, tensor, g)
    if tensor_list is None and staging.flat_enabled():
        out = tensor.new_empty((g.size * tensor.numel(),))  # new_empty: on the device as tensor (stand-in too)
        all_gather_into(out, tensor, group=g)
        return list(out.view(g.size, *tensor.shape).unbind(0))
    reason = "staged" if tensor_list is None else "list"
    if tensor_list is None:
        tensor_list = [torch.empty_like(tensor) for _ in range(g.size)]
    elif len(tensor_list) != g.size:
        raise CommError(f"all_gather on group {g.name!r}: tensor_list has {len(tensor_list)} entries, need {g.size}")
    rules.admit("all_gather", g, tensor, *tensor_list)
    order = _group_order(g)
    tmp = tensor_list if order is None else [torch.empty_like(tensor) for _ in range(g.size)]
    payload = tensor.nbytes * g.size
    dispatch.run("all_gather", g, payload, lambda a: dist.all_gather(tmp, tensor, group=g.pg, async_op=a))
    if order is not None:  # the caller's rank order differs from torch's sorted order: reorder
        for i, j in enumerate(order):
            tensor_list[i].copy_(tmp[j])
    staging.account("all_gather", g, "list", payload, payload, 0 if order is None else payload, reason)
    return tensor_list


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: CommGroup | None = None, async_op: bool = False):
    """Gather ``tensor`` from every member into the flat ``output`` (member i's copy at ``[i*n, (i+1)*n)``, group
    order); returns ``output``, or a ``CommHandle`` whose ``wait()`` leaves the data there if ``async_op``.

    The backend writes straight into ``output`` (``all_gather_single``); a group whose rank order is not torch's
    sorted one gathers into a staging buffer and reorders, a backend that refuses the flat op gets the list form
    (both counted in ``comm.staging``).
    """
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
    src = tensor.reshape(-1)
    payload = output.nbytes
    copied = 0 if src.data_ptr() == tensor.data_ptr() else tensor.nbytes
    rows = output.view(g.size, n)
    order = _group_order(g)
    target, finish, reason = rows, None, None
    if order is not None:  # torch gathers in sorted rank order
        target, reason = torch.empty_like(rows), "order"
        index = torch.tensor(order, device=output.device)
        finish = lambda: torch.index_select(target, 0, index, out=rows)  # noqa: E731
        copied += payload
    flat, handle = False, None
    if staging.flat_enabled():
        issue_flat = lambda a: _ag_single(target.view(-1), src, group=g.pg, async_op=a)  # noqa: E731
        flat, handle = _try_flat("all_gather", g, payload, issue_flat, async_op, finish)
        reason = reason if flat else "unsupported"
    else:
        reason = "staged"
    if not flat:
        parts = list(target.unbind(0))
        issue_list = lambda a: dist.all_gather(parts, src, group=g.pg, async_op=a)  # noqa: E731
        handle = _run("all_gather", g, payload, issue_list, async_op, finish)
    staging.account("all_gather", g, "flat" if flat else "list", payload, payload, copied, reason)
    return handle if async_op else output


def _group_order(g: CommGroup) -> list[int] | None:
    """Positions in torch's sorted rank order of each entry of ``g.ranks``; None when identical."""
    srt = sorted(g.ranks)
    if srt == g.ranks:
        return None
    return [srt.index(r) for r in g.ranks]


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor] | torch.Tensor,
    group: CommGroup | None = None,
    op: str = "sum",
    async_op: bool = False,
):
    """Reduce ``input_list`` across the group and leave member i's chunk (group order) in ``output``.

    ``input_list`` is a list of ``group.size`` tensors shaped like ``output``, or one tensor of that many
    ``output``-sized chunks laid end to end. Returns ``output``, or a ``CommHandle`` whose ``wait()`` leaves the
    result there if ``async_op``. One contiguous tensor (in a group in torch's rank
    order) goes to the backend as it is (``reduce_scatter_single``); a list, or chunks to reorder, are concatenated
    into a staging buffer first (counted in ``comm.staging``).
    """
    g = _group(group)
    if host_staging.applies(g, output, input_list):
        return host_staging.call(reduce_scatter, "reduce_scatter", output, input_list, g, op, async_op)
    whole = None
    if isinstance(input_list, torch.Tensor):
        if input_list.numel() != output.numel() * g.size:
            raise CommError(
                f"reduce_scatter on group {g.name!r}: input has {input_list.numel()} elements, "
                f"need group size {g.size} x output {output.numel()}"
            )
        whole = input_list
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
    reason = None
    if whole is not None and order is None and whole.is_contiguous() and staging.flat_enabled():
        flat, copied, own = whole.view(-1), 0, False
    else:
        own = True
        flat = torch.cat([c.reshape(-1) for c in chunks])
        copied = flat.nbytes
        reason = "staged" if not staging.flat_enabled() else ("order" if order is not None else "list")
    nbytes = flat.nbytes
    out_flat = output.view(-1) if output.is_contiguous() else torch.empty_like(output).view(-1)
    tail = []  # what runs once the op has completed
    if out_flat.data_ptr() != output.data_ptr():
        tail.append(lambda: output.copy_(out_flat.view_as(output)))
        copied += output.nbytes
    if divide:
        tail.append(lambda: _divide(output, g.size))

    def finish() -> None:
        for step in tail:
            step()

    def issue_native(a):
        return _rs_single(out_flat, flat, op=rop, group=g.pg, async_op=a)

    native, handle = _try_flat("reduce_scatter", g, nbytes, issue_native, async_op, finish)
    if not native:  # the backend has no reduce-scatter: all-reduce a copy, keep this member's chunk
        if not own:  # the all-reduce writes its input: never the caller's
            flat = flat.clone()
            copied += nbytes
        me = sorted(g.ranks).index(g.global_rank)
        tail.insert(0, lambda: out_flat.copy_(flat.view(g.size, -1)[me]))
        copied, reason = copied + output.nbytes, "unsupported"
        issue_emulated = lambda a: dist.all_reduce(flat, op=rop, group=g.pg, async_op=a)  # noqa: E731
        handle = _run("reduce_scatter", g, nbytes, issue_emulated, async_op, finish)
    staging.account("reduce_scatter", g, "flat" if native else "emulated", nbytes, output.nbytes, copied, reason)
    return handle if async_op else output


def all_to_all(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: CommGroup | None = None,
) -> torch.Tensor:
    """Send rows ``[sum(input_splits[:i]), +input_splits[i])`` of ``tensor`` (dimension 0) to member i (group
    order) and receive member i's rows for this rank into ``output`` at ``sum(output_splits[:i])``; returns
    ``output``. Variable splits: every pair must agree (member i's ``input_splits[me]`` is this rank's
    ``output_splits[i]``), so callers exchange their counts first (an all-to-all of one count per member).
    The order log records the dtype and the row shape, not the row counts, which differ between members."""
    g = _group(group)
    if host_staging.applies(g, tensor, output):
        return host_staging.call(all_to_all, "all_to_all", output, tensor, output_splits, input_splits, g)
    n = g.size
    if len(output_splits) != n or len(input_splits) != n:
        raise CommError(
            f"all_to_all on group {g.name!r}: need {n} splits each way, got {input_splits}, {output_splits}"
        )
    if sum(input_splits) != tensor.shape[0] or sum(output_splits) != output.shape[0]:
        raise CommError(
            f"all_to_all on group {g.name!r}: splits sum to {sum(input_splits)} -> {sum(output_splits)} rows, "
            f"the tensors hold {tensor.shape[0]} -> {output.shape[0]}"
        )
    if _group_order(g) is not None:
        raise CommError(f"all_to_all on group {g.name!r}: its ranks {g.ranks} must be in increasing order")
    rules.admit("all_to_all", g, tensor[:0], output[:0])  # the row shape, the same on every member
    src, dst = tensor.contiguous(), output if output.is_contiguous() else torch.empty_like(output)

    def issue(a):
        return dist.all_to_all_single(dst, src, list(output_splits), list(input_splits), group=g.pg, async_op=a)

    dispatch.run("all_to_all", g, src.nbytes + dst.nbytes, issue)
    if dst is not output:
        output.copy_(dst)
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
