"""Background prefetch of the next steps' micro-batches (RT.4)."""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from kuangchao_core import guard_api
from kuangchao_core.errors import DataError


def collate(dataset, indices: list[int]) -> dict[str, torch.Tensor]:
    """Stack the items of ``indices`` into one dict of (batch, seq_len) tensors (a dataset with its own ``collate``,
    image data, collates itself)."""
    if hasattr(dataset, "collate"):
        return dataset.collate(indices)
    items = [dataset[i] for i in indices]
    return {key: torch.stack([it[key] for it in items]) for key in items[0]}


class StepBatches(list):
    """One step's micro-batches of this rank; ``labelled_per_rank``: the labelled tokens (labels not -100) of every
    dp rank's micro-batches of the step, where the dataset counts them from indices (``labelled_tokens``), so the
    step's loss normalisation needs no all-reduce (:mod:`kuangchao_core.parallel.step_loss`); else None."""

    labelled_per_rank: tuple[int, ...] | None = None


class PrefetchLoader:
    """A thread prepares up to ``depth`` future steps while the trainer computes the current one.

    ``depth=0`` prepares each step synchronously in :meth:`next_step` (no thread).
    ``state_dict()`` is the sampler position after the last step *returned* by :meth:`next_step` (not after
    the prefetched ones), so saving it and resuming replays exactly the steps not yet consumed.
    """

    def __init__(self, dataset, sampler, depth: int = 2, pin_memory: bool = False):
        if depth < 0:
            raise DataError(f"data.prefetch must be >= 0, got {depth}")
        self.dataset = dataset
        self.sampler = sampler
        self.depth = int(depth)
        self.pin_memory = pin_memory
        self._consumed_state = sampler.state_dict()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._start()

    def _start(self) -> None:
        if self.depth == 0:
            return
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._work, name="kc-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _prepare(self) -> tuple[StepBatches, dict[str, Any]]:
        ranks = self.sampler.split(self.sampler.next_global_batch())
        state = self.sampler.state_dict()
        batches = StepBatches(collate(self.dataset, idx) for idx in ranks[self.sampler.dp_rank])
        if self.pin_memory:
            batches = StepBatches({k: v.pin_memory() for k, v in b.items()} for b in batches)
        count = getattr(self.dataset, "labelled_tokens", None)
        if count is not None:  # every rank's share of the step, known here without communication
            batches.labelled_per_rank = tuple(sum(count(idx) for idx in steps) for steps in ranks)
        return batches, state

    def _work(self) -> None:
        with guard_api.thread_guard(guard_api.guard_for("data_loader")):  # the prefetch thread is the data loader
            self._loop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                batches, state = self._prepare()
                if not self._put(("ok", batches, state)):
                    return
        except BaseException as exc:  # handed to the trainer thread, which re-raises it
            self._put(("error", exc, None))

    def next_step(self) -> StepBatches:
        """The collated micro-batches of the next optimizer step, one dict per micro-step."""
        if self._closed:
            raise DataError("PrefetchLoader.next_step called after close()")
        if self._error is not None:
            raise self._error
        if self.depth == 0:
            batches, self._consumed_state = self._prepare()
            return batches
        kind, payload, state = self._queue.get()
        if kind == "error":
            self._error = payload
            raise payload
        self._consumed_state = state
        return payload

    def state_dict(self) -> dict[str, Any]:
        """Sampler position after the steps consumed so far."""
        return dict(self._consumed_state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Move to a saved position, dropping whatever was prefetched."""
        self._halt()
        self.sampler.load_state_dict(state)
        self._consumed_state = self.sampler.state_dict()
        self._start()

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop the background thread."""
        self._halt()
        self._closed = True

    def __enter__(self) -> PrefetchLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
