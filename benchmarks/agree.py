"""Do repeated runs of a benchmark agree within the spread they print? (issue 13: benchmarks you can trust)

Runs one ours-vs-peer benchmark ``--runs`` times in a row (each a fresh process), reads the ``RESULT {json}`` line
each run ends with and checks, for every comparison the benchmark reports, this rule:

    the runs agree when every run's median per-block ratio (``ratio_vs_peer``) lies within the min–max of the
    per-block ratios (``ratio_min_max``) of each other run.

A benchmark with one comparison reports those fields as numbers; one with several (``pp_schedules.py``) as
mappings comparison -> value, and each comparison is checked on its own. Prints each run's output (prefixed with
its number), then one table per comparison: median, IQR, min–max and blocks of each run and whether its median
lies inside every other run's min–max.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/agree.py NAME [--runs 3] [--timeout S] [benchmark args...]

``NAME``: a benchmark of this folder (``dp_vs_ddp``, ``dp_vs_ddp.py``) or a path to one. Options other than
``--runs`` and ``--timeout`` go to the benchmark; after ``--`` everything does. ``OMP_NUM_THREADS`` defaults to 1
in the runs. Exit status: 0 the runs agree, 1 they do not, 2 a run failed or printed no ``RESULT`` with a spread.

``--smoke`` (what ``tests/test_bench_smoke.py`` runs): two runs of the benchmark's own ``--smoke`` (NAME defaults to
``packed_rows_step``), the whole report, exit status 0 whether they agree or not (one-block runs say nothing about
agreement; the smoke run checks the machinery). Ends with ``AGREE {json}`` and the same as ``RESULT {json}``.

Not a benchmark itself: ``make bench`` skips this file (``tools/bench_tables.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT_KEYS = ("benchmark", "runs", "agree", "each")
SMOKE_BENCHMARK = "packed_rows_step"


def _fail(msg: str) -> SystemExit:
    """The exit of a failed run or a bad argument: ``msg`` on stderr, status 2."""
    print(f"agree: {msg}", file=sys.stderr)
    return SystemExit(2)


def _script(name: str) -> Path:
    path = Path(name)
    if path.suffix != ".py":
        path = path.with_suffix(".py")
    if not path.exists() and not path.is_absolute():
        path = HERE / path.name
    if not path.is_file():
        raise _fail(f"no benchmark {name!r} (looked for {path})")
    return path


def run_once(script: Path, bench_args: list[str], index: int, timeout: float | None) -> dict:
    """Run the benchmark once, echo its output prefixed with ``[run index]``; return its parsed RESULT."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("KC_BENCH_JSON", None)  # the repeated runs are checked here, not rendered into RESULTS.md
    cmd = [sys.executable, str(script), *bench_args]
    print(f"[run {index}] $ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    # its own session, so that a timeout ends the benchmark's worker processes too
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    timed_out = threading.Event()

    def _kill() -> None:
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, _kill) if timeout else None
    if timer:
        timer.start()
    result_line = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"[run {index}] {line}", end="", flush=True)
            if line.startswith("RESULT "):
                result_line = line[len("RESULT ") :]
        rc = proc.wait()
    finally:
        if timer:
            timer.cancel()
    wall = time.perf_counter() - t0
    if timed_out.is_set():
        raise _fail(f"run {index} took longer than {timeout} s")
    if rc != 0:
        raise _fail(f"run {index} exited with status {rc}")
    if result_line is None:
        raise _fail(f"run {index} printed no RESULT line")
    result = json.loads(result_line)
    print(f"[run {index}] wall time {wall:.1f} s", flush=True)
    return result


def comparisons(result: dict) -> dict[str, dict]:
    """The comparisons of one RESULT: name -> {median, iqr, min_max, blocks} (name ``""`` for a lone one)."""
    try:
        med, iqr, mm, blocks = (result[k] for k in ("ratio_vs_peer", "ratio_iqr", "ratio_min_max", "blocks"))
    except KeyError as exc:
        raise _fail(f"the RESULT has no {exc.args[0]!r}: the benchmark prints no spread") from None
    if not isinstance(med, dict):
        return {"": {"median": med, "iqr": iqr, "min_max": mm, "blocks": blocks}}

    def pick(field, name):
        return field[name] if isinstance(field, dict) else field

    return {
        name: {"median": med[name], "iqr": pick(iqr, name), "min_max": pick(mm, name), "blocks": pick(blocks, name)}
        for name in med
    }


def check(runs: list[dict]) -> tuple[bool, list[str]]:
    """Apply the rule to one comparison's runs; returns (agree, one note per run: '' or what it falls outside)."""
    notes = []
    for i, r in enumerate(runs):
        outside = [
            f"run {j + 1}'s {o['min_max'][0]:.3f}–{o['min_max'][1]:.3f}"
            for j, o in enumerate(runs)
            if j != i and not (o["min_max"][0] <= r["median"] <= o["min_max"][1])
        ]
        notes.append(", ".join(outside))
    return not any(notes), notes


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("name", nargs="?", help="benchmark: dp_vs_ddp, pp_schedules.py, or a path")
    ap.add_argument("--runs", type=int, default=3, help="runs in a row (default 3)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds one run may take (default: no limit)")
    ap.add_argument("--smoke", action="store_true", help=f"2 runs of NAME --smoke (default {SMOKE_BENCHMARK})")
    args, bench_args = ap.parse_known_args(argv)
    bench_args += passthrough
    if args.smoke:
        args.name, args.runs = args.name or SMOKE_BENCHMARK, 2
        bench_args.append("--smoke")
    if args.name is None:
        ap.error("the benchmark NAME is required")
    if args.runs < 2:
        ap.error("--runs must be at least 2")
    script = _script(args.name)
    per_run = [comparisons(run_once(script, bench_args, i + 1, args.timeout)) for i in range(args.runs)]
    names = list(per_run[0])
    if any(list(c) != names for c in per_run):
        print("agree: the runs report different comparisons", file=sys.stderr)
        return 2
    all_agree = True
    summary = {}
    for name in names:
        runs = [c[name] for c in per_run]
        ok, notes = check(runs)
        all_agree &= ok
        summary[name or script.stem] = ok
        print(f"\n{script.stem}{' ' + name if name else ''}: ours ÷ peer, median of per-block ratios")
        print(
            f"{'run':>3}  {'median':>7}  {'IQR':>13}  {'min–max':>13}  {'blocks':>6}  inside every other run's min–max"
        )
        for i, (r, note) in enumerate(zip(runs, notes, strict=True)):
            iqr = f"{r['iqr'][0]:.3f}–{r['iqr'][1]:.3f}"
            mm = f"{r['min_max'][0]:.3f}–{r['min_max'][1]:.3f}"
            print(
                f"{i + 1:>3}  {r['median']:>7.3f}  {iqr:>13}  {mm:>13}  {r['blocks']:>6}  "
                f"{'yes' if not note else 'no: outside ' + note}"
            )
        print(f"agree: {'yes' if ok else 'no'}")
    record = {"benchmark": script.stem, "runs": args.runs, "agree": all_agree, "each": summary}
    print("\nAGREE " + json.dumps(record))
    sys.path.insert(0, str(HERE))
    from _results import emit

    emit(record, RESULT_KEYS, smoke=args.smoke)
    return 0 if all_agree or args.smoke else 1


if __name__ == "__main__":
    raise SystemExit(main())
