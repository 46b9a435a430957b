"""How one data-parallel gradient bucket is summed over the DP group (SPEC L2.5, L2.6).

:class:`BucketReducer` is what :class:`~kuangchao_core.parallel.data.DataParallel` calls for every bucket:

- flat (the default): one asynchronous ``all_reduce`` over the DP group, overlapped with the rest of backward;
- hierarchical (``parallel.hierarchical_allreduce``, when the DP group spans nodes): reduce-scatter inside the
  node, all-reduce of the shard across nodes, all-gather inside the node
  (:func:`~kuangchao_core.comm.hierarchical.hierarchical_all_reduce`);
- compressed (``parallel.grad_compression``): the cross-node step (or, without a hierarchy, the whole exchange)
  goes through a compressor of :mod:`kuangchao_core.parallel.grad_compression`; inside a node the sum stays dense.

The flat and the hierarchical sums are issued asynchronously when the bucket is launched and overlap the rest of
backward: the hierarchical one through a :class:`~kuangchao_core.comm.hierarchical.HierarchicalPipeline`, which
issues a bucket's intra-node reduce-scatter at its launch and its cross-node and intra-node steps at the next
launches (or at the final wait), in the same order on every rank. A compressed exchange without a hierarchy runs
when the bucket is launched (synchronously, in bucket order on every rank).
"""

from __future__ import annotations

import torch

from kuangchao_core.comm import primitives as comm
from kuangchao_core.comm.hierarchical import HierarchicalPipeline


class _Done:
    def wait(self) -> None:
        """Already complete."""


class BucketReducer:
    """Sums a bucket's flat buffer over ``group`` (in place); see the module docstring.

    ``intra``/``inter``: this rank's node-local and cross-node subgroups of ``group`` (both or neither);
    ``compressor``: a compressor (``exchange(key, tensor, group)``) or None.
    """

    def __init__(self, group, intra=None, inter=None, compressor=None):
        self.group = group
        self.intra, self.inter = intra, inter
        self.compressor = compressor
        self.pipeline = HierarchicalPipeline()  # ``pipeline.overlap = False``: each bucket's sum blocks its launch

    @property
    def kind(self) -> str:
        """``flat``, ``hierarchical``, plus ``+<compression>`` when one applies."""
        base = "hierarchical" if self.intra is not None else "flat"
        return base + (f"+{self.compressor.kind}" if self.compressor is not None else "")

    def launch(self, key: int, buffer: torch.Tensor):
        """Start (or run) the sum of bucket ``key``; returns a handle whose ``wait()`` completes it."""
        if self.intra is None and self.compressor is None:
            return comm.all_reduce(buffer, group=self.group, op="sum", async_op=True)
        if self.intra is not None:  # issued now, advanced at the next launches, completed by the handle's wait
            cross = None
            if self.compressor is not None:
                cross = lambda shard: self.compressor.exchange(key, shard, self.inter)  # noqa: E731
            return self.pipeline.start(buffer, self.intra, self.inter, cross=cross)
        buffer.copy_(self.compressor.exchange(key, buffer, self.group))
        return _Done()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The compressor's state (top-k residuals) for the checkpoint; empty otherwise."""
        return self.compressor.state_tensors() if self.compressor is not None else {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_tensors`."""
        if self.compressor is not None:
            self.compressor.load_state_tensors(tensors)


def reduce_scatter_sum(out: torch.Tensor, buf: torch.Tensor, group, dtype: torch.dtype, add=None) -> int:
    """This rank's chunk of the sum of ``buf`` over ``group`` (a ZeRO bucket, summed in ``dtype``) written into
    ``out`` (which may be ``buf``'s own chunk) or, given ``add`` (``data.accumulate_grad``), added to it by
    ``add(out, chunk)``; returns the bytes of the ``dtype`` copy of ``buf`` made for the wire (0: none made)."""
    if group.size == 1:
        if add is not None:
            add(out, buf)
        elif out.data_ptr() != buf.data_ptr():
            out.copy_(buf)
        return 0
    wire = buf if buf.dtype == dtype else buf.to(dtype)
    mine = out if wire.dtype == out.dtype and add is None else torch.empty_like(out, dtype=wire.dtype)
    comm.reduce_scatter(mine, wire, group=group, op="sum")
    if add is not None:
        add(out, mine)
    elif mine is not out:
        out.copy_(mine)
    return 0 if wire is buf else wire.numel() * wire.element_size()
