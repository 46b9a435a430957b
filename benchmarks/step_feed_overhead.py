"""Cost of the per-step Prometheus feed (issue 27 §4): a training step with rank 0's ``StepFeed`` recording every
step vs without it.

One process trains a small MLP (4 × Linear(64, 64), batch 64: a step of well under a millisecond, so the feed's cost
shows far more than on a real model's step). Blocks of steps alternate between recording each step into a
:class:`~kuangchao_core.obs.step_feed.StepFeed` and not (the order flipped every block); the feed's thread sends its
``steps`` events into a real pipe read by a ``cat`` process, as a worker's stdout is read by the launcher. Each block
gives one ratio, median step with the feed ÷ median step without (``benchmarks/_ratios.py``). Also measured: one
``record`` call in nanoseconds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_feed_overhead.py [--blocks 20] [--steps 200]

The last line is ``RESULT {json}`` with ``ratio_vs_peer`` = median of the per-block feed ÷ no-feed ratios,
``ratio_iqr``, ``ratio_min_max`` and ``blocks``.
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ratios import FIELDS, block_stats, format_line, result_fields  # noqa: E402
from _results import emit  # noqa: E402

RESULT_KEYS = ("benchmark", "step_ms_with", "step_ms_without", *FIELDS, "record_ns")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="one block of 5 steps (seconds)")
    args = parser.parse_args()
    if args.smoke:
        args.blocks, args.steps = 1, 5

    import torch

    from kuangchao_core.obs.jsonlog import emit_event
    from kuangchao_core.obs.step_feed import StepFeed

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 64), torch.randn(64, 1)
    reader = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    pipe = io.TextIOWrapper(reader.stdin, encoding="utf-8", line_buffering=False)
    feed = StepFeed(emit=lambda kind, **fields: emit_event(kind, stream=pipe, **fields))

    def block(with_feed: bool, first_step: int) -> list[float]:
        times = []
        for i in range(args.steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            metrics = {"loss": loss.item(), "lr": 1e-3, "tokens_per_s": 1e6, "grad_norm": 1.0, "comm_share": 0.0}
            if with_feed:
                feed.record(first_step + i, time.perf_counter() - t0, metrics)
            times.append(time.perf_counter() - t0)
        return times

    block(True, 0)  # warm-up of both paths
    block(False, 0)
    blocks, step = [], args.steps
    for b in range(args.blocks):
        order = (True, False) if b % 2 == 0 else (False, True)
        got = {}
        for with_feed in order:
            got[with_feed] = block(with_feed, step)
            step += args.steps
        blocks.append((got[True], got[False]))
    feed.close()

    n = 1_000 if args.smoke else 100_000
    probe = StepFeed(period_s=3600, emit=lambda kind, **fields: None)
    t0 = time.perf_counter_ns()
    for i in range(n):
        probe.record(i, 0.01, {"loss": 1.0})
    record_ns = (time.perf_counter_ns() - t0) / n
    probe.close()
    pipe.close()
    reader.wait(timeout=30)

    stats = block_stats(blocks)
    with_ms = statistics.median(t for b in blocks for t in b[0]) * 1e3
    without_ms = statistics.median(t for b in blocks for t in b[1]) * 1e3
    print(f"median step with the feed {with_ms:.3f} ms, without {without_ms:.3f} ms (all blocks)")
    print(format_line("feed/no feed", stats))
    print(f"one StepFeed.record: {record_ns:.0f} ns")
    result = {
        "benchmark": "step_feed_overhead",
        "step_ms_with": round(with_ms, 4),
        "step_ms_without": round(without_ms, 4),
    }
    result |= result_fields(stats) | {"record_ns": round(record_ns)}
    emit(result, RESULT_KEYS, smoke=args.smoke)


if __name__ == "__main__":
    main()
