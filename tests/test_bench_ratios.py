"""The block statistics every ours-vs-peer benchmark reports, and the rule `benchmarks/agree.py` applies to runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"kc_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ratios = _load("_ratios")
agree = _load("agree")


def test_each_block_gives_the_ratio_of_its_medians_and_the_summary_is_their_median_and_spread():
    blocks = [
        ([2.0, 4.0, 3.0], [1.0, 1.0, 5.0]),  # 3 / 1
        ([1.0], [2.0]),  # 0.5
        ([6.0, 6.0], [3.0, 3.0]),  # 2
        ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0]),  # 1
        ([5.0], [4.0]),  # 1.25
    ]
    stats = ratios.block_stats(blocks)
    assert stats.ratios == (3.0, 0.5, 2.0, 1.0, 1.25)
    assert stats.median == 1.25 and (stats.lo, stats.hi) == (0.5, 3.0)
    # inclusive quartiles of 0.5, 1, 1.25, 2, 3: positions 1 and 3 of the sorted list
    assert (stats.q1, stats.q3) == (1.0, 2.0)
    fields = ratios.result_fields(stats)
    assert fields["ratio_vs_peer"] == 1.25 and fields["ratio_iqr"] == [1.0, 2.0]
    assert fields["ratio_min_max"] == [0.5, 3.0] and fields["blocks"] == 5
    # pooling every timing instead (what the benchmarks printed before) gives another figure: the blocks matter
    pooled = sorted(t for o, _ in blocks for t in o)[len([t for o, _ in blocks for t in o]) // 2]
    assert pooled != stats.median


def test_a_block_without_timings_is_refused():
    with pytest.raises(ValueError, match="block 1 has no timings for the peer"):
        ratios.block_stats([([1.0], [1.0]), ([1.0], [])])


def _run(median: float, lo: float, hi: float) -> dict:
    return {"ratio_vs_peer": median, "ratio_iqr": [lo, hi], "ratio_min_max": [lo, hi], "blocks": 8}


def test_runs_agree_only_when_every_median_lies_in_each_other_runs_min_max():
    runs = [_run(1.00, 0.95, 1.06), _run(1.02, 0.97, 1.08), _run(0.99, 0.93, 1.04)]
    ok, notes = agree.check([agree.comparisons(r)[""] for r in runs])
    assert ok and notes == ["", "", ""]
    runs[2] = _run(1.10, 1.05, 1.15)  # its median lies outside the first run's spread (and theirs outside its own)
    ok, notes = agree.check([agree.comparisons(r)[""] for r in runs])
    assert not ok and "run 1's 0.950–1.060" in notes[2] and "run 3's" in notes[0]


def test_a_benchmark_with_several_comparisons_is_checked_one_comparison_at_a_time():
    def result(a: float, b: float) -> dict:
        return {
            "ratio_vs_peer": {"1f1b_p2": a, "1f1b_p4": b},
            "ratio_iqr": {"1f1b_p2": [a - 0.01, a + 0.01], "1f1b_p4": [b - 0.01, b + 0.01]},
            "ratio_min_max": {"1f1b_p2": [a - 0.05, a + 0.05], "1f1b_p4": [b - 0.05, b + 0.05]},
            "blocks": {"1f1b_p2": 10, "1f1b_p4": 10},
        }

    runs = [agree.comparisons(result(1.0, 0.9)), agree.comparisons(result(1.02, 1.2))]
    assert agree.check([r["1f1b_p2"] for r in runs])[0]
    assert not agree.check([r["1f1b_p4"] for r in runs])[0]
