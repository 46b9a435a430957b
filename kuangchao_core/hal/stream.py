"""Streams with one interface on every device: a real CUDA stream, or a no-op stream on CPU."""

from __future__ import annotations

import torch


class NullStream:
    """A stream on a device that executes in order anyway (CPU): every method is a no-op."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        """Wait for all work queued on the stream (nothing to wait for on CPU)."""

    def wait_stream(self, other) -> None:
        """Make future work on this stream wait for work queued on ``other``."""

    def query(self) -> bool:
        """Whether all queued work is done."""
        return True

    def record_event(self):
        """An event marking the current point of the stream (None on CPU)."""
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class CudaStream(NullStream):
    """A ``torch.cuda.Stream`` behind the HAL stream interface; ``with stream:`` makes it current."""

    def __init__(self, stream, device: torch.device) -> None:
        super().__init__(device)
        self.raw = stream
        self._ctx = None

    def synchronize(self) -> None:
        self.raw.synchronize()

    def wait_stream(self, other) -> None:
        self.raw.wait_stream(getattr(other, "raw", other))

    def query(self) -> bool:
        return self.raw.query()

    def record_event(self):
        return self.raw.record_event()

    def __enter__(self):
        self._ctx = torch.cuda.stream(self.raw)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(*exc)
