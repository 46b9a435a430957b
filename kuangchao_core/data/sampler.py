"""A distributed batch sampler whose position can be saved and restored exactly.

Index stream: epoch ``e`` is a permutation of ``range(num_samples)`` drawn from ``numpy`` seeded with
``[seed, e]`` (the identity when ``shuffle`` is false). Each optimizer step takes the next *global batch* of
``micro_batch_size * grad_accum * dp_size`` indices from the current epoch; when fewer remain, they are dropped
and the step starts the next epoch.

Mapping: the global batch is split into ``grad_accum * dp_size`` consecutive chunks of ``micro_batch_size``;
micro-step ``m`` of dp rank ``r`` gets chunk ``m * dp_size + r``. So the union over ranks of one step's indices
is the same set for any ``dp_size`` with the same global batch size (dp=2 equals dp=1 with twice the accumulation).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kuangchao_core.errors import DataError


class ResumableBatchSampler:
    """Yields this dp rank's micro-batch index lists, one optimizer step at a time."""

    def __init__(
        self,
        num_samples: int,
        micro_batch_size: int,
        grad_accum: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
    ):
        if min(micro_batch_size, grad_accum, dp_size) < 1:
            raise DataError(
                f"sampler sizes must be >= 1: micro_batch_size={micro_batch_size}, grad_accum={grad_accum}, "
                f"dp_size={dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        self.num_samples = int(num_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.grad_accum = int(grad_accum)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.global_batch_size = self.micro_batch_size * self.grad_accum * self.dp_size
        if self.num_samples < self.global_batch_size:
            raise DataError(
                f"dataset has {self.num_samples} sequences, fewer than one global batch of {self.global_batch_size} "
                f"(micro_batch_size {micro_batch_size} x gradient_accumulation_steps {grad_accum} x "
                f"data_parallel_size {dp_size}); add data, shorten data.seq_len or shrink the batch"
            )
        self.epoch = 0
        self.position = 0
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch."""
        return self.num_samples // self.global_batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                self._perm = np.arange(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def next_global_batch(self) -> list[int]:
        """Advance one step and return the whole global batch (all dp ranks' indices, in chunk order)."""
        if self.position + self.global_batch_size > self.num_samples:
            self.epoch += 1
            self.position = 0
        perm = self._permutation(self.epoch)
        batch = perm[self.position : self.position + self.global_batch_size].tolist()
        self.position += self.global_batch_size
        return batch

    def next_step(self) -> list[list[int]]:
        """Advance one optimizer step; this rank's index list for each of its ``grad_accum`` micro-steps."""
        return self.split(self.next_global_batch())[self.dp_rank]

    def split(self, batch: list[int]) -> list[list[list[int]]]:
        """A global batch as every dp rank's micro-step index lists (``[rank][micro-step]``)."""
        mbs, dp = self.micro_batch_size, self.dp_size
        return [[batch[(m * dp + r) * mbs : (m * dp + r + 1) * mbs] for m in range(self.grad_accum)] for r in range(dp)]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position (plus the identity of the stream, checked on load)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` (the dp layout may differ; the stream may not)."""
        for key in ("seed", "num_samples", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"sampler state was saved with {key}={state[key]!r} but this run has {key}={getattr(self, key)!r}; "
                    "resume with the same data and seed, or start without resuming"
                )
        position = int(state["position"])
        if not 0 <= position <= self.num_samples:
            raise DataError(f"sampler state position {position} is outside [0, {self.num_samples}]")
        self.epoch = int(state["epoch"])
        self.position = position
