"""``tools/bench_tables.py``: result files rendered into RESULTS.md's generated sections, nothing else of the file
touched; smoke results kept out of RESULTS.md; ``make bench``'s run path end to end on one script's smoke mode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import bench_tables  # noqa: E402

MD = """# Results

Hand-written prose, kept | as it is.

<!-- bench:begin -->
<!-- bench:end -->

## History

| old | table |
|---|---|
| 1.041 | kept |
"""


def _record(name: str, ratio: float, smoke: bool = False) -> dict:
    return {
        "benchmark": name,
        "command": f"benchmarks/{name}.py",
        "smoke": smoke,
        "date": "2026-12-04 10:00 UTC",
        "commit": "abc1234",
        "machine": {
            "cpu": "Test CPU",
            "cores": 2,
            "memory_gib": 24.0,
            "python": "3.11.7",
            "torch": "2.13.0",
            "gpu": None,
            "load_avg_1m": 3.5,
        },  # fmt: skip
        "result": {
            "ratio_vs_peer": ratio,
            "ratio_iqr": [ratio - 0.1, ratio + 0.1],
            "ratio_min_max": [0.5, 2.0],
            "blocks": 8,
            "params_equal": True,
            "layouts": [{"name": "tp2", "error": -0.218}],
        },  # fmt: skip
    }


def _write(folder: Path, *records: dict) -> Path:
    folder.mkdir(exist_ok=True)
    for r in records:
        (folder / f"{r['benchmark']}.json").write_text(json.dumps(r))
    return folder


def test_sections_are_rendered_replaced_and_added_and_the_rest_of_the_file_is_kept(tmp_path):
    target = tmp_path / "RESULTS.md"
    target.write_text(MD)
    assert bench_tables.render(_write(tmp_path / "a", _record("dp_vs_ddp", 1.0123)), target) == ["dp_vs_ddp"]
    first = target.read_text()
    section = first[first.index("<!-- bench:dp_vs_ddp -->") : first.index("<!-- /bench:dp_vs_ddp -->")]
    assert "| ours ÷ peer | **1.012** | 0.9123–1.112 | 0.5–2 | 8 |" in section
    assert "Test CPU, 2 cores, 24.0 GiB, no GPU" in section and "2026-12-04 10:00 UTC" in section
    assert "commit abc1234" in section and "`benchmarks/dp_vs_ddp.py`" in section
    assert "| params_equal | yes |" in section and "| layouts[0].error | -0.218 |" in section
    # a second render replaces that section (the new figure, not the old one) and adds a new benchmark's after it
    bench_tables.render(_write(tmp_path / "b", _record("dp_vs_ddp", 0.987), _record("placement", 0.79)), target)
    second = target.read_text()
    assert "**0.987**" in second and "**1.012**" not in second and second.count("<!-- bench:dp_vs_ddp -->") == 1
    assert second.index("<!-- /bench:dp_vs_ddp -->") < second.index("<!-- bench:placement -->")
    assert second.index("<!-- /bench:placement -->") < second.index("<!-- bench:end -->")
    # everything outside the region is byte for byte what it was
    outside = MD.split("<!-- bench:begin -->")
    assert second.startswith(outside[0]) and second.endswith(MD.split("<!-- bench:end -->")[1])
    # rendering the same files again changes nothing
    bench_tables.render(tmp_path / "b", target)
    assert target.read_text() == second


def test_smoke_results_and_files_without_markers_are_refused(tmp_path):
    smoke = _write(tmp_path / "s", _record("dp_vs_ddp", 1.0, smoke=True))
    target = tmp_path / "RESULTS.md"
    target.write_text(MD)
    with pytest.raises(bench_tables.RenderError, match="smoke results .*dp_vs_ddp"):
        bench_tables.render(smoke, target)
    assert target.read_text() == MD
    with pytest.raises(bench_tables.RenderError, match="never go into benchmarks/RESULTS.md"):
        bench_tables.render(smoke, bench_tables.RESULTS, allow_smoke=True)
    bench_tables.render(smoke, target, allow_smoke=True)
    assert "smoke run: sizes too small to mean anything" in target.read_text()
    target.write_text(MD.replace("<!-- bench:end -->\n", ""))
    with pytest.raises(bench_tables.RenderError, match="needs one <!-- bench:begin --> line"):
        bench_tables.render(_write(tmp_path / "a", _record("dp_vs_ddp", 1.0)), target)


def test_the_repository_results_file_has_the_generated_region_and_no_smoke_figures():
    text = bench_tables.RESULTS.read_text()
    assert text.count(bench_tables.BEGIN) == 1 and text.count(bench_tables.END) == 1
    assert "smoke run: sizes too small" not in text


def test_make_bench_smoke_runs_a_script_and_renders_it_into_a_scratch_copy(tmp_path):
    """What ``make bench BENCH_FLAGS="--smoke --only packed_rows_step"`` does, into tmp_path."""
    out = tmp_path / "bench"
    real = bench_tables.RESULTS.read_text()
    code = bench_tables.main(["run", "--smoke", "--only", "packed_rows_step", "--json", str(out), "--timeout", "120"])
    assert code == 0
    copy = (out / "RESULTS.smoke.md").read_text()
    assert "<!-- bench:packed_rows_step -->" in copy and "`benchmarks/packed_rows_step.py --smoke`" in copy
    assert bench_tables.RESULTS.read_text() == real  # smoke figures never reach the real file
    assert json.loads((out / "packed_rows_step.json").read_text())["smoke"] is True
    with pytest.raises(SystemExit, match="unknown benchmark"):
        bench_tables.main(["run", "--smoke", "--only", "no_such_bench", "--json", str(out)])
