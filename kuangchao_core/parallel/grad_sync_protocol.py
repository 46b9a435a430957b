"""What the step loop needs from gradient synchronisation and the optimizer: :class:`GradSync`, the interface
:mod:`~kuangchao_core.parallel.grad_sync`'s ``ReplicatedAdamW`` and ``ShardedAdamW`` implement."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch


class GradSync(Protocol):
    """What the step loop needs from gradient synchronisation and the optimizer."""

    param_groups: list[dict[str, Any]]

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward inside this block accumulates locally and communicates nothing."""

    def zero_grad(self) -> None:
        """Clear gradients before a step."""

    def finish(self, accumulated: bool = False) -> None:
        """Complete the reduction of this step's gradients; ``accumulated``: every backward ran under no_sync."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm before clipping (each element once), a scalar tensor on the gradients' device (no
        host sync); clip to ``max_norm`` when it is > 0."""

    def step(self) -> None:
        """Apply the optimizer; afterwards every replica holds the same parameters."""

    def prepare(self) -> None:
        """Make every DP replica start from the same parameters (before training or after a load)."""

    def checkpoint_tensors(self, regions: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """This rank's optimizer tensors for a checkpoint and their slice metadata (collective)."""

    def load_state(self, optim: dict[str, torch.Tensor], steps: int) -> None:
        """Restore the optimizer from full-slice ``optim.<name>.<key>`` tensors after ``steps`` optimizer steps."""

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer-state tensors this rank holds (for memory accounting)."""

    def local_grads(self) -> list[torch.Tensor]:
        """The reduced gradient tensors this rank's optimizer will read (for loss-scale unscaling)."""

    def grad_norm_sq(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (float64 scalar on the gradients' device, each
        element weighted by ``norm_weight``); the sum over the mesh's groups is the square of what
        :meth:`clip_grad_norm` returns."""

    def memory_report(self) -> dict[str, Any] | None:
        """The optimizer's own account of the bytes each rank holds (measured beside the formulas), or None when it
        keeps no buffers of its own (replicated AdamW: the tensors are the model's)."""

    def tensor_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in ``params`` (trainable and frozen), ``grads`` and ``optimizer`` state (what
        ``kc plan`` estimates)."""

    def full_parameters(self, writeback: bool = False) -> contextlib.AbstractContextManager[None]:
        """Collective: inside the block the model's parameters hold their full values (ZeRO-3 keeps only shards
        between forwards; bf16 parameters show their fp32 masters); with ``writeback`` what was written is kept."""

    def comm_state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's gradient-exchange state (top-k residuals), saved per rank with a checkpoint; may be empty."""

    def load_comm_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`comm_state_tensors` gave (same layout, placement and compression)."""
