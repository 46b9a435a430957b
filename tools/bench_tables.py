"""``make bench``: run the benchmark scripts and render their results into ``benchmarks/RESULTS.md`` (issue 42).

Every script ends with ``benchmarks/_results.emit``, which with ``KC_BENCH_JSON=DIR`` writes ``DIR/<name>.json``:
the result, the command, the machine, the date and the commit. This tool renders each such file as one table
between generated-section markers of RESULTS.md and leaves every other line of the file as it was:

    <!-- bench:begin -->            the generated region (new benchmarks' sections are added at its end)
    <!-- bench:dp_vs_ddp -->        one section per benchmark, replaced whole on every render
    ...
    <!-- /bench:dp_vs_ddp -->
    <!-- bench:end -->

    python tools/bench_tables.py run [--only dp_vs_ddp,placement] [--into benchmarks/RESULTS.md]   # make bench
    python tools/bench_tables.py run --smoke        # every script's smoke mode, rendered into a scratch copy
    python tools/bench_tables.py render --json DIR --into FILE [--allow-smoke]

Smoke results never go into ``benchmarks/RESULTS.md`` (``render`` refuses them without ``--allow-smoke``, and
``run --smoke`` writes to ``runs/bench/RESULTS.smoke.md`` unless told otherwise). ``run`` skips ``agree.py`` (it
repeats another benchmark), the sections of ``gpu/check.py`` (it runs them) and, where they cannot run, the GPU scripts (no CUDA) and the multi-host ones (exit
status 2: no root for network namespaces), and says so; any other failure is reported and makes the exit status 1
after the others have run and been rendered.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._results import SECTIONS  # noqa: E402

BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "RESULTS.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
SKIP_IN_RUN = ("agree.py",)  # the repeat-runs checker: it reruns a benchmark, it is not one
CANNOT_RUN_HERE = 2  # the exit status of a script that cannot run on this machine (no GPU, no root)


class RenderError(ValueError):
    """RESULTS.md or a result file is not what the renderer can update."""


def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _flatten(prefix: str, value, out: list[tuple[str, str]]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        for i, v in enumerate(value):
            _flatten(f"{prefix}[{i}]", v, out)
    else:
        out.append((prefix, _fmt(value)))


def ratio_rows(result: dict) -> list[list[str]]:
    """The ours-vs-peer comparisons of a result (``benchmarks/_ratios.py``'s fields): one row per comparison,
    ``[comparison, median, IQR, min–max, blocks]``."""
    ratio = result.get("ratio_vs_peer")
    if ratio is None:
        return []
    keyed = isinstance(ratio, dict)
    names = list(ratio) if keyed else [""]

    def get(field: str, name: str):
        v = result.get(field)
        return v.get(name) if keyed and isinstance(v, dict) else v

    rows = []
    for name in names:
        iqr, mm = get("ratio_iqr", name), get("ratio_min_max", name)
        rows.append(
            [
                name or "ours ÷ peer",
                f"**{_fmt(get('ratio_vs_peer', name))}**",
                "–".join(_fmt(v) for v in iqr) if isinstance(iqr, list) else _fmt(iqr),
                "–".join(_fmt(v) for v in mm) if isinstance(mm, list) else _fmt(mm),
                _fmt(get("blocks", name)),
            ]
        )
    return rows


def render_section(record: dict) -> str:
    """One benchmark's generated section (markers included): what ran where and when, its comparisons and every
    other figure of its result."""
    for field in ("benchmark", "command", "date", "machine", "result"):
        if field not in record:
            raise RenderError(f"result file of {record.get('benchmark', '?')!r} has no {field!r}")
    name, m, result = record["benchmark"], record["machine"], record["result"]
    where = f"{m.get('cpu')}, {m.get('cores')} cores"
    where += f", {m['memory_gib']} GiB" if m.get("memory_gib") else ""
    where += f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU"
    where += f"; Python {m.get('python')}, torch {m.get('torch', '?')}"
    if m.get("load_avg_1m") is not None:
        where += f"; load average {m['load_avg_1m']} at the end"
    lines = [
        f"<!-- bench:{name} -->",
        f"**`{name}`** — `{record['command']}`, {record['date']}, commit {record.get('commit') or '?'}"
        + (" (**smoke run: sizes too small to mean anything**)" if record.get("smoke") else ""),
        f"on {where}.",
        "",
    ]
    ratios = ratio_rows(result)
    if ratios:
        lines += ["| comparison | median of per-block ratios | IQR | min–max | blocks |", "|---|---|---|---|---|"]
        lines += ["| " + " | ".join(r) + " |" for r in ratios]
        lines.append("")
    rest: list[tuple[str, str]] = []
    skip = ("ratio_vs_peer", "ratio_iqr", "ratio_min_max", "blocks") if ratios else ()
    for key, value in result.items():
        if key not in skip:
            _flatten(key, value, rest)
    if rest:
        lines += ["| figure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rest] + [""]
    lines.append(f"<!-- /bench:{name} -->")
    return "\n".join(lines)


def update(text: str, records: list[dict]) -> str:
    """``text`` (RESULTS.md) with each record's section replaced (or added at the end of the generated region);
    every line outside the replaced sections is kept."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise RenderError(f"RESULTS.md needs one {BEGIN} line and, after it, one {END} line")
    for record in sorted(records, key=lambda r: r["benchmark"]):
        section = render_section(record)
        name = record["benchmark"]
        pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->\n.*?<!-- /bench:{re.escape(name)} -->", re.S)
        found = pattern.findall(text)
        if len(found) > 1:
            raise RenderError(f"RESULTS.md has {len(found)} sections of {name!r}")
        if found:
            text = pattern.sub(lambda _m, s=section: s, text)
        else:
            text = text.replace(END, section + "\n\n" + END)
    return text


def load_records(json_dir: Path, allow_smoke: bool) -> list[dict]:
    """The result files of ``json_dir``; smoke runs refused unless ``allow_smoke``."""
    records = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(Path(json_dir).glob("*.json"))]
    smoke = [r["benchmark"] for r in records if r.get("smoke")]
    if smoke and not allow_smoke:
        raise RenderError(f"smoke results ({', '.join(smoke)}) are not figures: render them with --allow-smoke only")
    return records


def render(json_dir: Path, into: Path, allow_smoke: bool = False) -> list[str]:
    """Render every result file of ``json_dir`` into ``into``; the benchmarks rendered."""
    records = load_records(json_dir, allow_smoke)
    if any(r.get("smoke") for r in records) and into.resolve() == RESULTS.resolve():
        raise RenderError(f"smoke results never go into {RESULTS.relative_to(ROOT)}: render into a copy")
    into.write_text(update(into.read_text(encoding="utf-8"), records), encoding="utf-8")
    return [r["benchmark"] for r in records]


def bench_scripts() -> list[Path]:
    """The scripts ``run`` runs: every benchmark script but the repeat-runs checker."""
    paths = sorted(BENCH.glob("[!_]*.py")) + sorted((BENCH / "gpu").glob("[!_]*.py"))
    return [p for p in paths if p.name not in SKIP_IN_RUN and p.relative_to(BENCH).as_posix() not in SECTIONS]


def _stem(path: Path) -> str:
    rel = path.relative_to(BENCH).with_suffix("").as_posix()
    return rel.replace("/", "-")


def run(smoke: bool, only: list[str] | None, json_dir: Path, into: Path, timeout_s: float | None) -> int:
    """Run the scripts (``only``: those names) with ``KC_BENCH_JSON=json_dir``, then render; exit status."""
    chosen = [p for p in bench_scripts() if not only or _stem(p) in only or p.stem in only]
    if only and len(chosen) != len(set(only)):
        known = ", ".join(_stem(p) for p in bench_scripts())
        raise SystemExit(f"bench_tables: unknown benchmark among {only} (known: {known})")
    json_dir.mkdir(parents=True, exist_ok=True)
    for stale in json_dir.glob("*.json"):
        stale.unlink()
    env = {**os.environ, "KC_BENCH_JSON": str(json_dir), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    failed, skipped = [], []
    for path in chosen:
        argv = [sys.executable, str(path), *(["--smoke"] if smoke else [])]
        print(f"== {path.relative_to(ROOT)}{' --smoke' if smoke else ''}", flush=True)
        try:
            code = subprocess.run(argv, cwd=ROOT, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        if code == CANNOT_RUN_HERE:
            skipped.append(_stem(path))
        elif code != 0:
            failed.append(f"{_stem(path)} ({code})")
    rendered = render(json_dir, into, allow_smoke=smoke) if any(json_dir.glob("*.json")) else []
    print(f"bench_tables: rendered {len(rendered)} benchmark(s) into {into}: {', '.join(rendered) or 'none'}")
    if skipped:
        print(f"bench_tables: cannot run on this machine (exit {CANNOT_RUN_HERE}): {', '.join(skipped)}")
    if failed:
        print(f"bench_tables: FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the benchmarks, then render their results")
    r.add_argument("--smoke", action="store_true", help="each script's smoke mode (rendered into a scratch copy)")
    r.add_argument("--only", default="", help="comma-separated names (dp_vs_ddp, gpu-check); default: all")
    r.add_argument("--json", default=str(ROOT / "runs" / "bench"), help="where the result files go")
    r.add_argument("--into", default=None, help="the file to render into (default RESULTS.md; smoke: a copy)")
    r.add_argument("--timeout", type=float, default=None, help="seconds one script may take")
    g = sub.add_parser("render", help="render result files into a RESULTS.md")
    g.add_argument("--json", required=True)
    g.add_argument("--into", default=str(RESULTS))
    g.add_argument("--allow-smoke", action="store_true")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "render":
            names = render(Path(args.json), Path(args.into), args.allow_smoke)
            print(f"bench_tables: rendered {', '.join(names) or 'nothing'} into {args.into}")
            return 0
        into = Path(args.into) if args.into else RESULTS
        if args.smoke and args.into is None:
            into = Path(args.json) / "RESULTS.smoke.md"
            into.parent.mkdir(parents=True, exist_ok=True)
            into.write_text(RESULTS.read_text(encoding="utf-8"), encoding="utf-8")
        only = [s for s in args.only.split(",") if s]
        return run(args.smoke, only or None, Path(args.json), into, args.timeout)
    except RenderError as exc:
        print(f"bench_tables: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
