"""Checkpoint stall: synchronous vs background (``checkpoint.async``) saves (issue 13).

One process trains a Llama-style model (``--hidden``, ``--layers``; AdamW) and saves its parameters and optimizer
state every ``--every`` steps through the engine's writer, either synchronously (``CheckpointWriter.save``) or with
``ckpt.async_save.AsyncSaver`` (snapshot, then written by a background thread). The stall of a save is the time the
training thread spends in the save call; the step time is the median of the steps without a save. Blocks of the two
modes alternate (order flipped every block, so drift hits both alike).

    .venv/bin/python benchmarks/ckpt_async.py [--blocks 6] [--hidden 512] [--layers 8]

Prints per mode the median stall ÷ step time with its interquartile range, the median step time while a background
write runs (its cost to training on shared cores), and ends with ``RESULT {json}``: async stall in steps (goal ≤ 1)
and async stall ÷ sync stall (goal ≤ 0.2).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _results import emit

RESULT_KEYS = ("async_stall_steps", "sync_stall_steps", "async_over_sync_stall", "async_over_sync_iqr", "goal")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def _block(mode: str, model, opt, batch, every: int, saves: int, root: Path) -> dict:
    import torch

    from kuangchao_core.ckpt.async_save import AsyncSaver
    from kuangchao_core.ckpt.writer import CheckpointWriter

    writer = CheckpointWriter(root, f"bench-{mode}", 0, 1, barrier=lambda: None, keep_last=2)
    saver = AsyncSaver(writer) if mode == "async" else None
    plain, busy, stalls = [], [], []
    step = 0
    for _ in range(saves):
        for _step_in_block in range(every):
            step += 1
            t0 = time.perf_counter()
            loss = model(batch).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            in_flight = saver is not None and saver._thread is not None and saver._thread.is_alive()
            (busy if in_flight else plain).append(dt)
        tensors = {f"param.{n}": p for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            for k, v in opt.state[p].items():
                if torch.is_tensor(v) and v.dim():
                    tensors[f"optim.{n}.{k}"] = v
        t0 = time.perf_counter()
        if saver is None:
            writer.save(step, tensors, rng_state={})
        else:
            saver.start(step, tensors, {})
        stalls.append(time.perf_counter() - t0)
    if saver is not None:
        saver.wait()
    return {"plain": plain, "busy": busy, "stalls": stalls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--every", type=int, default=8, help="steps between saves")
    ap.add_argument("--saves", type=int, default=3, help="saves per block")
    ap.add_argument("--smoke", action="store_true", help="hidden 64, one layer, one block of one save (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.blocks, args.hidden, args.layers, args.every, args.saves = 1, 64, 1, 2, 1
    import torch

    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    torch.manual_seed(0)
    h = args.hidden
    layers = [
        m for _ in range(args.layers) for m in (torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))
    ]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(64, h)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f} M parameters, checkpoint ≈ {3 * 4 * params / 2**20:.0f} MiB (params + AdamW)")
    ratios: dict[str, list[float]] = {"sync": [], "async": []}
    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    busy_ratio: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kc-ckpt-bench-") as tmp:
        for block in range(args.blocks):
            order = ("sync", "async") if block % 2 == 0 else ("async", "sync")
            for mode in order:
                out = _block(mode, model, opt, batch, args.every, args.saves, Path(tmp) / f"b{block}")
                step = statistics.median(out["plain"])
                ratios[mode] += [s / step for s in out["stalls"]]
                stalls[mode] += out["stalls"]
                if mode == "async" and out["busy"]:
                    busy_ratio.append(statistics.median(out["busy"]) / step)
    for mode in ("sync", "async"):
        lo, med, hi = _quartiles(ratios[mode])
        print(
            f"{mode:>5}: stall per save {med:.2f} steps (IQR {lo:.2f}–{hi:.2f}), {statistics.median(stalls[mode]) * 1e3:.0f} ms"
        )
    if busy_ratio:
        lo, med, hi = _quartiles(busy_ratio)
        print(f"async: a step while the background write runs takes {med:.2f}× a plain step (IQR {lo:.2f}–{hi:.2f})")
    per_block = [a / s for a, s in zip(stalls["async"], stalls["sync"], strict=False)]
    lo, med, hi = _quartiles(per_block)
    result = {
        "async_stall_steps": round(statistics.median(ratios["async"]), 3),
        "sync_stall_steps": round(statistics.median(ratios["sync"]), 3),
        "async_over_sync_stall": round(med, 3),
        "async_over_sync_iqr": [round(lo, 3), round(hi, 3)],
        "goal": "async stall <= 1 step and <= 0.2 x sync",
    }
    emit(result, RESULT_KEYS, smoke=args.smoke)


if __name__ == "__main__":
    main()
