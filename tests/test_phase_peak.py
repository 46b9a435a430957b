"""``engine.metrics.start_phase``: a step's ``mem_bytes`` is that step's peak on CUDA, and the CPU's figure is
unchanged.

The peak is a CUDA allocator figure: the engine measures no peak on the CPU (it reports the resident set size, a
current value). So the phase logic runs here against a stand-in for the allocator's statistics with CUDA's
documented semantics (``reset_peak_memory_stats`` sets the peak to what is allocated now;
``max_memory_allocated`` is the largest allocation total since), passed where ``torch.cuda`` is used on a GPU; the
GPU check (``benchmarks/gpu/check.py``, ``phase_peak``) runs the same two calls on the real allocator.
Negative control: the same phases without ``start_phase`` report the earlier, larger phase's peak.
"""

from __future__ import annotations

import torch

from kuangchao_core.engine import metrics

CUDA = torch.device("cuda", 0)


class AllocatorStats:
    """CUDA's caching allocator statistics as ``torch.cuda`` exposes them, for a device that is not here."""

    def __init__(self) -> None:
        self.allocated = 0
        self.peak = 0

    def is_available(self) -> bool:
        return True

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def reset_peak_memory_stats(self, device) -> None:
        assert device == CUDA
        self.peak = self.allocated

    def max_memory_allocated(self, device) -> int:
        assert device == CUDA
        return self.peak


def _two_phases(stats: AllocatorStats, reset: bool) -> list[int]:
    """A build phase that peaks at 1000 and keeps 100 (the parameters), then two steps peaking 300 above that."""
    seen = []
    stats.alloc(1000)
    stats.free(900)
    for _ in range(2):
        if reset:
            metrics.start_phase(CUDA, stats)
        stats.alloc(300)
        stats.free(300)
        seen.append(metrics.memory_bytes(CUDA, stats))
    return seen


def test_each_step_reports_its_own_peak_after_start_phase():
    assert _two_phases(AllocatorStats(), reset=True) == [400, 400]


def test_without_start_phase_the_build_peak_is_reported_instead():
    assert _two_phases(AllocatorStats(), reset=False) == [1000, 1000]


def test_the_cpu_figure_is_the_resident_set_size_and_start_phase_leaves_it_alone():
    cpu = torch.device("cpu")
    assert metrics.memory_kind(cpu) == "rss"
    page = __import__("os").sysconf("SC_PAGE_SIZE")
    before = metrics.memory_bytes(cpu)
    metrics.start_phase(cpu)
    with open("/proc/self/statm", encoding="ascii") as fh:
        rss = int(fh.read().split()[1]) * page
    after = metrics.memory_bytes(cpu)
    # the same current figure as /proc/self/statm, read around it (no allocation of note in between)
    assert abs(after - rss) <= 64 * page and abs(before - rss) <= 64 * page
    # 64 MiB of fresh anonymous pages, each touched (a tensor could reuse memory the allocator already holds)
    big = __import__("mmap").mmap(-1, 64 * 2**20)
    for offset in range(0, len(big), page):
        big[offset] = 1
    held = metrics.memory_bytes(cpu)
    big.close()
    # a current value, not a peak: it rises with the touched pages (and need not stay up once they are unmapped)
    assert held - after >= 48 * 2**20
