"""Start in seconds (issue 27 §2): ``kc train`` against torchrun of a bare script training the same model.

Each block is one ``kc train`` of the tiny config (2 Gloo workers, every step logged, a new lineage each time; its
flow on a server kept between runs, ``kc server start``, or with ``--server temporary`` on Prefect's temporary
server, which ``--smoke`` uses; ``--prefect-api URL``: on that server) and one ``torchrun --nproc_per_node 2`` of
``benchmarks/_bare_train.py`` (the tiny preset, DDP, random tokens), the order flipped every block, each in a fresh
process. Measured from outside, from the process's start: the time to its first step line (``step 1/N`` /
``BARE step 1``) and from its last step line to the process's exit. A warm-up run of each comes first (MLflow's
store migrated, files cached: the issue's "warm machine"); it is not counted. Per block one ratio each, ours ÷ peer
(``benchmarks/_ratios.py``); also printed: the medians in seconds and kc train's own phase breakdown
(``startup_s`` / ``after_last_step_s`` of its ``summary.json``, medians per phase).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/startup.py [--blocks 3] [--steps 6] [--server kept|temporary]

The last line is ``RESULT {json}`` with ``ratio_vs_peer``, ``ratio_iqr``, ``ratio_min_max``, ``blocks`` keyed by
``to_step_1`` and ``after_last_step``, ``seconds`` (medians of each side) and ``server`` (which Prefect server).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ratios import FIELDS, block_stats, format_line, keyed_result_fields  # noqa: E402
from _results import emit  # noqa: E402

RESULT_KEYS = (*FIELDS, "seconds", "kc_phases", "server")

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
#: a step line: the bare script's, or kc train's message after its console prefix (``HH:MM:SS.mmm LEVEL source: ``)
STEP_LINE = re.compile(r"^(?:\d\d:\d\d:\d\d\.\d{3} [A-Z]+ +[\w.-]+: )?(?:BARE )?step (\d+)\b")


def _timed(argv: list[str], env: dict[str, str], cwd: Path, last_step: int, log: Path) -> dict[str, float]:
    """Run ``argv``; seconds from its start to its first step line, and from its last step line to its exit."""
    started = time.monotonic()
    first = last = None
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(log, "a", encoding="utf-8") as out:

        def read() -> None:
            nonlocal first, last
            for line in proc.stdout:
                out.write(line)
                m = STEP_LINE.match(line.strip())
                if m:
                    now = time.monotonic()
                    first = first or now
                    if int(m.group(1)) == last_step:
                        last = now

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        code = proc.wait()
        ended = time.monotonic()
        reader.join(10)
    if code != 0 or first is None or last is None:
        raise SystemExit(f"{argv[:4]}… exited {code} (first step {first}, last {last}); see {log}")
    return {"to_step_1": first - started, "after_last_step": ended - last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--server", choices=("kept", "temporary"), default="kept", help="kc train's Prefect server")
    parser.add_argument("--prefect-api", default=None, help="a running Prefect API instead")
    parser.add_argument("--kc-root", default=str(ROOT), help="the checkout whose kc train runs (e.g. an older one)")
    parser.add_argument("--smoke", action="store_true", help="one block of 2 steps, no warm-up runs")
    args = parser.parse_args()
    if args.smoke:
        args.blocks, args.steps, args.server = 1, 2, "temporary"

    work = Path(tempfile.mkdtemp(prefix="kc-startup-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": args.kc_root, "KC_RUNS_DIR": str(work / "runs")}
    env.pop("PREFECT_API_URL", None)
    server = "temporary"
    if args.prefect_api:
        env["PREFECT_API_URL"], server = args.prefect_api, args.prefect_api
    elif args.server == "kept":
        env["PREFECT_HOME"] = str(work / "prefect-home")
        kc = [PY, "-m", "kuangchao.cli.main", "server"]
        subprocess.run([*kc, "start", "--port", str(_free_port())], env=env, check=True, timeout=180)
        server = "kept"
    try:
        _measure(args, env, work, server)
    finally:
        if server == "kept":
            subprocess.run([*kc, "stop"], env=env, check=False, timeout=60)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure(args: argparse.Namespace, env: dict[str, str], work: Path, server: str) -> None:
    """The warm-up runs, the blocks, and the printed and emitted figures."""
    sets = {
        "train.steps": args.steps,
        "train.log_interval": 1,
        "train.eval_interval": 1000,
        "checkpoint.interval": args.steps,
        "data.synthetic.num_train": 512,
        "parallel.micro_batch_size": 2,
        "checkpoint.dir": work / "ckpt",
        "tracking.uri": f"sqlite:///{work / 'mlflow.db'}",
        "permission.audit_log": work / "audit",
    }
    ours = [PY, "-m", "kuangchao.cli.main", "train", "--config", str(Path(args.kc_root) / "configs" / "tiny.yaml")]
    ours += ["--resume", "never"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    peer = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    peer += [str(ROOT / "benchmarks" / "_bare_train.py"), "--steps", str(args.steps), "--micro-batch", "2"]
    sides = {"ours": ours, "peer": peer}
    log = work / "console.log"

    def run(side: str) -> dict[str, float]:
        return _timed(sides[side], env, work, args.steps, log)

    if not args.smoke:
        print(f"work directory {work}; warm-up runs (not counted)", flush=True)
        run("ours"), run("peer")
    times: dict[str, list[dict[str, float]]] = {"ours": [], "peer": []}
    for b in range(args.blocks):
        for side in ("ours", "peer") if b % 2 == 0 else ("peer", "ours"):
            times[side].append(run(side))
            t = times[side][-1]
            print(
                f"block {b} {side}: to step 1 {t['to_step_1']:.2f} s, after the last step {t['after_last_step']:.2f} s"
            )
    stats = {
        what: block_stats([([o[what]], [p[what]]) for o, p in zip(times["ours"], times["peer"], strict=True)])
        for what in ("to_step_1", "after_last_step")
    }
    seconds = {
        side: {what: round(statistics.median(t[what] for t in times[side]), 2) for what in stats} for side in times
    }
    phases = _kc_phases(work / "runs", warm_up=not args.smoke)
    for what, s in stats.items():
        print(format_line(f"kc train ÷ torchrun, {what}", s))
    print(f"kc train's Prefect server: {server}; medians (s): {json.dumps(seconds)}")
    print(f"kc train's phases, medians of the counted runs (s): {json.dumps(phases)}")
    result = {**keyed_result_fields(stats), "seconds": seconds, "kc_phases": phases, "server": server}
    emit(result, RESULT_KEYS, smoke=args.smoke)


def _kc_phases(runs: Path, warm_up: bool = True) -> dict[str, dict[str, float]]:
    """Median per phase of ``startup_s`` and ``after_last_step_s`` over the counted runs' summary.json files."""
    summaries = sorted(runs.glob("*/*/summary.json"))[1 if warm_up else 0 :]  # the first is the warm-up's
    out: dict[str, dict[str, float]] = {}
    for key in ("startup_s", "after_last_step_s"):
        rows = [json.loads(p.read_text()).get(key) for p in summaries]
        rows = [r for r in rows if r]
        names = dict.fromkeys(k for r in rows for k in r)
        out[key] = {k: round(statistics.median(r.get(k, 0.0) for r in rows), 2) for k in names}
    return out


if __name__ == "__main__":
    main()
