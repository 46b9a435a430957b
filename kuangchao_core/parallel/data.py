"""Data parallel (SPEC L3.1): a full replica per worker, bucketed gradient all-reduce overlapped with backward.

How it works:

- Parameters that require gradients are assigned to buckets in *reverse registration order* (roughly the order in
  which backward produces their gradients). Each bucket owns one flat gradient buffer; ``param.grad`` is made a view
  into it, so autograd accumulates straight into the buffer and no copy is needed before communication.
- A post-accumulate-grad hook on every parameter marks it ready. When every parameter of a bucket is ready, the
  bucket's ``all_reduce`` is launched asynchronously through ``kuangchao_core.comm.primitives`` (so the permission
  guard and the communication timers see it) while the rest of backward keeps running. Buckets are always launched
  in bucket order, so every rank issues its collectives in the same sequence even if hooks fire in a different order.
- :meth:`DataParallel.finish_gradient_sync` launches whatever is left (parameters that got no gradient in this
  backward contribute zeros), waits for every bucket and averages: **sum, then divide by the group size** (Gloo has no
  ``avg``; dividing after the sum keeps one rounding path for every backend).
- Gradient accumulation: micro-steps run inside ``with dp.no_sync():`` accumulate locally with no communication;
  only the last micro-step's backward communicates. Averaging over micro-steps is the engine's job: scale each
  micro-step's loss by ``1 / grad_accum``.
- Main gradients (``main_grads=True``, Megatron's ``main_grad``; bf16 parameters with fp32 master weights use it):
  the buckets (in ``grad_dtype``, built for a group of size 1 too) are where gradients live. Every backward's
  gradient is added into its parameter's slot by the hook (:func:`accumulate_grad`) and ``param.grad`` is dropped,
  so gradient accumulation sums in ``grad_dtype`` (fp32), never in the parameters' bf16; the reduction runs on the
  buckets and nothing is copied back: the caller reads :meth:`DataParallel.main_grad`.
- Parameters held apart (``apart``: name -> the group of the ranks holding the same values, a subgroup of
  ``group``; issue 40's experts sharded over ``ep``) stay out of the buckets: their gradients accumulate in
  ``param.grad`` and :meth:`finish_gradient_sync` sums them over their group and divides by the size of ``group``
  (every replica's tokens reached them); :meth:`sync_parameters` broadcasts them over their group.

Typical step::

    dp = DataParallel(model, group)
    dp.sync_parameters()
    opt = torch.optim.AdamW(dp.parameters())
    for i, batch in enumerate(micro_batches):
        with dp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss_fn(dp(batch)) / len(micro_batches)).backward()
    dp.finish_gradient_sync()
    opt.step()
    dp.zero_grad()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kuangchao_core.comm import primitives as comm
from kuangchao_core.errors import KuangchaoError
from kuangchao_core.hal.memory import pool_zeros

_MB = 1024 * 1024


def accumulate_grad(dst: torch.Tensor, grad: torch.Tensor) -> None:
    """Add one backward's gradient ``grad`` into its main-gradient slot ``dst`` (the sum in ``dst``'s dtype: an
    fp32 slot holds the exact fp32 sum of bf16 gradients, each widened exactly)."""
    dst.add_(grad.reshape(dst.shape))


class _Done:
    def wait(self) -> None:
        """Nothing was launched (a group of size 1)."""


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    as_view: bool  # param.grad is a view into ``buffer`` (same dtype); otherwise grads are copied in and out
    pending: int = 0
    handle: object | None = None
    ready: list[bool] = field(default_factory=list)

    def reset(self) -> None:
        self.pending = len(self.params)
        self.handle = None
        self.ready = [False] * len(self.params)


class DataParallel(torch.nn.Module):
    """Wrap ``module`` so that its gradients are averaged over ``group`` with bucketed, overlapped all-reduces.

    Args:
        module: the model replica held by this process.
        group: the data-parallel ``CommGroup`` (``ranks``, ``size``, ``rank``, ``name``).
        bucket_cap_mb: upper bound of one bucket's gradient buffer in MiB. The first bucket (the last layers) is
            capped at ``min(1, bucket_cap_mb)`` MiB so that communication starts early in backward.
        grad_dtype: dtype in which gradients are reduced; ``None`` means each parameter's own dtype. When it differs
            from a parameter's dtype the gradient is copied into the bucket and back instead of living in it.
        reducer: how a bucket is summed (:class:`~kuangchao_core.parallel.bucket_reduce.BucketReducer`); default
            one flat asynchronous all-reduce over ``group``.
        main_grads: the buckets hold the gradients (module docstring): every backward adds into them, under
            :meth:`no_sync` too, ``param.grad`` is dropped and :meth:`main_grad` is each parameter's averaged sum.
        apart: parameter name -> the group its gradient is summed over instead (module docstring).

    ``forward`` is the wrapped module's; ``dp.module`` is the bare model (use it for checkpoint names).
    A group of size 1 performs no communication at all.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        group,
        bucket_cap_mb: float = 25,
        grad_dtype: torch.dtype | None = None,
        reducer=None,
        main_grads: bool = False,
        apart: dict | None = None,
    ):
        super().__init__()
        if bucket_cap_mb <= 0:
            raise KuangchaoError(
                f"DataParallel: bucket_cap_mb must be > 0, got {bucket_cap_mb}; set parallel.bucket_size_mb to a positive value"
            )
        self.module = module
        self.group = group
        self.bucket_cap_mb = bucket_cap_mb
        self.grad_dtype = grad_dtype
        if reducer is None:
            from kuangchao_core.parallel.bucket_reduce import BucketReducer

            reducer = BucketReducer(group)
        self.reducer = reducer
        self.main_grads = main_grads
        self._sync_enabled = True
        self._backward_seen = False  # a synchronized backward has produced gradients since the last finish
        self._next_launch = 0
        self._buckets: list[_Bucket] = []
        self._where: dict[torch.nn.Parameter, tuple[int, int]] = {}
        self._hooks = []
        named = dict(module.named_parameters())
        if apart and main_grads:
            raise KuangchaoError("DataParallel: parameters held apart take no main gradients (bf16 parameters)")
        self._apart = [(named[n], g) for n, g in (apart or {}).items() if named[n].requires_grad]
        held_apart = {id(p) for p, _ in self._apart}
        self._params = [p for p in module.parameters() if p.requires_grad and id(p) not in held_apart]
        if group.size > 1 or main_grads:
            self._build_buckets()
        for p in self._params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    # ------------------------------------------------------------------ set-up
    def _build_buckets(self) -> None:
        cap = int(self.bucket_cap_mb * _MB)
        first_cap = min(_MB, cap)
        open_buckets: dict[tuple, list[torch.nn.Parameter]] = {}
        open_bytes: dict[tuple, int] = {}
        groups: list[tuple[tuple, list[torch.nn.Parameter]]] = []
        for p in reversed(self._params):
            rdtype = self.grad_dtype or p.dtype
            key = (p.device, p.dtype, rdtype)
            nbytes = p.numel() * torch.empty((), dtype=rdtype).element_size()
            limit = first_cap if not groups else cap
            if key in open_buckets and open_bytes[key] + nbytes > limit and open_buckets[key]:
                groups.append((key, open_buckets.pop(key)))
                open_bytes.pop(key)
            open_buckets.setdefault(key, []).append(p)
            open_bytes[key] = open_bytes.get(key, 0) + nbytes
        groups.extend(open_buckets.items())
        for key, params in groups:
            device, pdtype, rdtype = key
            total = sum(p.numel() for p in params)
            buffer = pool_zeros(total, rdtype, device, "dp.grad_buckets", "grads")
            views, offset = [], 0
            for p in params:
                views.append(buffer[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            as_view = pdtype == rdtype and not self.main_grads
            bucket = _Bucket(params=params, buffer=buffer, views=views, as_view=as_view)
            bucket.reset()
            idx = len(self._buckets)
            self._buckets.append(bucket)
            for i, p in enumerate(params):
                self._where[p] = (idx, i)
                if bucket.as_view:
                    if p.grad is not None:
                        views[i].copy_(p.grad)
                    p.grad = views[i]

    # ------------------------------------------------------------------ public API
    def forward(self, *args, **kwargs):
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    @property
    def num_buckets(self) -> int:
        """How many gradient buckets this replica communicates per step (0 for a group of size 1)."""
        return len(self._buckets)

    def main_grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        """``p``'s slot of its bucket, shaped like ``p`` (with ``main_grads``: its gradient summed over this step's
        backwards, averaged over the group once :meth:`finish_gradient_sync` has run)."""
        b, i = self._where[p]
        return self._buckets[b].views[i]

    def bucket_params(self) -> list[list[str]]:
        """Parameter names of every bucket, in launch order (for logs and tests)."""
        names = {p: n for n, p in self.module.named_parameters()}
        return [[names[p] for p in b.params] for b in self._buckets]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this block backward accumulates gradients locally and communicates nothing."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def sync_parameters(self) -> None:
        """Broadcast parameters and floating-point buffers from the group's first rank so replicas start equal."""
        if self.group.size <= 1:
            return
        src = self.group.ranks[0]
        held_apart = {id(p) for p, _ in self._apart}
        with torch.no_grad():
            for p, g in (item for item in self._apart if item[1].size > 1):
                comm.broadcast(p.data, src=g.ranks[0], group=g)
        tensors = [p.data for p in self.module.parameters() if id(p) not in held_apart] + [
            b for b in self.module.buffers() if torch.is_floating_point(b)
        ]
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.device, t.dtype), []).append(t)
        with torch.no_grad():
            for group_tensors in by_kind.values():
                flat = torch.cat([t.reshape(-1) for t in group_tensors])
                comm.broadcast(flat, src=src, group=self.group)
                offset = 0
                for t in group_tensors:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def sync_accumulated(self) -> None:
        """All-reduce gradients accumulated entirely under :meth:`no_sync` (pipeline schedules run every backward
        there), then average them: :meth:`finish_gradient_sync` without the synchronized last backward."""
        self._backward_seen = True
        self.finish_gradient_sync()

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket's all-reduce and average the gradients over the group.

        Call once after the backward of the last micro-step. Parameters that got no gradient in this backward
        contribute zeros (their averaged gradient may still be non-zero if another rank used them).
        """
        if not self._backward_seen:
            raise KuangchaoError(
                f"DataParallel.finish_gradient_sync on group {self.group.name!r}: no synchronized backward since the "
                "last call; call it exactly once per optimizer step, after loss.backward() of the last micro-step "
                "(outside no_sync())"
            )
        self._backward_seen = False
        self._reduce_apart()
        if not self._buckets:
            return
        size = self.group.size
        for bucket in self._buckets[self._next_launch :]:
            for i, p in enumerate(bucket.params):
                if not bucket.ready[i]:
                    self._take_gradient(bucket, i, p, missing_is_zero=True)
                    bucket.ready[i] = True
            bucket.pending = 0
        self._launch_in_order()
        for bucket in self._buckets:
            bucket.handle.wait()
            if size > 1:
                bucket.buffer.div_(size)
            if not bucket.as_view and not self.main_grads:
                for p, view in zip(bucket.params, bucket.views, strict=True):
                    if p.grad is None:
                        p.grad = view.to(p.dtype)
                    else:
                        p.grad.copy_(view)
            bucket.reset()
        self._next_launch = 0

    def _reduce_apart(self) -> None:
        """Sum the gradients of the parameters held apart over their groups, then divide by this group's size."""
        by_group: dict[int, tuple] = {}
        for p, g in self._apart:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_group.setdefault(id(g), (g, []))[1].append(p)
        for g, params in by_group.values():
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            if g.size > 1:
                comm.all_reduce(flat, group=g, op="sum")
            flat.div_(self.group.size)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()

    def zero_grad(self) -> None:
        """Zero every gradient in place (bucket buffers included); ``param.grad`` stays a view into its bucket."""
        if any(b.handle is not None for b in self._buckets):
            raise KuangchaoError(
                "DataParallel.zero_grad: gradient all-reduces are still in flight; call finish_gradient_sync() first"
            )
        for bucket in self._buckets:
            bucket.buffer.zero_()
            if bucket.as_view:
                for p, view in zip(bucket.params, bucket.views, strict=True):
                    p.grad = view
        for p in self._params:
            if p.grad is not None and (p not in self._where or not self._buckets[self._where[p][0]].as_view):
                p.grad.zero_()
        for p, _ in self._apart:
            p.grad = None

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the wrapped module's parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ internals
    def _take_gradient(self, bucket: _Bucket, i: int, p: torch.nn.Parameter, missing_is_zero: bool) -> None:
        """Make bucket slot ``i`` hold ``p``'s gradient (bind the view, or copy in for a reduce dtype)."""
        view = bucket.views[i]
        grad = p.grad
        if self.main_grads:  # the slot keeps what earlier backwards added (zeros after zero_grad)
            if grad is not None:
                accumulate_grad(view, grad)
                p.grad = None
            return
        if grad is None:
            if missing_is_zero:
                view.zero_()
                if bucket.as_view:
                    p.grad = view
            return
        if bucket.as_view:
            if grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                p.grad = view
        else:
            view.copy_(grad)

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if not self._sync_enabled:
            loc = self._where.get(p)
            if loc is not None and (self._buckets[loc[0]].as_view or self.main_grads):
                self._take_gradient(self._buckets[loc[0]], loc[1], p, missing_is_zero=False)
            return
        self._backward_seen = True
        loc = self._where.get(p)
        if loc is None:
            return
        b, i = loc
        bucket = self._buckets[b]
        if bucket.ready[i]:
            raise KuangchaoError(
                f"DataParallel on group {self.group.name!r}: a gradient became ready twice in one synchronized step "
                "(two backward passes without finish_gradient_sync() in between); run all but the last micro-step "
                "inside dp.no_sync() and call finish_gradient_sync() after each optimizer step's last backward"
            )
        self._take_gradient(bucket, i, p, missing_is_zero=False)
        bucket.ready[i] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            bucket = self._buckets[self._next_launch]
            bucket.handle = self.reducer.launch(self._next_launch, bucket.buffer) if self.group.size > 1 else _Done()
            self._next_launch += 1
