"""Block statistics of an ours-vs-peer benchmark (issue 13: benchmarks you can trust).

A benchmark alternates the two sides in blocks: each block is one contiguous run of ours and one of the peer, the
order flipped every block, so that load drift on a shared machine hits both alike. Each block gives one ratio,
median of ours' step times in the block ÷ median of the peer's; the figure reported is the median of these
per-block ratios, with their spread (interquartile range and min–max) and the number of blocks:

    stats = block_stats([(ours_times_block_0, peer_times_block_0), ...])
    print(format_line("ours ÷ ddp", stats))
    result.update(result_fields(stats))   # ratio_vs_peer, ratio_iqr, ratio_min_max, blocks

Quartiles are ``statistics.quantiles(ratios, n=4, method="inclusive")``: linear interpolation between the sorted
ratios at positions (n−1)·k/4 (numpy's default ``percentile``), so q1 and q3 always lie between the smallest and
the largest ratio; with one block all of them equal that block's ratio. ``benchmarks/agree.py`` reads these
fields to check that repeated runs agree.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: the RESULT fields of one comparison, in order
FIELDS = ("ratio_vs_peer", "ratio_iqr", "ratio_min_max", "blocks")


@dataclass(frozen=True)
class RatioStats:
    """Per-block ratios of one comparison and their summary (see :func:`block_stats`)."""

    ratios: tuple[float, ...]
    median: float
    q1: float
    q3: float
    lo: float
    hi: float

    @property
    def n(self) -> int:
        """Number of blocks."""
        return len(self.ratios)


def block_ratios(blocks: Sequence[tuple[Sequence[float], Sequence[float]]]) -> list[float]:
    """One ratio per block: median of ours' times in the block ÷ median of the peer's.

    ``blocks``: per block, ``(ours_times, peer_times)`` (seconds or any unit common to both; each non-empty)."""
    out = []
    for i, (ours, peer) in enumerate(blocks):
        if not ours or not peer:
            raise ValueError(f"block {i} has no timings for {'ours' if not ours else 'the peer'}")
        out.append(statistics.median(ours) / statistics.median(peer))
    return out


def block_stats(blocks: Sequence[tuple[Sequence[float], Sequence[float]]]) -> RatioStats:
    """The per-block ratios of ``blocks`` (see :func:`block_ratios`), their median, quartiles (inclusive method,
    see the module docstring) and min–max."""
    ratios = block_ratios(blocks)
    if not ratios:
        raise ValueError("no blocks")
    if len(ratios) == 1:
        q1 = q3 = ratios[0]
    else:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return RatioStats(tuple(ratios), statistics.median(ratios), q1, q3, min(ratios), max(ratios))


def format_line(label: str, stats: RatioStats, digits: int = 3) -> str:
    """One printed line: ``label: median of N per-block ratios M (IQR q1–q3, min–max lo–hi)``."""
    f = f"{{:.{digits}f}}"
    return (
        f"{label}: median of {stats.n} per-block ratios {f.format(stats.median)} "
        f"(IQR {f.format(stats.q1)}–{f.format(stats.q3)}, min–max {f.format(stats.lo)}–{f.format(stats.hi)})"
    )


def result_fields(stats: RatioStats, digits: int = 4) -> dict:
    """The ``RESULT`` fields of one comparison: ``ratio_vs_peer`` (median of the per-block ratios), ``ratio_iqr``
    ``[q1, q3]``, ``ratio_min_max`` ``[min, max]`` and ``blocks`` (their number)."""
    return {
        "ratio_vs_peer": round(stats.median, digits),
        "ratio_iqr": [round(stats.q1, digits), round(stats.q3, digits)],
        "ratio_min_max": [round(stats.lo, digits), round(stats.hi, digits)],
        "blocks": stats.n,
    }


def keyed_result_fields(stats: dict[str, RatioStats], digits: int = 4) -> dict:
    """The ``RESULT`` fields of several comparisons of one benchmark: each of :func:`result_fields`' keys maps
    comparison name -> value (``blocks`` too), e.g. ``{"ratio_vs_peer": {"1f1b_p2": 0.98, ...}, ...}``."""
    per = {name: result_fields(s, digits) for name, s in stats.items()}
    return {field: {name: fields[field] for name, fields in per.items()} for field in FIELDS}
